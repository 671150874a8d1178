"""The contract between the scheduler and the model: one step's work and its result.

Neither ``sched`` nor ``model`` owns this module; both import it, and it imports
nothing of kvserve. The model (real or scripted) never sees a request: it reads
and writes the KV pool through ``req_pool_indices`` rows and ``out_cache_loc``
slots only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (with a cached prefix), possibly one chunk
    DECODE = "decode"  # one token per request, or a speculative window


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-request sampling parameters, batch order (SGLang's SamplingBatchInfo)."""

    temperature: torch.Tensor  # float32 [batch]; 0 = greedy
    top_k: torch.Tensor  # int32 [batch]; -1 = all tokens
    top_p: torch.Tensor  # float32 [batch], in (0, 1]
    min_p: torch.Tensor  # float32 [batch], in [0, 1]
    seed: torch.Tensor  # int64 [batch]; -1 = unseeded
    return_logprob: torch.Tensor  # bool [batch]


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """A snapshot of one step's work. All tensors are int32 on the pool's device.

    Per request ``i`` (batch order): the model reads positions ``[0, seq_lens[i])``
    through row ``req_pool_indices[i]``, of which ``[prefix_lens[i], seq_lens[i])``
    are new and have input ids, positions and ``out_cache_loc`` slots (flattened,
    request-major; ``extend_lens[i]`` of them). In DECODE mode with speculation
    ``extend_lens[i]`` is the window of slots the model may fill, of which it
    reports how many it accepted; ``input_ids`` then holds one token per request.
    """

    batch_id: int
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_input_tokens]
    positions: torch.Tensor  # [num_input_tokens]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)]
    req_pool_indices: torch.Tensor  # [batch]
    seq_lens: torch.Tensor  # [batch]
    prefix_lens: torch.Tensor  # [batch]
    extend_lens: torch.Tensor  # [batch]
    sample: torch.Tensor  # [batch] bool: does request i get a token this step
    speculative: bool = False
    sampling: SamplingBatch | None = None  # set when the model samples (real runner)
    # int64 [batch, max_banned], -1 padded: token ids request i must not produce as its
    # next token (its stop ids while below min_new_tokens); None when no row bans any
    banned_token_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())


class ModelOutput(NamedTuple):
    """Per request in batch order, the tokens produced this step (empty for a
    request mid chunked prefill; more than one for accepted speculative tokens,
    the bonus token included)."""

    token_ids: list[list[int]]
    # log-probabilities of those tokens (temperature-1 softmax of the logits), when any
    # request of the batch asked for them
    logprobs: list[list[float]] | None = None


class ModelRunnerLike(Protocol):
    """The one interface the scripted fake model and the real runner implement.
    ``uses_sampling_params``: whether batches must carry a ``SamplingBatch``."""

    uses_sampling_params: bool

    def forward(self, batch: ForwardBatch) -> ModelOutput: ...
