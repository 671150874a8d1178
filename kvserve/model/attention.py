"""Attention over the paged KV pool (torch reference backend, CPU and GPU).

K/V of every token live in ``MHATokenToKVPool`` at their slot; a request's
positions ``[0, seq_len)`` are found through its row of ``req_to_token``. The
new tokens' K/V are written at ``out_cache_loc`` first, then read back with the
rest of the context, so a wrong row entry changes the result (as it should).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.forward import ForwardBatch
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.model.attention_backend import AttentionMetadata, RequestSpan


class TorchPagedAttention:
    """``AttentionBackend``: one ``scaled_dot_product_attention`` per request, extend
    (prefill with a cached prefix, causal among the new tokens) and decode alike."""

    def __init__(self, kv_pool: MHATokenToKVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> AttentionMetadata:
        return AttentionMetadata.from_batch(batch, self.req_to_token.device, self._spans(batch))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: AttentionMetadata, scaling: float) -> torch.Tensor:
        self.kv_pool.set_kv_buffer(layer_id, metadata.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        out = torch.empty_like(q)
        for start, end, slots, mask in metadata.spans:
            keys = k_buf[slots].transpose(0, 1)  # [kv_heads, seq, dim]
            values = v_buf[slots].transpose(0, 1)
            query = q[start:end].transpose(0, 1)  # [heads, new, dim]
            attn = F.scaled_dot_product_attention(
                query.to(keys.dtype), keys, values, attn_mask=mask, scale=scaling,
                enable_gqa=query.shape[0] != keys.shape[0],
            )
            out[start:end] = attn.transpose(0, 1).to(out.dtype)
        return out

    def _spans(self, batch: ForwardBatch) -> tuple[RequestSpan, ...]:
        rows = batch.req_pool_indices.tolist()
        seq_lens = batch.seq_lens.tolist()
        prefix_lens = batch.prefix_lens.tolist()
        spans = []
        start = 0
        for row, seq_len, prefix_len in zip(rows, seq_lens, prefix_lens, strict=True):
            slots = self.req_to_token[row, :seq_len].long()
            # query j (position prefix_len + j) sees keys 0 .. prefix_len + j
            q_pos = torch.arange(prefix_len, seq_len, device=slots.device)[:, None]
            k_pos = torch.arange(seq_len, device=slots.device)[None, :]
            new = seq_len - prefix_len
            spans.append(RequestSpan(start, start + new, slots, k_pos <= q_pos))
            start += new
        return tuple(spans)
