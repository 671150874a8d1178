"""The scheduler: continuous batching, chunked prefill, retraction and aborts.

One step (SGLang's event loop, kept in the shape overlap scheduling needs)::

    process_pending_chunked_abort()      release an aborted chunked request, never mid-step
    batch = get_next_batch_to_run()      prefill if one can be formed, else decode
    launch(batch)                        ForwardBatch -> model.forward
    process_batch_result(batch, result)  commit KV, append tokens, finish, cache
    release_deferred(batch_id)           frees made while the batch was in flight
    checker                              strict after every step, or at idle

Every exit of a request (finish, abort in any queue, retraction, out of memory)
goes through ``release_kv_cache``.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvserve.cache.base import BasePrefixCache
from kvserve.cache.chunk import ChunkCache
from kvserve.cache.radix import RadixCache
from kvserve.forward import (
    ForwardBatch,
    ForwardMode,
    ModelOutput,
    ModelRunnerLike,
    SamplingBatch,
)
from kvserve.kv import (
    DecodeAlloc,
    alloc_for_decode,
    alloc_for_extend,
    alloc_for_spec_decode,
    commit_kv,
    make_room,
    release_kv_cache,
    req_slot_ids,
    spec_reserve_tokens,
)
from kvserve.mem.pages import ceil_page, int_tensor, num_pages
from kvserve.mem.pools import MemoryPools
from kvserve.sched.batch import ScheduleBatch
from kvserve.sched.invariants import CheckReport, InvariantChecker, InvariantViolation
from kvserve.sched.policy import AddResult, NewTokenRatio, PrefillAdder
from kvserve.sched.req import (
    OOM_MESSAGE,
    FinishKind,
    FinishReason,
    Req,
    RequestRejected,
    SamplingParams,
)
from kvserve.sched.state import ReqState

logger = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1
LPM_FALLBACK_QUEUE_LEN = 128  # lpm acts as fcfs above this many waiting (SGLang)


class ConfigError(ValueError):
    """Scheduler settings that cannot work together."""


class SchedulerStuck(RuntimeError):
    """``run_until_idle`` saw steps stop making progress, or ran out of steps."""


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding shape (EAGLE-style): steps x topk drafts, verified tokens."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def reserve(self) -> int:
        return spec_reserve_tokens(self.num_steps, self.topk, self.num_draft_tokens)


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one engine. Token counts are tokens; ``chunked_prefill_size`` None or
    <= 0 disables chunking."""

    page_size: int = 1
    context_len: int = 4096
    max_running_requests: int = 256
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # token ids must be below it (None: any int32)
    speculative: SpecConfig | None = None
    strict_checks: bool = False
    raise_on_violation: bool = False

    def validate(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk > 0 and chunk % self.page_size:
            raise ConfigError(
                f"chunked_prefill_size ({chunk}) must be a multiple of page_size "
                f"({self.page_size})"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError(f"schedule_policy must be 'fcfs' or 'lpm', got "
                              f"{self.schedule_policy!r}")
        if self.context_len < 2 or self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ConfigError("context_len >= 2, max_running_requests >= 1 and "
                              "max_prefill_tokens >= 1 are required")
        if self.schedule_conservativeness <= 0:
            raise ConfigError("schedule_conservativeness must be > 0")

    @property
    def chunk_size(self) -> int | None:
        chunk = self.chunked_prefill_size
        return chunk if chunk is not None and chunk > 0 else None


class AbortStatus(enum.Enum):
    ABORTED = "aborted"  # released now
    PENDING = "pending"  # released when the running step's results (or next step) are processed
    NOT_FOUND = "not found"  # unknown or already finished: nothing done


class ReqOutput(NamedTuple):
    """What one step produced for one request."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_logprobs: list[float] | None = None  # at finish, with return_logprob


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    retractions: int = 0
    aborts: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sched_seconds: list[float] = field(default_factory=list)
    model_seconds: list[float] = field(default_factory=list)
    checker_seconds: list[float] = field(default_factory=list)
    checker_runs: int = 0
    violations: int = 0  # checker runs that found at least one violation
    decode_step: list[bool] = field(default_factory=list)


_new_output = tuple.__new__  # builds a ReqOutput without NamedTuple.__new__'s Python frame


def make_tree_cache(pools: MemoryPools, disable_radix_cache: bool) -> BasePrefixCache:
    return ChunkCache(pools) if disable_radix_cache else RadixCache(pools)


class Scheduler:
    """Continuous batching over the pools, with the checker as its witness.

    Args:
        config: limits and policies (validated here; ConfigError on bad values).
        pools: rows, KV allocator (and buffers) the model reads.
        model: anything with ``forward(ForwardBatch) -> ModelOutput``.
    """

    def __init__(self, config: SchedulerConfig, pools: MemoryPools, model: ModelRunnerLike) -> None:
        config.validate()
        if pools.page_size != config.page_size:
            raise ConfigError(f"pool page size {pools.page_size} != config {config.page_size}")
        self.config = config
        self.pools = pools
        self.model = model
        self._uses_sampling = bool(getattr(model, "uses_sampling_params", False))
        self.tree_cache = make_tree_cache(pools, config.disable_radix_cache)
        self.checker = InvariantChecker(self.tree_cache, strict=config.strict_checks)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.held_pages: dict[str, list[int]] = {}
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.stats = SchedulerStats()
        self.last_report: CheckReport | None = None
        self.on_admitted: Callable[[list[Req]], None] | None = None
        # req -> the stop string its output now contains, if any. Set by the engine,
        # which owns the tokenizer (checked after every appended token).
        self.stop_string_matcher: Callable[[Req], str | None] | None = None
        self.on_launch: Callable[[ScheduleBatch], None] | None = None
        self._batch_ids = itertools.count(1)
        self._rids = itertools.count()
        self._inflight: ScheduleBatch | None = None
        self._outputs: list[ReqOutput] = []
        self._checked_idle = True

    # -- requests in and out ---------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        extra_key: str | None = None,
    ) -> Req:
        """Queue a request. Raises RequestRejected (holding nothing) for a duplicate
        rid, an empty prompt, a prompt longer than ``context_len - 1`` or than the
        whole KV pool, token ids outside int32, or bad sampling limits."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        if rid in self.reqs:
            raise RequestRejected(f"duplicate request id {rid!r}")
        prompt = list(prompt_ids)
        if not prompt:
            raise RequestRejected("empty prompt")
        limit = self.config.context_len - 1
        if len(prompt) > limit:
            raise RequestRejected(f"prompt of {len(prompt)} tokens is longer than the context "
                                  f"limit of {limit} (context_len - 1)")
        if len(prompt) > self.pools.allocator.size:
            raise RequestRejected(f"prompt of {len(prompt)} tokens exceeds the KV pool of "
                                  f"{self.pools.allocator.size} tokens")
        vocab = self.config.vocab_size
        limit = _INT32_MAX if vocab is None else vocab - 1
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= limit
               for t in prompt):
            bound = "2**31 - 1" if vocab is None else f"{limit} (the vocabulary size is {vocab})"
            raise RequestRejected(f"token ids must be integers in [0, {bound}]")
        req = Req(rid, prompt, sampling, extra_key)
        req.max_output_len = min(sampling.max_new_tokens, self.config.context_len - len(prompt))
        # decode's fast path (no finish possible) applies below this output length
        req.fast_path_outputs = 0 if sampling.stop else req.max_output_len - 1
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops.update(self.config.eos_token_ids)
        req.stop_ids = frozenset(stops)
        self.reqs[rid] = req
        self.waiting.append(req)
        return req

    def abort_request(self, rid: str, message: str = "aborted by request") -> AbortStatus:
        """Abort at any stage. Waiting: released now. Admitted, chunked or running:
        ``to_finish`` is set and the request is released when the step's results are
        processed (the chunked one by ``process_pending_chunked_abort``)."""
        req = self.reqs.get(rid)
        if req is None:
            return AbortStatus.NOT_FOUND
        reason = FinishReason(FinishKind.ABORT, message)
        if req.state in (ReqState.WAITING, ReqState.RETRACTED):
            self.waiting.remove(req)
            self._finish(req, reason, insert=False)
            return AbortStatus.ABORTED
        req.to_finish = reason
        return AbortStatus.PENDING

    @property
    def is_idle(self) -> bool:
        return not self.reqs

    # -- the step -------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One scheduler iteration; returns what each touched request produced."""
        start = time.perf_counter()
        model_seconds = 0.0
        self.process_pending_chunked_abort()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self._inflight = batch
            if self.on_launch is not None:
                self.on_launch(batch)
            t0 = time.perf_counter()
            result = self.model.forward(batch.forward_batch)
            model_seconds = time.perf_counter() - t0
            self.process_batch_result(batch, result)
            self._inflight = None
            self.tree_cache.release_deferred(batch.batch_id)
        elif not self.running and self.chunked_req is None:
            self.ratio.reset()
        stats = self.stats
        stats.steps += 1
        stats.sched_seconds.append(time.perf_counter() - start - model_seconds)
        stats.model_seconds.append(model_seconds)
        stats.decode_step.append(batch is not None and batch.forward_mode is ForwardMode.DECODE)
        stats.checker_seconds.append(self._run_checker())
        return self.take_outputs()

    def take_outputs(self) -> list[ReqOutput]:
        """Outputs produced since the last call (``step`` returns them too; an abort of a
        waiting request between steps produces one without a step)."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def run_until_idle(self, max_steps: int = 100_000) -> list[ReqOutput]:
        """Step until no request is live. Raises SchedulerStuck when a step changes
        nothing while requests wait (nothing else could change it) or after
        ``max_steps`` steps."""
        outputs: list[ReqOutput] = self.take_outputs()  # e.g. an abort made while waiting
        for _ in range(max_steps):
            if self.is_idle:
                return outputs
            before = self._progress_marker()
            outputs += self.step()
            if self._progress_marker() == before:
                raise SchedulerStuck(f"no progress with {len(self.reqs)} live requests:\n"
                                     f"{self.checker.check(self.reqs.values(), self.held_pages)}")
        if not self.is_idle:
            raise SchedulerStuck(f"{len(self.reqs)} requests still live after {max_steps} steps")
        return outputs

    def _progress_marker(self) -> tuple[int, ...]:
        return (
            len(self.reqs),
            sum(r.seq_len + r.kv.committed_len for r in self.reqs.values()),
            self.stats.retractions,
            self.stats.prefill_batches,
        )

    def process_pending_chunked_abort(self) -> None:
        """Release the chunked request if it was aborted since the last step."""
        req = self.chunked_req
        if req is not None and req.to_finish is not None:
            self.chunked_req = None
            self._finish(req, req.to_finish, insert=True)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        return self.get_new_batch_prefill() or self.get_decode_batch()

    # -- prefill --------------------------------------------------------------------
    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        cfg = self.config
        chunked = self.chunked_req
        if chunked is None and not self.waiting:
            return None
        if chunked is None and len(self.running) >= cfg.max_running_requests:
            return None
        adder = PrefillAdder(
            self.tree_cache, self.running, self.ratio.value, cfg.max_prefill_tokens,
            cfg.chunk_size, cfg.max_running_requests - len(self.running) - (chunked is not None),
        )
        if chunked is not None and not adder.add_chunked_req(chunked):
            return None  # its next chunk does not fit yet: decode frees memory first
        match_each = not self._match_waiting()
        rows_free = self.pools.req_to_token_pool.available_size()
        for req in self.waiting:
            if match_each:
                self._match(req)
            result = adder.add_one_req(req, rows_free)
            if req.state is ReqState.ADMITTED:
                rows_free -= 1
            if result is not AddResult.CONTINUE:
                break
        admitted = [r for r in adder.can_run if r is not chunked]
        if admitted:
            self.waiting = [r for r in self.waiting if r.state is not ReqState.ADMITTED]
            for req in admitted:
                req.admissions += 1
                if req.admissions == 1:
                    req.cached_tokens = req.match_len
                    self.stats.prompt_tokens += len(req.prompt_ids)
                    self.stats.cached_tokens += req.match_len
            if self.on_admitted is not None:
                self.on_admitted(admitted)
        self.chunked_req = adder.new_chunked_req
        reqs = [req for req in adder.can_run if self._prepare_extend(req)]
        if not reqs:
            return None
        self.stats.prefill_batches += 1
        return self._build_batch(ForwardMode.EXTEND, reqs)

    def _match_waiting(self) -> bool:
        """``lpm``: match every waiting request and order by longest match; True when
        done. ``fcfs``, or ``lpm`` with more than ``LPM_FALLBACK_QUEUE_LEN`` waiting (as
        SGLang, so matching stays cheap under a long queue): False, and requests are
        matched one by one as the adder reaches them."""
        if self.config.schedule_policy != "lpm" or len(self.waiting) > LPM_FALLBACK_QUEUE_LEN:
            return False
        for req in self.waiting:
            self._match(req)
        self.waiting.sort(key=lambda r: -r.match_len)
        return True

    def _match(self, req: Req) -> None:
        """Prefix match without a lock, capped so at least one token is computed."""
        fill = req.fill_ids
        match = self.tree_cache.match_prefix(fill[: len(fill) - 1], req.extra_key)
        req.match_len, req.match_node = match.prefix_len, match.last_node

    def _prepare_extend(self, req: Req) -> bool:
        """Allocate row + pages for this step's chunk; False drops it from the batch."""
        if req.to_finish is not None:  # aborted after admission, before its extend
            if req is self.chunked_req:
                self.chunked_req = None
            self._finish(req, req.to_finish, insert=True)
            return False
        if not alloc_for_extend(req, self.tree_cache, req.extend_len):
            # The admission estimate covers this allocation; if it ever misses, the
            # request goes back to waiting and the step ends cleanly.
            logger.warning("extend allocation of %s missed after admission", req.rid)
            if req is self.chunked_req:
                self.chunked_req = None
            self._retract(req)
            return False
        done = req.kv.committed_len + req.extend_len >= req.seq_len
        req.state = ReqState.RUNNING if done else ReqState.CHUNKED
        return True

    # -- decode ---------------------------------------------------------------------
    def get_decode_batch(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        retracted = self._check_decode_mem()
        spec = self.config.speculative
        decode = None
        if spec is None:
            decode = alloc_for_decode(self.running, self.tree_cache)
            failed = decode.failed
        else:
            failed = [r for r in self.running
                      if not alloc_for_spec_decode(r, self.tree_cache, spec.reserve)]
        for req in failed:  # the memory check covers these; retract if it ever misses
            self.running.remove(req)  # type: ignore[arg-type]
            self._retract(req)  # type: ignore[arg-type]
        if not self.running:
            return None
        if not retracted and not failed:
            self.ratio.on_decode_step()
        self.stats.decode_batches += 1
        if decode is not None:
            if failed:  # rare: the slots of the requests that stayed
                decode = alloc_for_decode(self.running, self.tree_cache)
            return self._build_decode_batch(list(self.running), decode)
        return self._build_batch(ForwardMode.DECODE, list(self.running))

    def _build_decode_batch(self, reqs: list[Req], decode: DecodeAlloc) -> ScheduleBatch:
        """One token per request at position ``committed_len`` (the hot path)."""
        device = self.pools.req_to_token_pool.req_to_token.device
        n = len(reqs)
        # one host->device copy for the four per-request vectors
        packed = int_tensor(
            [r.output_ids[-1] for r in reqs] + decode.positions + decode.out_cache_loc
            + decode.rows, torch.int32, device,
        )
        input_ids, positions, out_cache_loc, rows = packed.view(4, n).unbind(0)
        batch_id = next(self._batch_ids)
        forward = ForwardBatch(
            batch_id=batch_id,
            forward_mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=positions + 1,
            prefix_lens=positions,
            extend_lens=torch.ones(n, dtype=torch.int32, device=device),
            sample=torch.ones(n, dtype=torch.bool, device=device),
            sampling=self._sampling_batch(reqs, device),
        )
        return ScheduleBatch(batch_id, ForwardMode.DECODE, reqs, forward)

    def _decode_pages_needed(self, req: Req) -> int:
        spec = self.config.speculative
        page_size = self.config.page_size
        kv = req.kv
        if spec is None:
            target = kv.committed_len + 1
        else:
            target = ceil_page(kv.committed_len + spec.reserve, page_size)
        return max(num_pages(target, page_size) - len(kv.page_ids), 0)

    def _check_decode_mem(self) -> bool:
        """Make room for one decode step: evict the shortfall from the cache, then
        retract (SGLang's order: fewest output tokens first, then longest prompt).
        Returns whether anything was retracted."""
        alloc = self.pools.allocator
        if self.config.speculative is None:  # a page where the next position starts one
            page_size = alloc.page_size
            need = sum(1 for r in self.running
                       if r.kv.committed_len >= len(r.kv.page_ids) * page_size)
        else:
            need = sum(self._decode_pages_needed(r) for r in self.running)
        if make_room(self.tree_cache, need):
            return False
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)),
                       reverse=True)
        retracted = False
        # A victim's pages may go to the cache (its prompt was inserted after prefill):
        # evict again after each one before deciding another is needed (as SGLang).
        while not make_room(self.tree_cache, need):
            if len(self.running) == 1:
                last = self.running.pop()
                self._finish(last, FinishReason(FinishKind.ABORT, OOM_MESSAGE), insert=False)
                break
            victim = order.pop()
            need -= self._decode_pages_needed(victim)
            self.running.remove(victim)
            self._retract(victim)
            retracted = True
        if retracted:
            self.ratio.on_retract(self.running)
        return retracted

    # -- batches --------------------------------------------------------------------
    def _build_batch(self, mode: ForwardMode, reqs: list[Req]) -> ScheduleBatch:
        pools = self.pools
        device = pools.req_to_token_pool.req_to_token.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        rows, seq_lens, prefix_lens, extend_lens, sample = [], [], [], [], []
        spec = self.config.speculative
        for req in reqs:
            kv = req.kv
            start = kv.committed_len
            if mode is ForwardMode.EXTEND:
                end = start + req.extend_len
                input_ids += req.fill_ids[start:end]
                positions += range(start, end)
                slots.append(req_slot_ids(pools, kv, start, end))
                width, last = end - start, end
                sample.append(end >= req.seq_len)
            else:  # speculative window (plain decode: _build_decode_batch)
                assert spec is not None
                input_ids.append(req.output_ids[-1])
                positions.append(start)
                width = spec.reserve
                slots.append(req_slot_ids(pools, kv, start, start + width))
                last = start + 1
                sample.append(True)
            rows.append(kv.row)
            seq_lens.append(last)
            prefix_lens.append(start)
            extend_lens.append(width)
        out_cache_loc = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int32)

        def i32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        batch_id = next(self._batch_ids)
        forward = ForwardBatch(
            batch_id=batch_id,
            forward_mode=mode,
            input_ids=i32(input_ids),
            positions=i32(positions),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=i32(rows),
            seq_lens=i32(seq_lens),
            prefix_lens=i32(prefix_lens),
            extend_lens=i32(extend_lens),
            sample=torch.tensor(sample, dtype=torch.bool, device=device),
            speculative=mode is ForwardMode.DECODE and spec is not None,
            sampling=self._sampling_batch(reqs, device),
        )
        return ScheduleBatch(batch_id, mode, reqs, forward)

    def _sampling_batch(self, reqs: list[Req], device: torch.device) -> SamplingBatch | None:
        if not self._uses_sampling:
            return None
        params = [r.sampling for r in reqs]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=int_tensor([p.top_k for p in params], torch.int32, device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            seed=int_tensor([-1 if p.seed is None else p.seed for p in params], torch.int64,
                            device),
            return_logprob=torch.tensor([p.return_logprob for p in params], dtype=torch.bool,
                                        device=device),
        )

    def process_batch_result(self, batch: ScheduleBatch, result: ModelOutput) -> None:
        if len(result.token_ids) != len(batch.reqs):
            raise ValueError(f"model returned {len(result.token_ids)} results for "
                             f"{len(batch.reqs)} requests")
        fb = batch.forward_batch
        finished_before = self.stats.finished
        lengths = [len(r.output_ids) for r in batch.reqs] if result.logprobs is not None else []
        if batch.forward_mode is ForwardMode.DECODE and not fb.speculative:
            self._process_decode(batch.reqs, result.token_ids)
        else:
            widths = fb.extend_lens.tolist()
            for req, tokens, width in zip(batch.reqs, result.token_ids, widths, strict=True):
                if req.to_finish is not None:
                    if req is self.chunked_req:
                        self.chunked_req = None
                    self._finish(req, req.to_finish, insert=True)
                elif batch.forward_mode is ForwardMode.EXTEND:
                    self._process_extend(req, tokens)
                else:
                    if len(tokens) > width:
                        raise ValueError(f"model accepted {len(tokens)} tokens for {req.rid}, "
                                         f"window {width}")
                    self._append_tokens(req, tokens, commit=True)
        if self.stats.finished != finished_before:
            self.running = [r for r in self.running if r.state is ReqState.RUNNING]
        if result.logprobs is not None:  # keep those of the tokens that were kept
            for req, before, logprobs in zip(batch.reqs, lengths, result.logprobs, strict=True):
                if req.sampling.return_logprob:
                    req.output_logprobs += logprobs[: len(req.output_ids) - before]

    def _process_decode(self, reqs: list[Req], results: list[list[int]]) -> None:
        """One token per request (the hot path): commit its input's KV, append it."""
        outputs = self._outputs
        for req, tokens in zip(reqs, results, strict=True):
            if req.to_finish is not None:
                self._finish(req, req.to_finish, insert=True)
                continue
            try:
                (token,) = tokens
            except ValueError:
                raise ValueError(f"model returned {len(tokens)} tokens for {req.rid} in "
                                 "decode") from None
            out = req.output_ids
            if token in req.stop_ids or len(out) >= req.fast_path_outputs:
                self._append_tokens(req, tokens, commit=True)
                continue
            kv = req.kv
            if kv.committed_len >= kv.allocated_len:
                commit_kv(req, 1)  # raises: no slot was allocated for this token
            kv.committed_len += 1
            out.append(token)
            outputs.append(_new_output(ReqOutput, (req.rid, tokens, None, req.prompt_len,
                                                   req.cached_tokens, len(out), None)))

    def _process_extend(self, req: Req, tokens: list[int]) -> None:
        commit_kv(req, req.extend_len)
        if req.kv.committed_len < req.seq_len:  # more chunks to go
            req.state = ReqState.CHUNKED
            self.tree_cache.cache_unfinished_req(req)
            return
        if req is self.chunked_req:
            self.chunked_req = None
        if req.sampling.max_new_tokens == 0:
            self._finish(req, FinishReason(FinishKind.LENGTH), insert=True)
            return
        req.state = ReqState.RUNNING
        if self._append_tokens(req, tokens[:1], commit=False):
            # Share the prompt with requests arriving while this one decodes (as SGLang).
            self.tree_cache.cache_unfinished_req(req)
            self.running.append(req)

    def _append_tokens(self, req: Req, tokens: list[int], commit: bool) -> bool:
        """Append sampled tokens up to the first finish condition (tokens after it are
        dropped and their KV is not committed); returns whether the request runs on."""
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            kept.append(token)
            req.output_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                break
        if commit:
            commit_kv(req, len(kept))
        if reason is not None:
            self._finish(req, reason, insert=True, new_tokens=kept)
            return False
        if kept:
            self._emit(req, kept)
        return True

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        """Why ``req`` finishes now that ``token`` was appended to its output, if it does."""
        sampling = req.sampling
        if token in req.stop_ids:
            return FinishReason(FinishKind.STOP, matched_token=token)
        if sampling.stop and self.stop_string_matcher is not None:
            matched = self.stop_string_matcher(req)
            if matched is not None:
                return FinishReason(FinishKind.STOP, matched_stop=matched)
        if len(req.output_ids) >= sampling.max_new_tokens:
            return FinishReason(FinishKind.LENGTH)
        if req.seq_len >= self.config.context_len:
            return FinishReason(FinishKind.LENGTH, "context length reached")
        return None

    # -- exits ----------------------------------------------------------------------
    def _release(self, req: Req, insert: bool) -> None:
        """The one exit; frees wait for the in-flight batch if there is one (rule 7)."""
        if self._inflight is None:
            release_kv_cache(req, self.tree_cache, insert=insert)
        else:
            with self.tree_cache.deferring(self._inflight.batch_id):
                release_kv_cache(req, self.tree_cache, insert=insert)

    def _finish(
        self, req: Req, reason: FinishReason, insert: bool, new_tokens: list[int] | None = None
    ) -> None:
        self._release(req, insert)
        req.state = ReqState.FINISHED
        req.finished_reason = reason
        req.to_finish = None
        self.reqs.pop(req.rid, None)
        self.stats.finished += 1
        if reason.kind is FinishKind.ABORT:
            self.stats.aborts += 1
        self._emit(req, new_tokens or [])

    def _retract(self, req: Req) -> None:
        """Back to waiting holding nothing; its context is recomputed on readmission."""
        self._release(req, insert=False)
        self.stats.retractions += 1
        if req.to_finish is not None:
            self._finish(req, req.to_finish, insert=False)
            return
        req.state = ReqState.RETRACTED
        self.waiting.insert(0, req)

    def _emit(self, req: Req, new_tokens: list[int]) -> None:
        logprobs = req.output_logprobs if req.sampling.return_logprob else None
        self._outputs.append(ReqOutput(req.rid, new_tokens, req.finished_reason,
                                       len(req.prompt_ids), req.cached_tokens,
                                       len(req.output_ids), logprobs))

    # -- checking -------------------------------------------------------------------
    def _run_checker(self) -> float:
        """Strict: every step. Otherwise once each time the engine becomes idle."""
        if not self.config.strict_checks:
            if not self.is_idle:
                self._checked_idle = False
                return 0.0
            if self._checked_idle:
                return 0.0
            self._checked_idle = True
        t0 = time.perf_counter()
        report = self.checker.check(self.reqs.values(), self.held_pages, full=True)
        self.last_report = report
        self.stats.checker_runs += 1
        if not report.ok:
            self.stats.violations += 1
            logger.error("invariant check failed:\n%s", report)
            if self.config.raise_on_violation:
                raise InvariantViolation(report)
        return time.perf_counter() - t0
