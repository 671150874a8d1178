"""Regression tests for bugs a breaker session found in the KV layer (one per finding)."""

import pytest

from kvserve.kv import KVAllocError, alloc_for_decode, alloc_for_extend, commit_kv, release_kv_cache
from kvserve.mem import DoubleFreeError, PoolError
from kvserve.sched import ReqState
from kvserve.testing.kv_harness import KVHarness


def cached_then_running(h, extra=(40, 41, 42)):
    h.complete(list(range(1, 18)))
    req = h.start(list(range(1, 18)) + list(extra))
    return req


@pytest.mark.parametrize("insert", [True, False])
def test_release_during_an_in_flight_batch_keeps_every_page_it_reads(insert):
    h = KVHarness(page_size=4, num_tokens=32, num_rows=4)
    req = cached_then_running(h)
    for _ in range(8):
        h.decode(req)
    in_flight = set(req.kv.page_ids)  # batch 7 reads all of these through the row
    with h.cache.deferring(7):
        h.finish(req, insert=insert)
    h.check()
    other = h.new(list(range(100, 120)))
    h.admit(other)
    h.extend(other)  # must not be handed any page batch 7 still reads
    assert not in_flight & set(other.kv.page_ids)
    h.check()
    h.finish(other)
    h.cache.release_deferred(7)
    h.assert_idle_and_full()
    assert h.cache.protected_size() == 0


def test_decode_batch_with_a_rowless_request_changes_nothing():
    h = KVHarness(page_size=4, num_tokens=64)
    a = h.start(list(range(1, 9)))
    b = h.new([5, 6, 7])
    h.admit(b)
    before = (a.kv.allocated_len, list(a.kv.page_ids))
    with pytest.raises(KVAllocError, match="without a row"):
        alloc_for_decode([a, b], h.cache)
    assert (a.kv.allocated_len, a.kv.page_ids) == before
    h.check()


def test_decode_at_the_row_width_fails_only_that_request():
    h = KVHarness(page_size=2, num_tokens=64, context_len=4)  # row width 5
    a = h.start([1, 2, 3, 4])
    alloc_for_decode([a], h.cache)
    commit_kv(a, 1)  # committed 5 == row width
    b = h.start([9, 8])
    result = alloc_for_decode([b, a], h.cache)
    assert result.failed == [a] and len(result.out_cache_loc) == 1
    assert b.kv.allocated_len == 3 and a.kv.allocated_len == 5
    h.check()


def test_checker_reports_a_lock_whose_node_left_the_tree():
    h = KVHarness(page_size=4, num_tokens=32, num_rows=4, strict=False)
    req = cached_then_running(h, extra=(40, 41))
    h.cache.dec_lock_ref(req.kv.lock)  # a stray unlock (a bug elsewhere) ...
    h.cache.evict(10**6)  # ... lets the prefix be evicted and its pages reused
    found = h.check().violations
    assert f"lock on node {req.kv.lock.node.uid} whose path left the tree" in found


@pytest.mark.parametrize("corruption", ["short page_ids", "past row width"])
def test_checker_reports_instead_of_crashing_on_corrupt_records(corruption):
    h = KVHarness(page_size=4, num_tokens=64, context_len=8, strict=False)
    req = h.start(list(range(1, 8)))
    if corruption == "short page_ids":
        req.kv.page_ids.pop()
    else:
        req.kv.allocated_len = h.pools.req_to_token_pool.row_width + 1
    report = h.check()
    assert not report.ok
    assert any(f"request {req.rid}" in v for v in report.violations)


@pytest.mark.parametrize("finished", [True, False])
def test_trimmed_fill_ids_free_what_cannot_be_keyed(finished):
    h = KVHarness(page_size=4, num_tokens=256, strict=False)
    req = h.start(list(range(1, 11)))
    for _ in range(12):
        h.decode(req)
    del req.output_ids[-6:]  # a caller cut tokens that already have KV
    if finished:
        release_kv_cache(req, h.cache, insert=True)
        h.live.pop(req.rid)
    else:
        h.cache.cache_unfinished_req(req)
    assert h.check().ok
    if not finished:
        h.finish(req, insert=False)
    h.checker.strict = True
    h.assert_idle_and_full()


def test_allocation_inside_a_free_group_can_still_evict():
    h = KVHarness(page_size=4, num_tokens=32)
    h.complete(list(range(1, 30)))
    req = h.new(list(range(100, 120)))
    h.admit(req)
    with h.pools.allocator.free_group():
        assert alloc_for_extend(req, h.cache, 20)
    req.state = ReqState.RUNNING
    h.check()
    h.finish(req)
    h.assert_idle_and_full()


def test_release_with_a_bad_mamba_slot_leaves_the_record_whole():
    h = KVHarness(page_size=4, num_tokens=64, mamba_slots=2)
    req = h.start(list(range(1, 10)))
    req.kv.mamba_slots = (99,)
    for _ in range(2):  # the same clear error twice, never a double free
        with pytest.raises(PoolError, match="mamba slot 99"):
            release_kv_cache(req, h.cache, insert=False)
    assert req.kv.holds_row and req.kv.holds_kv
    req.kv.mamba_slots = ()
    h.finish(req, insert=False)
    h.assert_idle_and_full()
    with pytest.raises(DoubleFreeError):
        h.pools.mamba_pool.free([1, 1])


def test_a_match_taken_before_reset_locks_nothing():
    h = KVHarness(page_size=4, num_tokens=64)
    h.complete(list(range(1, 18)))
    stale = h.cache.match_prefix(list(range(1, 18)))
    h.cache.reset()
    assert h.cache.inc_lock_ref(stale.last_node) is None
    assert h.cache.evictable_size() == 0 and h.cache.verify() == []
    h.assert_idle_and_full()


def test_emptied_namespaces_are_dropped():
    h = KVHarness(page_size=1, num_tokens=256)
    for salt in range(20):
        h.complete([1, 2, 3], extra_key=f"salt-{salt}")
    assert len(h.cache._roots) == 21
    h.cache.evict(10**6)
    assert list(h.cache._roots) == [None]
    h.assert_idle_and_full()


def test_zero_token_extend_is_refused():
    h = KVHarness()
    req = h.new([1, 2, 3])
    h.admit(req)
    with pytest.raises(KVAllocError, match="extend_len must be >= 1"):
        alloc_for_extend(req, h.cache, 0)
    assert not req.kv.holds_row
    h.finish(req)
    h.assert_idle_and_full()
