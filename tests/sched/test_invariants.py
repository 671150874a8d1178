"""The checker finds each kind of broken state, names it, and raises only in strict mode."""

import pytest

from kvserve.sched import InvariantViolation, ReqState
from kvserve.testing.kv_harness import KVHarness


def running(h, prompt):
    req = h.new(prompt)
    h.admit(req)
    assert h.extend(req)
    return req


def violations(h, full=True):
    h.checker.strict = False
    return h.checker.check(h.live.values(), h.held_pages, full=full).violations


def test_clean_state_reports_every_pool():
    h = KVHarness(page_size=4, num_tokens=64, mamba_slots=2)
    req = running(h, list(range(1, 11)))
    report = h.check()
    assert report.ok
    assert report.pools["kv_tokens"] == {
        "available": 64 - 12, "evictable": 0, "protected": 0, "session_held": 0,
        "pending_release": 0, "uncached": 12, "held": 0, "total": 64,
    }
    assert report.pools["rows"] == {"free": 7, "session": 0, "live": 1, "size": 8}
    assert report.pools["mamba_slots"] == {"free": 2, "session": 0, "live": 0, "size": 2}
    assert "kv_tokens: available=52" in str(report)
    h.finish(req)
    assert h.checker.runs == 1 and h.checker.total_violations == 0


def test_illegal_holdings_for_the_state():
    h = KVHarness(page_size=1)
    h.admit(h.new([1, 2, 3]))
    first = running(h, [1, 2, 3])
    h.finish(first)
    waiting = h.new([1, 2, 3, 4])
    h.admit(waiting)
    waiting.state = ReqState.WAITING  # holds a lock while "waiting"
    broken = running(h, [5, 6])
    broken.state = ReqState.ADMITTED  # holds a row while "admitted"
    found = violations(h)
    assert f"request {waiting.rid} in state waiting holds lock" in found
    assert f"request {broken.rid} in state admitted holds row" in found
    assert f"request {broken.rid} in state admitted holds kv" in found


def test_row_pointing_at_wrong_slot_is_found_only_by_the_full_walk():
    h = KVHarness(page_size=4, num_tokens=64)
    req = running(h, list(range(1, 11)))
    h.pools.req_to_token_pool.req_to_token[req.kv.row, 5] += 4
    assert violations(h, full=False) == []
    (msg,) = violations(h)
    assert msg.startswith(f"request {req.rid}: row {req.kv.row} position 5 holds slot")


def test_lock_without_receipt_and_corrupted_sizes():
    h = KVHarness(page_size=1)
    done = running(h, [1, 2, 3])
    h.finish(done)
    h.cache.inc_lock_ref(h.cache.match_prefix([1, 2]).last_node)  # nobody holds this receipt
    found = violations(h)
    assert any("lock_ref=1 but 0 receipts lock it" in v for v in found)
    h.cache._evictable_pages += 1
    assert any("evictable pages" in v and "recount" in v for v in violations(h))


def test_prefix_pages_must_be_the_locked_pages():
    h = KVHarness(page_size=4, num_tokens=64)
    h.finish(running(h, list(range(1, 10))))
    req = running(h, list(range(1, 10)) + [50, 51])
    req.kv.page_ids[0], req.kv.page_ids[2] = req.kv.page_ids[2], req.kv.page_ids[0]
    found = violations(h)
    assert f"request {req.rid}: prefix pages differ from the pages its lock protects" in found


def test_rows_mamba_and_registry_errors():
    h = KVHarness(page_size=1, mamba_slots=3)
    a = running(h, [1, 2])
    b = h.new([3])
    h.admit(b, mamba=1)
    h.pools.mamba_pool.free(b.kv.mamba_slots)  # freed behind the request's back
    h.pools.req_to_token_pool.free(a.kv.row)
    found = violations(h)
    assert f"request {a.rid} holds row {a.kv.row}, which is free" in found
    assert f"request {b.rid} holds Mamba slot {b.kv.mamba_slots[0]}, which is free" in found
    assert any(v.startswith("rows: 1 over the total") for v in found)
    h.live["dup"] = a
    assert f"request {a.rid} is registered twice" in violations(h)


