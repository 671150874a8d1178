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


class TorchPagedAttention:
    """Extend (prefill with a cached prefix, causal among the new tokens) and decode."""

    def __init__(self, kv_pool: MHATokenToKVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> _BatchView:
        return _BatchView(batch, self.req_to_token)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                view: _BatchView, scaling: float) -> torch.Tensor:
        """``q``: [tokens, heads, head_dim]; ``k``, ``v``: [tokens, kv_heads, head_dim] of
        the new tokens. Returns [tokens, heads, head_dim]."""
        self.kv_pool.set_kv_buffer(layer, view.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer)
        out = torch.empty_like(q)
        for (start, end, slots), mask in zip(view.spans, view.masks, strict=True):
            keys = k_buf[slots].transpose(0, 1)  # [kv_heads, seq, dim]
            values = v_buf[slots].transpose(0, 1)
            query = q[start:end].transpose(0, 1)  # [heads, new, dim]
            attn = F.scaled_dot_product_attention(
                query.to(keys.dtype), keys, values, attn_mask=mask, scale=scaling,
                enable_gqa=query.shape[0] != keys.shape[0],
            )
            out[start:end] = attn.transpose(0, 1).to(out.dtype)
        return out


class _BatchView:
    """Per-request spans of a ForwardBatch: token range, context slots, causal mask."""

    def __init__(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> None:
        self.out_cache_loc = batch.out_cache_loc.long()
        rows = batch.req_pool_indices.tolist()
        seq_lens = batch.seq_lens.tolist()
        prefix_lens = batch.prefix_lens.tolist()
        new_lens = (batch.seq_lens - batch.prefix_lens).tolist()
        self.spans: list[tuple[int, int, torch.Tensor]] = []
        self.masks: list[torch.Tensor] = []
        start = 0
        for row, seq_len, prefix_len, new in zip(rows, seq_lens, prefix_lens, new_lens,
                                                  strict=True):
            slots = req_to_token[row, :seq_len].long()
            self.spans.append((start, start + new, slots))
            # query j (position prefix_len + j) sees keys 0 .. prefix_len + j
            q_pos = torch.arange(prefix_len, seq_len, device=slots.device)[:, None]
            k_pos = torch.arange(seq_len, device=slots.device)[None, :]
            self.masks.append(k_pos <= q_pos)
            start += new
