"""The attention-backend interface: one ``prepare`` per batch, one ``forward`` per layer.

A backend owns the paged KV pool of one model (``MHATokenToKVPool``) and the
request-to-token table. ``prepare`` turns a ``ForwardBatch`` into an
``AttentionMetadata`` that every layer of the step reads; ``forward`` writes the new
tokens' K/V at ``out_cache_loc`` and attends each new token over positions
``[0, query_pos]`` of its request's row. Implementations: ``TorchPagedAttention``
(``attention.py``, reference, CPU and GPU) and ``TritonPagedAttention``
(``triton_attention.py``). Follows SGLang's ``AttentionBackend``
(``init_forward_metadata`` + ``forward``), with the metadata returned, not stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvserve.forward import ForwardBatch, ForwardMode
from kvserve.mem.kv_buffer import MHATokenToKVPool

ATTENTION_BACKENDS = ("auto", "torch", "triton")


class RequestSpan(NamedTuple):
    """One request of a batch, for backends that loop over requests on the host."""

    start: int  # first new token of the request in q (row of the flat token axis)
    end: int  # one past its last new token
    slot_ids: torch.Tensor  # int64 [seq_len]: KV slots of positions 0 .. seq_len - 1
    mask: torch.Tensor  # bool [end - start, seq_len]: True where the query sees the key


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every layer of one step needs to attend; built once by ``prepare``.

    Tensors are on the KV pool's device. Request ``i`` has new tokens
    ``[extend_start_loc[i], extend_start_loc[i] + seq_lens[i] - prefix_lens[i])`` of
    the flat token axis, at positions ``[prefix_lens[i], seq_lens[i])``.
    """

    out_cache_loc: torch.Tensor  # int64 [num_new_tokens]: KV slot of each new token
    req_pool_indices: torch.Tensor  # int32 [batch]: rows of req_to_token
    seq_lens: torch.Tensor  # int32 [batch]: context length after this step
    prefix_lens: torch.Tensor  # int32 [batch]: tokens already in the pool
    extend_start_loc: torch.Tensor  # int [batch]: first new token of request i
    max_extend_len: int  # most new tokens of one request (a host int: the grid size)
    spans: tuple[RequestSpan, ...] = ()  # filled by host-loop backends (torch) only

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @classmethod
    def from_batch(cls, batch: ForwardBatch, device: torch.device,
                   spans: tuple[RequestSpan, ...] = ()) -> AttentionMetadata:
        """The tensor part of a batch's metadata. A plain decode batch (one new token
        per request) is prepared without reading the device, so CUDA graphs can
        capture it."""
        if batch.forward_mode is ForwardMode.DECODE and not batch.speculative:
            bs = batch.batch_size
            extend_start_loc = torch.arange(bs, dtype=torch.int32, device=device)
            max_extend_len = 1
        else:
            new_lens = batch.seq_lens - batch.prefix_lens
            extend_start_loc = (torch.cumsum(new_lens, 0) - new_lens).to(device)
            max_extend_len = int(new_lens.max()) if new_lens.numel() else 0
        return cls(batch.out_cache_loc.to(device).long(), batch.req_pool_indices.to(device),
                   batch.seq_lens.to(device), batch.prefix_lens.to(device),
                   extend_start_loc, max_extend_len, spans)


class AttentionBackend(Protocol):
    """Paged attention over one model's KV pool."""

    def prepare(self, batch: ForwardBatch) -> AttentionMetadata:
        """Per-batch metadata, shared by every layer of the step."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: AttentionMetadata, scaling: float) -> torch.Tensor:
        """Write ``k``, ``v`` of the new tokens at ``metadata.out_cache_loc`` in layer
        ``layer_id``, then attend causally over each request's row.

        ``q``: [tokens, heads, head_dim]; ``k``, ``v``: [tokens, kv_heads, head_dim]
        (``heads`` a multiple of ``kv_heads``). Returns [tokens, heads, head_dim] in
        ``q``'s dtype (Triton: the pool's dtype).
        """
        ...


def resolve_backend(name: str, device: torch.device) -> str:
    """"auto" picks Triton on CUDA when it imports, else the torch reference backend.
    "triton" on CPU needs ``TRITON_INTERPRET=1`` (slow; for tests). Raises ValueError."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs a CUDA device "
                         "(or TRITON_INTERPRET=1 on CPU, for tests); use --attention-backend torch")
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


def make_attention_backend(name: str, kv_pool: MHATokenToKVPool,
                           req_to_token: torch.Tensor) -> AttentionBackend:
    """The backend ``name`` ("torch" or "triton", as ``resolve_backend`` returns) over
    ``kv_pool`` and ``req_to_token`` (int32 [rows + 1, row_width])."""
    if name == "triton":
        from kvserve.model.triton_attention import TritonPagedAttention  # imports triton

        return TritonPagedAttention(kv_pool, req_to_token)
    from kvserve.model.attention import TorchPagedAttention

    return TorchPagedAttention(kv_pool, req_to_token)
