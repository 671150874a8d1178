"""The ReqKV record, its allocation sites and release_kv_cache, with the checker strict."""

import ast
from pathlib import Path

import pytest

from kvserve.cache import LockRefError
from kvserve.kv import (
    KVAllocError,
    ReqKV,
    alloc_for_decode,
    alloc_for_extend,
    alloc_for_spec_decode,
    commit_kv,
    lock_prefix,
    release_kv_cache,
    spec_reserve_tokens,
)
from kvserve.mem.pages import slot_ids
from kvserve.sched import InvariantViolation, ReqState
from kvserve.testing.kv_harness import FakeReq, KVHarness

PACKAGE = Path(__file__).resolve().parents[1] / "kvserve"


def test_reqkv_predicates_read_their_own_fields():
    kv = ReqKV()
    assert not (kv.holds_row or kv.holds_kv or kv.holds_mamba or kv.holds_lock)
    kv.mamba_slots = (3,)
    assert kv.holds_mamba and not kv.holds_row and not kv.holds_kv
    kv = ReqKV(row=2)
    assert kv.holds_row and not kv.holds_kv  # a row alone is not KV
    assert ReqKV(allocated_len=1).holds_kv


def test_spec_reserve_matches_sglang():
    assert spec_reserve_tokens(3, 1, 4) == 8
    assert spec_reserve_tokens(5, 4, 8) == 40


