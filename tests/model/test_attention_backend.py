"""The attention-backend interface: per-batch metadata (exact values) and the torch
backend's per-layer forward (writes K/V at out_cache_loc, attends over the row)."""

import torch

from kvserve.forward import ForwardBatch, ForwardMode
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.model.attention import TorchPagedAttention
from kvserve.model.attention_backend import (
    AttentionBackend,
    AttentionMetadata,
    make_attention_backend,
)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def batch_of(mode, table, specs):
    """(row, seq_len, prefix_len) per request; the new slots come from the table."""
    new = [s - p for _, s, p in specs]
    tokens = sum(new)
    return ForwardBatch(
        1, mode, i32([0] * tokens), torch.cat([torch.arange(p, s) for _, s, p in specs]).int(),
        torch.cat([table[r, p:s] for r, s, p in specs]), i32([r for r, _, _ in specs]),
        i32([s for _, s, _ in specs]), i32([p for _, _, p in specs]), i32(new),
        torch.ones(len(specs), dtype=torch.bool))


def test_extend_metadata_locates_each_requests_new_tokens():
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 4
    batch = batch_of(ForwardMode.EXTEND, table, [(1, 5, 2), (3, 4, 0), (2, 7, 6)])
    meta = AttentionMetadata.from_batch(batch, torch.device("cpu"))
    assert meta.out_cache_loc.dtype == torch.int64
    assert meta.out_cache_loc.tolist() == [16, 17, 18, 34, 35, 36, 37, 30]
    assert meta.extend_start_loc.tolist() == [0, 3, 7]
    assert meta.max_extend_len == 4
    assert meta.batch_size == 3
    assert meta.spans == ()


def test_decode_metadata_needs_no_device_read():
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 4
    batch = batch_of(ForwardMode.DECODE, table, [(1, 5, 4), (3, 2, 1)])
    meta = AttentionMetadata.from_batch(batch, torch.device("cpu"))
    assert meta.extend_start_loc.tolist() == [0, 1]
    assert meta.extend_start_loc.dtype == torch.int32
    assert meta.max_extend_len == 1
    assert meta.out_cache_loc.tolist() == [18, 35]


def test_torch_backend_spans_hold_row_slots_and_causal_masks():
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 4
    pool = MHATokenToKVPool(64, 4, 1, 1, 2, torch.float32)
    backend: AttentionBackend = make_attention_backend("torch", pool, table)
    assert isinstance(backend, TorchPagedAttention)
    meta = backend.prepare(batch_of(ForwardMode.EXTEND, table, [(1, 4, 2), (2, 1, 0)]))
    (s0, e0, slots0, mask0), (s1, e1, slots1, mask1) = meta.spans
    assert (s0, e0, slots0.tolist()) == (0, 2, [14, 15, 16, 17])
    assert mask0.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert (s1, e1, slots1.tolist(), mask1.tolist()) == (2, 3, [24], [[True]])


def test_torch_forward_writes_kv_then_decode_equals_extend():
    gen = torch.Generator().manual_seed(0)
    table = torch.zeros((3, 16), dtype=torch.int32)
    table[1, :9] = torch.arange(20, 29)
    table[2, :3] = torch.tensor([40, 7, 33])
    pool = MHATokenToKVPool(60, 1, 2, 1, 4, torch.float32)
    pool.k_buffers[1].normal_(generator=gen)
    pool.v_buffers[1].normal_(generator=gen)
    backend = TorchPagedAttention(pool, table)
    specs = [(1, 9, 8), (2, 3, 2)]
    q = torch.randn(2, 2, 4, generator=gen)
    k = torch.randn(2, 1, 4, generator=gen)
    v = torch.randn(2, 1, 4, generator=gen)
    decode = backend.forward(q, k, v, 1, backend.prepare(
        batch_of(ForwardMode.DECODE, table, specs)), 0.5)
    assert torch.equal(pool.k_buffers[1][[28, 33]], k)
    assert torch.equal(pool.v_buffers[1][[28, 33]], v)
    assert pool.k_buffers[0].abs().sum().item() == 0  # other layers untouched
    extend = backend.forward(q, k, v, 1, backend.prepare(
        batch_of(ForwardMode.EXTEND, table, specs)), 0.5)
    assert torch.equal(decode, extend)
