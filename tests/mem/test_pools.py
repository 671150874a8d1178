import pytest
import torch

from kvserve.mem import (
    DoubleFreeError,
    MambaPool,
    MHATokenToKVPool,
    PageLedger,
    PoolError,
    ReqToTokenPool,
    ceil_page,
    floor_page,
    num_pages,
    slot_ids,
)


def test_req_to_token_shape_row_width_and_row_zero():
    pool = ReqToTokenPool(size=4, context_len=100, page_size=16, spec_reserve=8)
    assert pool.row_width == 100 + 8 + 15
    assert pool.req_to_token.shape == (5, 123)
    assert pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(4)]
    assert rows == [1, 2, 3, 4]
    assert pool.alloc() is None
    assert pool.available_size() == 0


def test_req_to_token_free_errors():
    pool = ReqToTokenPool(size=2, context_len=8)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(DoubleFreeError):
        pool.free(row)
    with pytest.raises(PoolError):
        pool.free(0)
    with pytest.raises(PoolError):
        pool.free(3)
    assert pool.available_size() == 2


def test_req_to_token_write_and_width_check():
    pool = ReqToTokenPool(size=1, context_len=4)
    pool.write(1, 1, torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[1].tolist() == [0, 7, 8, 9]
    with pytest.raises(PoolError, match="past row width"):
        pool.write(1, 2, torch.tensor([1, 2, 3], dtype=torch.int32))


def test_bad_req_to_token_sizes():
    with pytest.raises(PoolError):
        ReqToTokenPool(size=0, context_len=8)


def test_page_helpers():
    assert num_pages(0, 16) == 0
    assert num_pages(17, 16) == 2
    assert ceil_page(17, 16) == 32
    assert floor_page(17, 16) == 16
    assert slot_ids([3, 5], 4, 2, 6).tolist() == [14, 15, 20, 21]
    assert slot_ids([3, 5], 4, 0, 0).tolist() == []
    with pytest.raises(IndexError):
        slot_ids([3], 4, 0, 5)


def test_kv_buffer_layout_and_roundtrip():
    pool = MHATokenToKVPool(num_slots=32, page_size=16, num_layers=2, num_kv_heads=2,
                            head_dim=4, dtype=torch.float32)
    k, v = pool.get_kv_buffer(1)
    assert k.shape == v.shape == (48, 2, 4)
    slots = torch.tensor([16, 31], dtype=torch.int32)
    pool.set_kv_buffer(1, slots, torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0))
    assert pool.get_kv_buffer(1)[0][16].sum().item() == 8
    assert pool.get_kv_buffer(1)[1][31].sum().item() == 16
    assert pool.get_kv_buffer(0)[0].abs().sum().item() == 0
    with pytest.raises(PoolError):
        MHATokenToKVPool(0, 16, 1, 1, 1)


def test_mamba_pool_alloc_free_copy():
    pool = MambaPool(size=3, num_layers=2, conv_shape=(4, 2), temporal_shape=(3,))
    assert pool.conv_state.shape == (2, 4, 4, 2)
    assert pool.temporal_state.shape == (2, 4, 3)
    a = pool.alloc(2)
    assert a == [1, 2]
    assert pool.alloc(2) is None
    assert pool.available_size() == 1
    pool.conv_state[:, a[0]] = 5.0
    pool.temporal_state[:, a[0]] = 7.0
    pool.copy_slot(a[0], a[1])
    assert pool.conv_state[:, a[1]].eq(5.0).all()
    assert pool.temporal_state[:, a[1]].eq(7.0).all()
    pool.free(a)
    assert pool.available_size() == 3
    with pytest.raises(DoubleFreeError):
        pool.free([a[0]])
    with pytest.raises(DoubleFreeError):
        pool.free([3, 3])
    with pytest.raises(PoolError):
        pool.free([0])
    assert pool.available_size() == 3


def test_page_ledger_reports_conflicts_and_unowned():
    ledger = PageLedger(4)
    ledger.claim([0], "reserved")
    ledger.claim([1, 2], "free")
    ledger.claim([2], "req:a")
    ledger.claim([9], "tree")
    assert ledger.conflicts == [(2, "free", "req:a")]
    assert ledger.unowned() == [3, 4]
    assert ledger.out_of_range == [(9, "tree")]
    assert ledger.owner(1) == "free"
    assert ledger.count("free") == 2