def test_ladder_and_alignment():
    h = KVHarness(page_size=4, num_tokens=64)
    req = running(h, list(range(1, 11)))
    req.kv.committed_len = 11
    req.kv.protected_len = 2
    found = violations(h)
    assert any("ladder broken" in v for v in found)
    assert f"request {req.rid}: protected_len 2 not page aligned" in found


def test_pending_release_and_held_pages_balance():
    h = KVHarness(page_size=4, num_tokens=64)
    req = running(h, list(range(1, 11)))
    with h.pools.allocator.deferring(3):
        h.finish(req, insert=False)
    h.held_pages["test"] = h.pools.allocator.alloc_pages(2)
    report = h.check()
    assert report.pools["kv_tokens"]["pending_release"] == 12
    assert report.pools["kv_tokens"]["held"] == 8
    h.pools.allocator.release_deferred(3)
    h.held_pages["test"].append(h.held_pages["test"][0])  # claimed twice
    assert any("owned by both held:test and held:test" in v for v in violations(h))


def test_strict_mode_raises_with_the_report():
    h = KVHarness(page_size=1)
    req = running(h, [1, 2, 3])
    h.pools.allocator.free(req.kv.page_ids[:1])
    with pytest.raises(InvariantViolation) as err:
        h.check()
    assert "kv_tokens:" in str(err.value)
    assert not err.value.report.ok
    assert h.checker.total_violations == len(err.value.report.violations)


# -- streaming session slots (issue 12) ------------------------------------------------------


def session_engine():
    """A session whose slot holds 19 committed tokens (16 locked + 1 owned page) and a
    plain request mid decode; the checker made lenient so it reports instead of raising."""
    from kvserve.testing.scripted import ScriptedEngine

    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=128)
    sid = e.open_session("s")
    e.add(list(range(100, 116)), rid="t0", session_params={"id": sid}, max_new_tokens=4)
    e.run_until_idle()
    plain = e.add(list(range(500, 510)), rid="p", max_new_tokens=20)
    e.step()
    e.step()
    e.scheduler.checker.strict = False
    return e, e.scheduler.sessions.sessions[sid].slot, plain.req


def test_session_slots_are_counted_in_the_report():
    e, _slot, _plain = session_engine()
    report = e.check()
    assert report.ok
    assert report.pools["kv_tokens"] == {
        "available": 256 - 20 - 12, "evictable": 0, "protected": 16 + 8, "session_held": 4,
        "pending_release": 0, "uncached": 4, "held": 0, "total": 256}
    assert report.pools["rows"] == {"free": 2, "session": 1, "live": 1, "size": 4}
    assert "session_held=4" in str(report) and "session=1" in str(report)


def test_slot_page_also_claimed_by_a_request_is_a_double_owner():
    e, slot, plain = session_engine()
    lost = plain.kv.page_ids[-1]
    shared = slot.kv.page_ids[-1]
    plain.kv.page_ids[-1] = shared
    found = e.check().violations
    assert f"page {shared} owned by both req:p and session:s" in found
    assert f"1 pages have no owner (leaked): [{lost}]" in found
    assert any(v.startswith("request p: row ") for v in found)


def test_slot_record_dropped_without_release_is_a_leak():
    from kvserve.kv import ReqKV

    e, slot, _plain = session_engine()
    owned = slot.kv.owned_page_ids(4)
    slot.kv = ReqKV()  # forgotten, not released: its page, row and lock stay taken
    found = e.check().violations
    assert f"1 pages have no owner (leaked): {owned}" in found
    assert "kv tokens: 4 missing from the sum (leak): 252 counted of 256" in found
    assert "rows: 1 missing from the sum (leak): 3 counted of 4" in found
    assert any("lock_ref=1 but 0 receipts lock it" in v for v in found)
