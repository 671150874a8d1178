"""Paged attention in Triton (GPU; also runs on CPU under ``TRITON_INTERPRET=1``).

One kernel serves extend and decode: program (request, head, tile of new queries)
walks the request's context ``[0, seq_len)`` through its ``req_to_token`` row in
blocks of keys, with an online softmax (FlashAttention-style) and the causal rule
``key_pos <= query_pos``. New tokens' K/V are written to the pool before the call,
so the prefix and the new part are read the same way. GQA maps head ``h`` to KV head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.forward import ForwardBatch
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.model.attention_backend import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, req_to_token_ptr,
    rows_ptr, seq_lens_ptr, prefix_lens_ptr, start_loc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_rt,
    scaling, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    row = tl.load(rows_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = tl.load(prefix_lens_ptr + req)
    start = tl.load(start_loc_ptr + req)
    new_len = seq_len - prefix_len
    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d_offs = tl.arange(0, BLOCK_D)
    m_mask = m_offs < new_len
    d_mask = d_offs < head_dim
    q = tl.load(q_ptr + (start + m_offs)[:, None] * stride_qt + head * stride_qh
                + d_offs[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix_len + m_offs
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys past the last query of this tile are masked anyway: stop there
    end = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        n_offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = n_offs < end
        slots = tl.load(req_to_token_ptr + row * stride_rt + n_offs, mask=n_mask, other=0)
        kv_off = slots.to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh + d_offs[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:  # noqa: SIM108  (a constexpr branch inside the kernel)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s.to(tl.float32) * scaling
        causal = (n_offs[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:  # noqa: SIM108  (a constexpr branch inside the kernel)
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (start + m_offs)[:, None] * stride_ot + head * stride_oh
             + d_offs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


class TritonPagedAttention:
    """``AttentionBackend``: one kernel launch per layer; block sizes fixed for now."""

    BLOCK_M = 16
    BLOCK_N = 32

    def __init__(self, kv_pool: MHATokenToKVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def prepare(self, batch: ForwardBatch) -> AttentionMetadata:
        return AttentionMetadata.from_batch(batch, self.req_to_token.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: AttentionMetadata, scaling: float) -> torch.Tensor:
        self.kv_pool.set_kv_buffer(layer_id, metadata.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        q = q.to(k_buf.dtype).contiguous()
        out = torch.empty_like(q)
        if metadata.batch_size == 0:
            return out
        _, heads, head_dim = q.shape
        grid = (metadata.batch_size, heads, triton.cdiv(metadata.max_extend_len, self.BLOCK_M))
        _paged_attention_kernel[grid](
            q, k_buf, v_buf, out, self.req_to_token,
            metadata.req_pool_indices, metadata.seq_lens, metadata.prefix_lens,
            metadata.extend_start_loc,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
            out.stride(0), out.stride(1), self.req_to_token.stride(0),
            scaling, head_dim,
            GROUP=heads // k_buf.shape[1], BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            IEEE=k_buf.dtype == torch.float32,
        )
        return out
