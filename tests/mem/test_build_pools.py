"""The one pool builder and its sizing: exact shapes, capacities and budgets."""

import pytest
import torch

from kvserve.mem import (
    KVLayout,
    PoolError,
    build_pools,
    default_pool_tokens,
    pool_tokens_for_budget,
)

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def test_pools_without_kv_layout_have_rows_and_pages_only():
    pools = build_pools(num_rows=4, context_len=100, pool_tokens=1000, page_size=16,
                        spec_reserve=8)
    assert pools.req_to_token_pool.req_to_token.shape == (5, 100 + 8 + 15)
    assert pools.req_to_token_pool.req_to_token.device.type == "cpu"
    assert pools.allocator.num_pages == 62  # 1000 // 16, page 0 reserved on top
    assert pools.allocator.size == 992
    assert pools.page_size == 16
    assert pools.kv_buffer is None
    assert pools.mamba_pool is None


def test_pools_with_kv_layout_get_buffers_of_that_shape():
    pools = build_pools(num_rows=2, context_len=64, pool_tokens=256, page_size=4,
                        kv_layout=SMALL)
    assert pools.kv_buffer is not None
    assert len(pools.kv_buffer.k_buffers) == len(pools.kv_buffer.v_buffers) == 2
    k, v = pools.kv_buffer.get_kv_buffer(1)
    assert k.shape == v.shape == (256 + 4, 2, 8)
    assert k.dtype == v.dtype == torch.float16
    assert pools.req_to_token_pool.row_width == 64 + 3


def test_pool_sizes_below_one_page_raise():
    with pytest.raises(PoolError, match="holds no whole page"):
        build_pools(num_rows=1, context_len=8, pool_tokens=3, page_size=4)


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert SMALL.bytes_per_token == 2 * 2 * 2 * 8 * 2
    llama3_8b = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert llama3_8b.bytes_per_token == 131072


def test_budget_holds_whole_tokens_only():
    assert pool_tokens_for_budget(SMALL, 128 * 7 + 127) == 7
    assert pool_tokens_for_budget(SMALL, 127) == 0
    assert pool_tokens_for_budget(SMALL, -4096) == 0


def test_cpu_default_is_four_contexts_at_least_65536():
    assert default_pool_tokens(SMALL, "cpu", context_len=1000, mem_fraction=0.9) == 65536
    assert default_pool_tokens(SMALL, "cpu", context_len=20000, mem_fraction=0.9) == 80000


def test_cuda_default_is_what_the_fraction_leaves_after_the_weights(monkeypatch):
    # 10 MB free of 16 MB; a fraction of 0.9 keeps 1.6 MB back: 8.4 MB / 128 B per token
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000_000, 16_000_000))
    assert default_pool_tokens(SMALL, "cuda", context_len=4096, mem_fraction=0.9) == 65625
    with pytest.raises(RuntimeError, match="only 65625 KV tokens fit in 90% of the device"):
        default_pool_tokens(SMALL, "cuda:0", context_len=65626, mem_fraction=0.9)