# -- allocation sites -----------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_then_decode_ladder_and_row(page_size):
    h = KVHarness(page_size=page_size, num_tokens=64 * page_size, context_len=200)
    req = h.new(list(range(1, 21)))
    h.admit(req)
    assert h.extend(req)
    kv = req.kv
    assert (kv.protected_len, kv.committed_len, kv.allocated_len) == (0, 20, 20)
    assert len(kv.page_ids) == -(-20 // page_size)
    row = h.pools.req_to_token_pool.req_to_token[kv.row, :20]
    assert row.tolist() == slot_ids(kv.page_ids, page_size, 0, 20).tolist()
    for step in range(1, 6):
        assert h.decode(req)
        assert (kv.committed_len, kv.allocated_len) == (20 + step, 20 + step)
        h.check()
    h.finish(req)
    h.assert_idle_and_full()


def test_alloc_for_extend_is_all_or_nothing_on_rows():
    h = KVHarness(page_size=4, num_tokens=64, num_rows=1)
    a, b = h.new([1, 2, 3, 4, 5]), h.new([6, 7, 8, 9, 10])
    h.admit(a)
    h.admit(b)
    assert h.extend(a)
    free = h.pools.allocator.available_size()
    assert not alloc_for_extend(b, h.cache, 5)
    assert not b.kv.holds_anything or b.kv.holds_lock
    assert h.pools.allocator.available_size() == free
    h.check()
    h.finish(a)
    h.finish(b)
    h.assert_idle_and_full()


def test_alloc_for_extend_is_all_or_nothing_on_pages():
    h = KVHarness(page_size=4, num_tokens=16, num_rows=4)
    a, b = h.new(list(range(1, 13))), h.new(list(range(20, 30)))
    h.admit(a)
    h.admit(b)
    assert h.extend(a)  # 3 of 4 pages
    assert not alloc_for_extend(b, h.cache, 10)
    assert not b.kv.holds_row and not b.kv.holds_kv
    assert h.pools.req_to_token_pool.available_size() == 3
    h.check()
    h.finish(a, insert=False)
    assert h.extend(b)
    h.finish(b)
    h.assert_idle_and_full()


def test_allocation_evicts_from_the_cache_when_short():
    h = KVHarness(page_size=4, num_tokens=16)
    h.complete(list(range(1, 13)))
    assert h.cache.evictable_size() == 12
    b = h.new(list(range(50, 62)))
    h.admit(b)
    assert h.extend(b)
    # b needed 3 pages with 1 free: the whole 3-page leaf was evicted (SGLang's
    # whole-leaf LRU), leaving 1 page free.
    assert h.cache.evictable_size() == 0
    assert h.pools.allocator.available_size() == 4
    h.finish(b)
    h.assert_idle_and_full()


def test_extend_with_cached_prefix_fills_row_with_tree_pages():
    h = KVHarness(page_size=4, num_tokens=64)
    h.complete(list(range(1, 11)))
    b = h.new(list(range(1, 11)) + [99, 98])
    assert h.admit(b) == 8
    assert b.kv.holds_lock and not b.kv.holds_row and b.kv.protected_len == 0
    h.check()
    tree_pages = h.cache.match_prefix(list(range(1, 9))).page_ids.tolist()
    h.extend(b)
    assert b.kv.page_ids[:2] == tree_pages
    assert (b.kv.protected_len, b.kv.committed_len, b.kv.allocated_len) == (8, 12, 12)
    h.check()
    h.finish(b)
    h.assert_idle_and_full()


def test_site_errors_for_requests_in_the_wrong_state():
    h = KVHarness()
    req = h.new([1, 2, 3])
    with pytest.raises(KVAllocError):
        alloc_for_decode([req], h.cache)  # raises before taking anything
    with pytest.raises(KVAllocError):
        alloc_for_spec_decode(req, h.cache, 4)
    with pytest.raises(KVAllocError):
        alloc_for_extend(req, h.cache, -1)
    h.admit(req)
    h.extend(req)
    with pytest.raises(KVAllocError):
        lock_prefix(req, h.cache, h.cache.match_prefix([1]).last_node)
    with pytest.raises(KVAllocError, match="past allocated_len"):
        commit_kv(req, 1)
    h.check()
    h.finish(req)
    h.assert_idle_and_full()


def test_extend_past_row_width_fails_cleanly():
    h = KVHarness(context_len=8)
    req = h.new(list(range(1, 10)))
    h.admit(req)
    assert not alloc_for_extend(req, h.cache, 9)
    assert not req.kv.holds_row and not req.kv.holds_kv
    h.finish(req)
    h.assert_idle_and_full()


def test_decode_inside_speculative_overallocation_takes_no_page():
    h = KVHarness(page_size=4, num_tokens=64, spec_reserve=8)
    req = h.start([1, 2, 3, 4, 5])
    assert alloc_for_spec_decode(req, h.cache, 8)
    assert req.kv.allocated_len == 16
    free = h.pools.allocator.available_size()
    assert h.decode(req)
    assert req.kv.allocated_len == 16 and h.pools.allocator.available_size() == free
    assert alloc_for_spec_decode(req, h.cache, 2)  # never shrinks
    assert req.kv.allocated_len == 16
    h.finish(req)
    h.assert_idle_and_full()


def test_only_named_sites_move_allocated_len():
    """Scan the package: allocated_len is assigned only in the allocation sites (through
    _grow), cleared only by ReqKV._clear and lowered to committed_len only by trim_kv_tail
    (a session turn's end); _grow is called only by the sites."""
    sites = {"alloc_for_extend", "alloc_for_decode", "alloc_for_spec_decode"}
    writers: set[tuple[str, str]] = set()
    grow_callers: set[tuple[str, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Attribute) and sub.attr == "allocated_len":
                            writers.add((path.name, func.name))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_grow":
                    grow_callers.add((path.name, func.name))
    assert writers == {("kv.py", "_grow"), ("kv.py", "_clear"), ("kv.py", "alloc_for_extend"),
                       ("kv.py", "alloc_for_decode"), ("kv.py", "trim_kv_tail")}
    assert grow_callers == {("kv.py", s) for s in sites - {"alloc_for_decode"}}


# -- release_kv_cache -------------------------------------------------------------------


@pytest.mark.parametrize("radix", [True, False])
def test_scenario_1_release_of_request_holding_nothing_is_a_noop_twice(radix):
    h = KVHarness(radix=radix)
    req = h.new([1, 2, 3])
    release_kv_cache(req, h.cache, insert=True)
    release_kv_cache(req, h.cache, insert=False)
    assert not req.kv.holds_anything
    h.check()
    h.finish(req)
    h.assert_idle_and_full()


def test_scenario_2_release_of_request_holding_only_mamba_slots():
    h = KVHarness(mamba_slots=4)
    req = h.new([1, 2, 3])
    h.admit(req, mamba=2)
    assert req.kv.holds_mamba and not req.kv.holds_row and not req.kv.holds_lock
    assert h.pools.mamba_pool.available_size() == 2
    h.check()
    h.finish(req, insert=True)
    assert h.pools.mamba_pool.available_size() == 4
    assert req.kv == req.kv and not req.kv.holds_anything
    release_kv_cache(req, h.cache, insert=True)  # second call: no-op
    h.assert_idle_and_full()


def test_scenario_3_concurrent_prefill_of_same_prompt_repoints_second_row():
    h = KVHarness(page_size=4, num_tokens=64)
    prompt = list(range(1, 9))
    a, b = h.new(prompt), h.new(prompt)
    h.admit(a)
    h.admit(b)
    h.extend(a, 4)  # chunk 1 of A: inserts page 0 of the prompt
    a_page0 = a.kv.page_ids[0]
    h.extend(b, 4)  # chunk 1 of B: its page 0 duplicates A's
    assert b.kv.page_ids[0] == a_page0
    assert b.kv.protected_len == 4 and b.kv.lock is not None
    h.check()
    h.extend(a)
    h.extend(b)  # chunk 2: both finish prefill (page 1 each, not yet cached)
    for req in (a, b):
        row = h.pools.req_to_token_pool.req_to_token[req.kv.row, : req.kv.allocated_len]
        tree_or_own = set(h.cache.cached_page_ids()) | set(req.kv.owned_page_ids(4))
        assert {int(s) // 4 for s in row} <= tree_or_own
        assert not any(h.pools.allocator.is_free(int(s) // 4) for s in row)
    h.check()
    h.finish(a)
    h.finish(b)
    h.assert_idle_and_full()
    assert h.cache.evictable_size() == 8


def test_scenario_4_speculative_decode_allocated_len_every_step():
    h = KVHarness(page_size=16, num_tokens=16 * 16, context_len=128,
                  spec_reserve=spec_reserve_tokens(3, 1, 4))
    req = h.start(list(range(1, 11)))
    reserve = spec_reserve_tokens(num_steps=3, topk=1, num_draft_tokens=4)
    assert reserve == 8
    seen = []
    for _ in range(10):
        assert h.spec_decode(req, reserve, accepted=2)
        assert req.kv.allocated_len % 16 == 0
        seen.append((req.kv.committed_len, req.kv.allocated_len))
        h.check()
    assert seen == [(12, 32), (14, 32), (16, 32), (18, 32), (20, 32), (22, 32), (24, 32),
                    (26, 32), (28, 48), (30, 48)]
    assert len(req.kv.page_ids) == 3
    h.finish(req)
    assert h.cache.evictable_size() == 16  # one full committed page cached, two freed
    h.assert_idle_and_full()


@pytest.mark.parametrize("cached_prefix", [False, True])
@pytest.mark.parametrize("exit_path", ["finish", "retract"])
def test_scenario_5_unaligned_prefix_frees_every_page_once(cached_prefix, exit_path):
    h = KVHarness(page_size=16, num_tokens=16 * 8)
    prompt = list(range(1, 21))
    if cached_prefix:
        h.complete(prompt)
    req = h.new(prompt)
    assert h.admit(req) == (16 if cached_prefix else 0)
    h.extend(req)
    h.decode(req)
    h.check()
    assert len(req.kv.page_ids) == 2
    owned = h.pages_owned(req)
    free_before = h.pools.allocator.available_pages()
    if exit_path == "finish":
        h.finish(req)
    else:
        h.retract(req)
        h.live.pop(req.rid)
    # Every owned page comes back exactly once (no DoubleFreeError); a finish keeps
    # the first full page in the tree unless it was there already.
    kept = 1 if exit_path == "finish" and not cached_prefix else 0
    assert h.pools.allocator.available_pages() == free_before + owned - kept
    h.assert_idle_and_full()


def test_scenario_6_double_free_is_reported_as_over_total():
    h = KVHarness(page_size=4, num_tokens=64, strict=False)
    req = h.start(list(range(1, 11)))
    h.pools.allocator.free(req.kv.owned_page_ids(4))  # behind the request's back
    report = h.check()
    assert any("over the total (double free or double count)" in v for v in report.violations)
    assert any("owned by both free and req:" in v for v in report.violations)
    h.checker.strict = True
    with pytest.raises(InvariantViolation, match="double free"):
        h.check()


def test_scenario_6b_leak_is_reported_as_missing():
    h = KVHarness(page_size=4, num_tokens=64, strict=False)
    req = h.start(list(range(1, 11)))
    req.kv.page_ids.pop()  # forget a page: nobody owns it now
    req.kv.allocated_len = 8
    report = h.check()
    assert any("missing from the sum (leak)" in v for v in report.violations)
    assert any("have no owner (leaked)" in v for v in report.violations)


def test_scenario_7_locked_prefix_survives_eviction_and_bad_unlock_raises():
    h = KVHarness(page_size=4, num_tokens=32)
    h.complete(list(range(1, 13)))
    b = h.new(list(range(1, 9)) + [70, 71, 72, 73, 74])
    assert h.admit(b) == 8
    assert h.cache.evict(10_000) == 4  # only the unlocked leaf page
    assert h.cache.match_prefix(list(range(1, 9))).prefix_len == 8
    assert h.cache.evictable_size() == 0
    h.check()
    lock = b.kv.lock
    h.finish(b)
    with pytest.raises(LockRefError):
        h.cache.dec_lock_ref(lock)
    assert h.cache.evictable_size() == 8 and h.cache.protected_size() == 0
    h.assert_idle_and_full()


def test_scenario_8_page_zero_is_never_handed_out():
    h = KVHarness(page_size=1, num_tokens=12, num_rows=6)
    for round_ in range(6):
        reqs = [h.new([round_ * 10 + i + 1, 7, 7, 7]) for i in range(3)]
        for req in reqs:
            h.admit(req)
            if h.extend(req):
                assert 0 not in req.kv.page_ids
            h.check()
        for req in reqs:
            h.finish(req, insert=bool(round_ % 2))
    assert 0 not in set(h.cache.cached_page_ids())
    h.assert_idle_and_full()


def test_finish_inserts_committed_pages_and_frees_tail_and_overallocation():
    h = KVHarness(page_size=4, num_tokens=64, spec_reserve=8)
    req = h.new(list(range(1, 7)))
    h.admit(req)
    h.extend(req)  # 6 tokens, 2 pages
    h.spec_decode(req, reserve=8, accepted=1)  # allocated 16 (4 pages), committed 7
    assert (req.kv.committed_len, req.kv.allocated_len) == (7, 16)
    h.finish(req)
    assert h.cache.evictable_size() == 4  # only [0, 4) is a full committed page
    h.assert_idle_and_full()


def test_retracted_request_can_be_readmitted_and_finish():
    h = KVHarness(page_size=4, num_tokens=64)
    req = h.new(list(range(1, 11)))
    h.admit(req)
    h.extend(req, 4)
    h.extend(req, 4)
    assert req.state is ReqState.CHUNKED and req.kv.protected_len == 8
    h.retract(req)
    h.check()
    assert h.admit(req) == 8  # its chunks were cached before the retraction
    h.extend(req)
    h.finish(req)
    h.assert_idle_and_full()


def test_release_without_insert_keeps_what_chunks_cached():
    h = KVHarness(page_size=4, num_tokens=64, radix=False)
    req = h.new(list(range(1, 11)))
    h.admit(req)
    h.extend(req, 4)
    h.extend(req, 4)
    assert req.kv.protected_len == 0 and req.kv.allocated_len == 8
    h.finish(req, insert=True)
    h.assert_idle_and_full()
    assert h.pools.allocator.available_size() == 64


def test_fake_req_kv_pages():
    req = FakeReq("x", [1])
    assert req.kv_pages == 0
