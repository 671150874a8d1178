"""A request as the scheduler sees it: prompt, sampling limits, output, state, KV record."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv import ReqKV
from kvserve.sched.state import ReqState

CLIP_MAX_NEW_TOKENS = 4096  # SGLang: cap of max_new_tokens in admission estimates


class RequestRejected(ValueError):
    """``add_request`` refused a request; it holds nothing and is not queued."""


class QueueFull(RequestRejected):
    """The waiting queue is at its bound (``max_queued_requests``); retry later."""


@dataclass(slots=True)
class SamplingParams:
    """Stopping limits the scheduler enforces (sampling itself lives in the model runner).

    ``max_new_tokens=0`` runs the prefill only (warms the prefix cache) and returns
    no tokens. ``min_new_tokens`` (SGLang's name; vLLM's ``min_tokens``): until the
    output holds that many tokens, EOS and ``stop_token_ids`` are masked out of the
    logits and no stop (token or string) ends the request; only the length limits do.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched by the engine on a tail decode
    ignore_eos: bool = False
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same tokens whatever the batch
    return_logprob: bool = False  # log-probability of each chosen token (model's logits)

    def validate(self) -> None:
        """Raises RequestRejected naming the first bad field. Values must also fit the
        batch tensors (float32 temperature/top_p/min_p, int32 top_k, int64 seed, bool
        flags): a value that cannot be packed would fail the whole step, not one request."""
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            try:
                finite = isinstance(value, int | float) and math.isfinite(value)
            except OverflowError:  # an int beyond float range
                finite = False
            if not finite or isinstance(value, bool):
                raise RequestRejected(f"{name} must be a finite number, got {value!r}")
        for name in ("ignore_eos", "return_logprob"):
            if not isinstance(getattr(self, name), bool):
                raise RequestRejected(f"{name} must be true or false, got "
                                      f"{getattr(self, name)!r}")
        if isinstance(self.top_k, int) and self.top_k > 2**31 - 1:
            raise RequestRejected(f"top_k must be at most 2**31 - 1, got {self.top_k}")
        if isinstance(self.seed, int) and self.seed > 2**63 - 1:
            raise RequestRejected(f"seed must be at most 2**63 - 1, got {self.seed}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise RequestRejected(f"max_new_tokens must be an integer >= 0, got "
                                  f"{self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise RequestRejected(f"min_new_tokens must be an integer >= 0, got "
                                  f"{self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestRejected(f"min_new_tokens ({self.min_new_tokens}) must be at most "
                                  f"max_new_tokens ({self.max_new_tokens})")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise RequestRejected("stop_token_ids must be non-negative integers")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestRejected("stop strings must be non-empty strings")
        if not all(_encodes(s) for s in self.stop):  # matched on UTF-8 bytes in the step
            raise RequestRejected("stop strings must be valid Unicode text (no lone "
                                  "surrogates)")
        if not self.temperature >= 0:
            raise RequestRejected(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestRejected(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise RequestRejected(f"top_k must be -1 or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise RequestRejected(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise RequestRejected(f"seed must be a non-negative integer, got {self.seed!r}")


def _is_int(value: object) -> bool:
    """An int that is not a bool (JSON ``true`` is no token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class FinishReason:
    kind: FinishKind
    message: str = ""
    matched_token: int | None = None
    matched_stop: str | None = None  # the stop string that ended the output


OOM_MESSAGE = "out of memory even after retracting all other requests"


@dataclass(eq=False, slots=True)
class Req:
    """One request. ``kv`` is always present; its predicates say what is held."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    extra_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # with return_logprob
    kv: ReqKV = field(default_factory=ReqKV)
    state: ReqState = ReqState.WAITING
    finished_reason: FinishReason | None = None
    to_finish: FinishReason | None = None  # abort decided, applied when results are processed
    cached_tokens: int = 0  # prefix tokens found in the cache at first admission
    admissions: int = 0
    arrival: int = 0  # order of add_request; requests re-queued together keep it
    # scheduling scratch: the last match (no lock) and this step's extend length
    match_len: int = 0
    match_node: Any = None
    extend_len: int = 0
    # finish limits, fixed at add_request: stop when the output reaches max_output_len
    # (max_new_tokens or the context limit) or a token in stop_ids is sampled
    max_output_len: int = 0
    fast_path_outputs: int = 0
    stop_ids: frozenset[int] = frozenset()
    session: Any = None  # the StreamingSession this request is a turn of (sched.session)

    @property
    def fill_ids(self) -> list[int]:
        """Prompt then output: the sequence whose KV the request computes."""
        return self.prompt_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def req_pool_idx(self) -> int | None:
        """SGLang's name for the row; says nothing about holding KV."""
        return self.kv.row

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED
