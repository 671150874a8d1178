"""Streaming sessions in the scheduler (issue 12), through the scripted runtime: the real
scheduler, pools and radix cache with a fake model that reads the KV pool, checker strict
after every step. A turn's tokens must equal the reference for the context the test
builds itself (not the one the session built), pool numbers and counters are exact."""

import dataclasses
from typing import Any

import pytest

from kvserve.mem.pages import num_pages
from kvserve.sched import ReqState
from kvserve.sched.req import FinishKind, RequestRejected
from kvserve.sched.scheduler import AbortStatus, SpecConfig
from kvserve.sched.session import SessionError, SessionStats
from kvserve.testing.scripted import ScriptedEngine

NOT_AN_OBJECT: Any = "s"


def toks(start, n):
    return list(range(start, start + n))


def turn(e, sid, new, rid, base=None, offset=None, replace=None, max_new=6, **kw):
    """Queue a session turn; ``base`` is the completed turn it continues (rid)."""
    params = {"id": sid}
    if base is not None:
        params["rid"] = base
    if offset is not None:
        params["offset"] = offset
    if replace is not None:
        params["replace"] = replace
    return e.add(new, rid=rid, session_params=params, max_new_tokens=max_new, **kw)


def done(e, h, context, max_new=6):
    """The turn finished normally with the reference tokens of ``context``."""
    assert h.state is ReqState.FINISHED
    assert h.finished_reason.kind is FinishKind.LENGTH, h.finished_reason
    assert h.req.prompt_ids == context
    assert h.output_ids == e.reference(context, max_new)
    return context + h.output_ids


def session(e, sid):
    return e.scheduler.sessions.sessions[sid]


def stats(e):
    return dataclasses.replace(e.scheduler.sessions.stats)


def slot_ladder(e, sid, context):
    """The slot holds exactly the committed KV of ``context`` (all but its last token):
    allocated_len == committed_len, ceil pages, the tokens are the context's."""
    kv = session(e, sid).slot.kv
    committed = len(context) - 1
    assert kv.holds_row
    assert kv.committed_len == kv.allocated_len == committed
    assert len(kv.page_ids) == num_pages(committed, e.page_size)
    assert kv.protected_len == (0 if e.config.disable_radix_cache
                                else committed // e.page_size * e.page_size)
    assert session(e, sid).slot.tokens == context[:committed]


def snapshot(e, sid):
    """Everything a refused command must leave as it was."""
    s = session(e, sid)
    kv = s.slot.kv
    report = e.check()
    return (list(s.slot.tokens), kv.row, kv.protected_len, kv.committed_len, kv.allocated_len,
            list(kv.page_ids), kv.lock, kv.lock.spent if kv.lock else None,
            {r: a.tolist() for r, a in s.turns.items()}, s.active, s.closing, s.slot.idle_since,
            stats(e), report.pools, sorted(e.scheduler.reqs), len(e.scheduler.waiting))


# -- (a) speculative over-allocation, a rejected turn, close ----------------------------------


def test_a_speculative_turn_rejected_turn_then_valid_turn_and_close():
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)  # reserve 8
    accepts = iter([2, 3, 1, 4] * 50)
    e = ScriptedEngine(page_size=16, num_tokens=1024, context_len=256, speculative=spec,
                       accept_counts=lambda i, step: next(accepts))
    sid = e.open_session()
    p1 = toks(3000, 40)
    h1 = turn(e, sid, p1, "t1", max_new=10)
    saw_overallocation = False
    while not h1.req.finished:
        e.step()
        kv = h1.req.kv
        saw_overallocation |= kv.allocated_len > kv.committed_len + 1
    assert saw_overallocation
    ctx1 = done(e, h1, p1, 10)
    slot_ladder(e, sid, ctx1)  # the speculative tail was freed at the end of the turn
    assert e.check().pools["kv_tokens"] == {
        "available": 1024 - 64, "evictable": 0, "protected": 48, "session_held": 16,
        "pending_release": 0, "uncached": 0, "held": 0, "total": 1024}
    assert e.check().pools["rows"] == {"free": e.pools.req_to_token_pool.size - 1,
                                       "session": 1, "live": 0,
                                       "size": e.pools.req_to_token_pool.size}
    before = snapshot(e, sid)
    with pytest.raises(RequestRejected, match="longer than the context limit of 255"):
        turn(e, sid, toks(5000, 210), "t2", base="t1")  # 50 + 210 > 255
    with pytest.raises(RequestRejected, match="token ids must be integers"):
        turn(e, sid, [5, -1], "t2", base="t1")
    assert snapshot(e, sid) == before
    assert "t2" not in e.scheduler.reqs and "t2" not in e.handles
    h3 = turn(e, sid, toks(6000, 7), "t3", base="t1", max_new=9)
    e.run_until_idle()
    ctx3 = done(e, h3, ctx1 + toks(6000, 7), 9)
    assert h3.req.cached_tokens == len(ctx1) - 1  # the slot's KV, no tree match
    slot_ladder(e, sid, ctx3)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1)
    assert e.close_session(sid)
    assert sid not in e.scheduler.sessions.sessions
    e.assert_idle_and_full()
    assert e.scheduler.sessions.stats == SessionStats(opened=1, closed=1, slot_hits=1)


# -- (b) an aborted long turn, then a turn continuing from the turn before it -----------------


def test_b_aborted_turn_rolls_back_and_the_next_turn_continues_turn_0():
    e = ScriptedEngine(page_size=16, num_tokens=4096, num_rows=8, context_len=2048)
    sid = e.open_session()
    p0 = toks(1000, 512)
    h0 = turn(e, sid, p0, "t0", max_new=48)
    e.run_until_idle()
    ctx0 = done(e, h0, p0, 48)
    assert len(ctx0) == 560
    slot_ladder(e, sid, ctx0)
    h1 = turn(e, sid, toks(9000, 64), "t1", base="t0", max_new=100)
    assert h1.req.prompt_len == 624
    while len(h1.output_ids) < 3:
        e.step()
    assert h1.req.cached_tokens == 559  # took over the slot
    assert e.abort("t1") is AbortStatus.PENDING
    e.step()
    assert h1.finished_reason.kind is FinishKind.ABORT
    assert h1.output_ids == e.reference(ctx0 + toks(9000, 64), 3)
    s = session(e, sid)
    assert s.active is None and not s.slot.is_holding_kv and list(s.turns) == ["t0"]
    h2 = turn(e, sid, toks(7000, 10), "t2", base="t0", max_new=8)
    assert h2.req.prompt_len == 512 + 48 + 10
    assert h2.req.to_finish is None
    e.run_until_idle()
    ctx2 = done(e, h2, ctx0 + toks(7000, 10), 8)
    assert h2.req.cached_tokens == 560  # turn 0's pages, matched in the tree
    slot_ladder(e, sid, ctx2)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1, rollbacks=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


# -- (c) close during decode -----------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_c_close_during_decode_finishes_the_turn_then_drops_the_session(page_size):
    e = ScriptedEngine(page_size=page_size, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 30), "t0")
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 30))
    h1 = turn(e, sid, toks(200, 5), "t1", base="t0", max_new=12)
    while len(h1.output_ids) < 4:
        e.step()
    assert e.close_session(sid)
    assert not e.close_session(sid)  # already closing
    with pytest.raises(SessionError, match="no open session"):
        turn(e, sid, [1], "t2", base="t1")
    assert session(e, sid).closing
    e.run_until_idle()
    done(e, h1, ctx0 + toks(200, 5), 12)
    assert sid not in e.scheduler.sessions.sessions
    assert e.scheduler.sessions.stats == SessionStats(opened=1, closed=1, slot_hits=1)
    e.assert_idle_and_full()
    assert not e.close_session(sid)


def test_c_close_while_the_turn_waits():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    h = turn(e, sid, toks(100, 30), "t0")
    assert e.close_session(sid)
    e.run_until_idle()
    done(e, h, toks(100, 30))
    assert sid not in e.scheduler.sessions.sessions
    e.assert_idle_and_full()


# -- (d) idle sessions under pool pressure ---------------------------------------------------


def hold_sessions(e, count, prompt_len=16, max_new=4):
    """``count`` sessions, one completed turn each, run one after the other (so their
    slots' ages are their order); returns [(sid, context)]."""
    out = []
    for i in range(count):
        sid = e.open_session(f"s{i:03d}")
        p = toks(1000 + 100 * i, prompt_len)
        h = turn(e, sid, p, f"s{i:03d}-0", max_new=max_new)
        e.run_until_idle()
        out.append((sid, done(e, h, p, max_new)))
    return out


def test_d_hundred_idle_sessions_give_back_kv_oldest_first():
    e = ScriptedEngine(page_size=4, num_tokens=2048, num_rows=128, context_len=512)
    held = hold_sessions(e, 100)
    for sid, ctx in held:
        slot_ladder(e, sid, ctx)  # 19 committed tokens: 16 locked + 1 owned page each
    assert e.check().pools["kv_tokens"] == {
        "available": 48, "evictable": 0, "protected": 1600, "session_held": 400,
        "pending_release": 0, "uncached": 0, "held": 0, "total": 2048}
    plain = [e.add(toks(50000 + 1000 * i, 200), rid=f"p{i}", max_new_tokens=8)
             for i in range(3)]
    e.run_until_idle()
    for h in plain:  # nobody failed for memory
        assert h.finished_reason.kind is FinishKind.LENGTH
        assert h.output_ids == e.reference(h.req.prompt_ids, 8)
    reclaimed = e.scheduler.sessions.stats.reclaimed
    assert 0 < reclaimed < 100
    holding = [sid for sid, _ in held if session(e, sid).slot.is_holding_kv]
    assert holding == [sid for sid, _ in held[reclaimed:]]  # the oldest went first
    # 3 x 208 tokens of KV were needed; each idle slot gives 20 (16 evictable + 4 free)
    assert reclaimed == -(-(3 * 208 - 48) // 20)
    # a reclaimed session falls back to the tree; a holding one continues its slot
    (old, old_ctx), (new, new_ctx) = held[0], held[-1]
    before = stats(e)
    h_old = turn(e, old, toks(7000, 3), "old-1", base=f"{old}-0")
    h_new = turn(e, new, toks(7100, 3), "new-1", base=f"{new}-0")
    e.run_until_idle()
    done(e, h_old, old_ctx + toks(7000, 3))
    done(e, h_new, new_ctx + toks(7100, 3))
    assert h_new.req.cached_tokens == 19
    assert h_old.req.cached_tokens in (0, 16)  # whatever the tree kept of it
    after = e.scheduler.sessions.stats
    assert after.slot_hits == before.slot_hits + 1 and after.mismatches == before.mismatches
    for sid, _ in held:
        assert e.close_session(sid)
    e.assert_idle_and_full()
    assert e.scheduler.stats.aborts == 0


def test_d_more_idle_sessions_than_rows():
    e = ScriptedEngine(page_size=4, num_tokens=1024, num_rows=4, context_len=256)
    held = hold_sessions(e, 10)
    rows = e.pools.req_to_token_pool
    assert rows.available_size() == 0
    assert e.scheduler.sessions.stats.reclaimed == 6
    assert [sid for sid, _ in held if session(e, sid).slot.is_holding_kv] == \
        ["s006", "s007", "s008", "s009"]
    plain = [e.add(toks(20000 + 100 * i, 10), rid=f"p{i}", max_new_tokens=5) for i in range(3)]
    e.run_until_idle()
    for h in plain:
        assert h.finished_reason.kind is FinishKind.LENGTH
        assert h.output_ids == e.reference(h.req.prompt_ids, 5)
    assert e.scheduler.sessions.stats.reclaimed == 9
    assert [sid for sid, _ in held if session(e, sid).slot.is_holding_kv] == ["s009"]
    sid, ctx = held[0]
    h = turn(e, sid, [5], "again", base=f"{sid}-0")
    e.run_until_idle()
    done(e, h, ctx + [5])
    for sid, _ in held:
        assert e.close_session(sid)
    e.assert_idle_and_full()


# -- (e) abort of a waiting first turn -------------------------------------------------------


def test_e_abort_of_a_waiting_first_turn_leaves_the_session_usable():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 20), "t0")
    assert e.abort("t0") is AbortStatus.ABORTED
    assert h0.finished_reason.kind is FinishKind.ABORT and h0.output_ids == []
    s = session(e, sid)
    assert s.active is None and s.turns == {} and not s.slot.is_holding_kv
    with pytest.raises(SessionError, match="no completed turn 't0'"):
        turn(e, sid, [1], "t1", base="t0")
    h1 = turn(e, sid, toks(100, 20), "t1")
    assert h1.req.to_finish is None
    e.run_until_idle()
    ctx1 = done(e, h1, toks(100, 20))
    slot_ladder(e, sid, ctx1)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, rollbacks=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


# -- history that the slot does not hold ------------------------------------------------------


def two_turns(e, sid):
    """Turns t0 and t1 (t1 continues t0); returns their contexts."""
    h0 = turn(e, sid, toks(100, 22), "t0")
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 22))
    h1 = turn(e, sid, toks(300, 5), "t1", base="t0")
    e.run_until_idle()
    return ctx0, done(e, h1, ctx0 + toks(300, 5))


def test_edited_history_offset_releases_the_slot_to_the_tree():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    ctx0, ctx1 = two_turns(e, sid)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1)
    h2 = turn(e, sid, [400, 401], "t2", base="t0", offset=21)
    assert not session(e, sid).slot.is_holding_kv  # released at once, to the tree
    assert e.tree_cache.protected_size() == 0
    assert e.tree_cache.evictable_size() == (len(ctx1) - 1) // 4 * 4
    e.run_until_idle()
    ctx2 = done(e, h2, ctx0[:21] + [400, 401])
    assert h2.req.cached_tokens == 20  # the tree's pages of ctx0[:21]
    slot_ladder(e, sid, ctx2)
    # a negative offset is a Python slice too
    h3 = turn(e, sid, [500], "t3", base="t1", offset=-3)
    e.run_until_idle()
    done(e, h3, ctx1[:-3] + [500])
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1, mismatches=2)
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_other_rid_falls_back_to_the_tree_and_whole_history_resent_hits_the_slot():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    ctx0, _ctx1 = two_turns(e, sid)
    h2 = turn(e, sid, toks(600, 3), "t2", base="t0")  # a sibling of t1
    e.run_until_idle()
    ctx2 = done(e, h2, ctx0 + toks(600, 3))
    assert h2.req.cached_tokens == len(ctx0) // 4 * 4
    assert e.scheduler.sessions.stats.mismatches == 1
    # rid None: the new tokens are the whole context; it extends the slot: a slot hit
    h3 = turn(e, sid, ctx2 + [700, 701], "t3")
    e.run_until_idle()
    done(e, h3, ctx2 + [700, 701])
    assert h3.req.cached_tokens == len(ctx2) - 1
    # a context the slot holds whole (nothing left to compute) is not a slot hit
    slot_tokens = list(session(e, sid).slot.tokens)
    h4 = turn(e, sid, slot_tokens, "t4")
    e.run_until_idle()
    done(e, h4, slot_tokens)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=2, mismatches=2)
    assert e.close_session(sid)
    e.assert_idle_and_full()


# -- refused commands change nothing ------------------------------------------------------------


def test_turn_while_one_in_flight_is_refused_and_nothing_changes():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    _ctx0, _ = two_turns(e, sid)
    h2 = turn(e, sid, [900], "t2", base="t1", max_new=10)
    e.step()
    before = snapshot(e, sid)
    with pytest.raises(SessionError, match="has a turn in flight \\('t2'\\)"):
        turn(e, sid, [901], "t3", base="t0")
    with pytest.raises(SessionError, match="has a turn in flight"):
        turn(e, sid, [901], "t3", replace=False)
    assert snapshot(e, sid) == before
    e.run_until_idle()
    assert h2.finished_reason.kind is FinishKind.LENGTH
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_turn_sent_while_the_aborted_turn_is_still_leaving_is_accepted():
    """A client hangs up and sends its next turn at once: the old turn's abort is
    pending (applied when its batch's results are processed), the new turn supersedes
    it without replace, the old one rolls back and the new one continues turn 0."""
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=8, context_len=400)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 30), "t0", max_new=5)
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 30), max_new=5)
    h1 = turn(e, sid, [7, 8, 9], "t1", base="t0", max_new=20)
    e.step()
    e.step()
    assert e.abort("t1") is AbortStatus.PENDING
    h2 = turn(e, sid, [10, 11], "t2", base="t0", max_new=5)
    assert session(e, sid).active is h2.req
    e.run_until_idle()
    assert h1.finished_reason.kind is FinishKind.ABORT
    ctx2 = done(e, h2, ctx0 + [10, 11], max_new=5)
    assert stats(e) == SessionStats(opened=1, slot_hits=1, rollbacks=1)
    h3 = turn(e, sid, [12], "t3", base="t2", max_new=3)
    e.run_until_idle()
    done(e, h3, ctx2 + [12], max_new=3)
    assert stats(e) == SessionStats(opened=1, slot_hits=2, rollbacks=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_bad_session_params_are_refused_and_nothing_changes():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session(capacity_of_str_len=60)
    _ctx0, ctx1 = two_turns(e, sid)
    before = snapshot(e, sid)
    bad = [
        ({"id": "nope"}, "no open session 'nope'"),
        ({"id": sid, "rid": "t9"}, "has no completed turn 't9'"),
        ({"id": sid, "rid": "t1", "offset": len(ctx1) + 1}, "offset .* is outside turn 't1'"),
        ({"id": sid, "rid": "t1", "offset": -len(ctx1) - 1}, "is outside turn"),
        ({"id": sid, "offset": 3}, "give the rid"),
        ({"id": sid, "rid": "t1", "offset": "3"}, "offset must be an integer"),
        ({"id": sid, "replace": 1}, "replace must be true or false"),
        ({"id": sid, "colour": 1}, "unknown session_params field"),
        ({"rid": "t1"}, "needs the session 'id'"),
        ({"id": ""}, "id must be a non-empty string"),
        ({"id": sid, "rid": "t1", "replace": True}, "exceeds session .* capacity_of_str_len"),
    ]
    for params, message in bad:
        new = toks(800, 40) if params.get("replace") else [800]
        with pytest.raises(SessionError, match=message):
            e.add(new, rid="x", session_params=params, max_new_tokens=3)
        assert snapshot(e, sid) == before
    with pytest.raises(SessionError, match="must be an object"):
        e.add([1], rid="x", session_params=NOT_AN_OBJECT)
    with pytest.raises(SessionError, match="already open"):
        e.open_session(sid)
    with pytest.raises(SessionError, match="capacity_of_str_len must be a positive integer"):
        e.open_session(capacity_of_str_len=0)
    assert snapshot(e, sid) == before
    assert len(e.scheduler.sessions.sessions) == 1 and "x" not in e.scheduler.reqs
    assert not e.close_session("nope")
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_replace_aborts_the_turn_in_flight_and_forgets_later_turns():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    ctx0, _ctx1 = two_turns(e, sid)
    h2 = turn(e, sid, [900], "t2", base="t1", max_new=20)
    for _ in range(3):
        e.step()
    assert h2.state is ReqState.RUNNING
    h3 = turn(e, sid, [910, 911], "t3", base="t0", replace=True, max_new=5)
    assert h2.req.to_finish is not None and h2.req.to_finish.message == \
        "replaced by a newer turn of its session"
    assert list(session(e, sid).turns) == ["t0"]  # t1 forgotten
    e.run_until_idle()
    assert h2.finished_reason.kind is FinishKind.ABORT
    done(e, h3, ctx0 + [910, 911], 5)
    with pytest.raises(SessionError, match="no completed turn 't1'"):
        turn(e, sid, [1], "t4", base="t1")
    # replace of a waiting turn: aborted at once
    h4 = turn(e, sid, [920], "t4", base="t3", max_new=5)
    h5 = turn(e, sid, [930], "t5", base="t3", replace=True, max_new=5)
    assert h4.finished_reason.kind is FinishKind.ABORT
    e.run_until_idle()
    done(e, h5, ctx0 + [910, 911] + h3.output_ids + [930], 5)
    # t3 found the slot empty (t2 held it), t5 continued t3's slot
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=3, rollbacks=2)
    assert e.close_session(sid)
    e.assert_idle_and_full()


# -- retraction, chunked prefill, no radix cache ---------------------------------------------


def test_turn_retracted_after_taking_over_its_slot_completes_correctly():
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 21), "t0", max_new=3)
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 21), 3)
    plain = e.add(toks(5000, 30), rid="p", max_new_tokens=40)
    e.step()
    e.step()
    t1 = turn(e, sid, toks(300, 6), "t1", base="t0", max_new=30)
    e.step()
    assert t1.state is ReqState.RUNNING and t1.req.cached_tokens == 23
    assert not session(e, sid).slot.is_holding_kv  # the turn holds the record now
    while e.scheduler.stats.retractions == 0:
        e.tree_cache.evict(10**9)
        e.exhaust_pool(10**9)
        e.step()
        e.restore_pool()
    assert t1.state is ReqState.RETRACTED and plain.state is ReqState.RUNNING
    assert not t1.req.kv.holds_anything and not session(e, sid).slot.is_holding_kv
    assert session(e, sid).active is t1.req
    e.run_until_idle()
    ctx1 = done(e, t1, ctx0 + toks(300, 6), 30)
    assert plain.output_ids == e.reference(toks(5000, 30), 40)
    slot_ladder(e, sid, ctx1)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1)
    assert e.scheduler.stats.aborts == 0
    h2 = turn(e, sid, [1], "t2", base="t1")
    e.run_until_idle()
    done(e, h2, ctx1 + [1])
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_chunked_prefill_of_a_turn_continuing_an_unaligned_slot():
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256,
                       chunked_prefill_size=16)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 17), "t0", max_new=3)
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 17), 3)
    slot_ladder(e, sid, ctx0)
    assert session(e, sid).slot.kv.committed_len == 19  # unaligned
    h1 = turn(e, sid, toks(400, 40), "t1", base="t0", max_new=5)
    e.step()
    assert h1.state is ReqState.CHUNKED and h1.req.kv.committed_len == 35
    e.step()
    assert h1.state is ReqState.CHUNKED and h1.req.kv.committed_len == 51
    e.run_until_idle()
    ctx1 = done(e, h1, ctx0 + toks(400, 40), 5)
    assert h1.req.cached_tokens == 19
    slot_ladder(e, sid, ctx1)
    # a chunked turn aborted mid prompt rolls back; the next one continues turn 1
    h2 = turn(e, sid, toks(600, 50), "t2", base="t1", max_new=5)
    e.step()
    assert h2.state is ReqState.CHUNKED
    e.abort("t2")
    e.run_until_idle()
    assert h2.finished_reason.kind is FinishKind.ABORT
    h3 = turn(e, sid, toks(700, 20), "t3", base="t1", max_new=5)
    e.run_until_idle()
    done(e, h3, ctx1 + toks(700, 20), 5)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=2, rollbacks=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_sessions_without_the_radix_cache():
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256,
                       disable_radix_cache=True)
    sids = [e.open_session() for _ in range(3)]
    ctxs = {}
    for i, sid in enumerate(sids):
        ctxs[sid] = two_turns(e, sid)[1] if i == 0 else None
    sid = sids[0]
    slot_ladder(e, sid, ctxs[sid])
    h = turn(e, sid, [50], "t2", base="t0", offset=10)  # edited: the slot is freed
    assert not session(e, sid).slot.is_holding_kv
    e.run_until_idle()
    ctx2 = done(e, h, toks(100, 10) + [50])
    slot_ladder(e, sid, ctx2)
    # pool pressure: idle slots are freed (there is no tree to hand them to)
    other = sids[1]
    ho = turn(e, other, toks(2000, 30), "o0", max_new=3)
    e.run_until_idle()
    done(e, ho, toks(2000, 30), 3)
    assert e.pools.allocator.available_size() == 256 - 16 - 32
    big = e.add(toks(3000, 220), rid="big", max_new_tokens=8)
    e.run_until_idle()
    assert big.output_ids == e.reference(toks(3000, 220), 8)
    assert e.scheduler.sessions.stats.reclaimed == 2
    assert not session(e, sid).slot.is_holding_kv
    h = turn(e, sid, [60], "t3", base="t2")
    e.run_until_idle()
    done(e, h, ctx2 + [60])
    for s in sids:
        assert e.close_session(s)
    e.assert_idle_and_full()


# -- timeout, and a slot reclaimed while its turn waits ----------------------------------------


def test_session_timeout_closes_only_idle_sessions():
    now = [0.0]
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256,
                       session_timeout=10, clock=lambda: now[0])
    a, b = e.open_session("a"), e.open_session("b")
    ha = turn(e, a, toks(100, 10), "a0")
    e.run_until_idle()
    done(e, ha, toks(100, 10))
    now[0] = 5.0
    hb = turn(e, b, toks(200, 10), "b0", max_new=30)
    e.step()
    now[0] = 10.0
    assert e.scheduler.sessions.expire() == []  # a: idle exactly the timeout
    now[0] = 10.5
    assert e.scheduler.sessions.expire() == ["a"]  # b has a turn in flight
    assert a not in e.scheduler.sessions.sessions
    e.run_until_idle()
    done(e, hb, toks(200, 10), 30)
    now[0] = 15.0
    c = e.open_session("c")
    now[0] = 20.0
    assert e.scheduler.sessions.expire() == []  # b ended its turn at 10.5
    now[0] = 21.0
    assert e.scheduler.sessions.expire() == ["b"]
    assert list(e.scheduler.sessions.sessions) == [c]
    assert e.scheduler.sessions.stats == SessionStats(opened=3, closed=2, expired=2,
                                                      slot_hits=0)
    with pytest.raises(SessionError, match="no open session 'b'"):
        turn(e, b, [1], "b1", base="b0")
    assert e.close_session(c)
    e.assert_idle_and_full()


def test_slot_reclaimed_while_its_turn_waits():
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256,
                       max_running_requests=1)
    sid = e.open_session()
    h0 = turn(e, sid, toks(100, 21), "t0", max_new=3)
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 21), 3)
    plain = e.add(toks(5000, 30), rid="p", max_new_tokens=12)
    t1 = turn(e, sid, toks(300, 4), "t1", base="t0")
    e.step()
    assert plain.state is ReqState.RUNNING and t1.state is ReqState.WAITING
    while session(e, sid).slot.is_holding_kv:
        e.tree_cache.evict(10**9)
        e.exhaust_pool(10**9)
        e.step()
        e.restore_pool()
    assert e.scheduler.sessions.stats.reclaimed == 1
    assert e.scheduler.stats.retractions == 0
    assert t1.state is ReqState.WAITING
    e.run_until_idle()
    assert plain.output_ids == e.reference(toks(5000, 30), 12)
    ctx1 = done(e, t1, ctx0 + toks(300, 4))
    slot_ladder(e, sid, ctx1)
    assert e.scheduler.sessions.stats == SessionStats(opened=1, reclaimed=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


# -- what admission counts on ------------------------------------------------------------------


def test_idle_sessions_sharing_a_system_prompt_are_counted_together():
    """Two idle slots lock the same system prompt: releasing either alone frees only its
    branch, releasing both frees the prompt too. Admission must count the second (a
    request needing it was never admitted and the idle engine stalled)."""
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256)
    system = toks(100, 160)
    held = []
    for i in range(2):
        sid = e.open_session()
        h = turn(e, sid, system + toks(1000 + 10 * i, 8), f"{sid}-0", max_new=2)
        e.run_until_idle()
        held.append((sid, done(e, h, system + toks(1000 + 10 * i, 8), 2)))
    assert e.check().pools["kv_tokens"] == {
        "available": 256 - 160 - 2 * 12, "evictable": 0, "protected": 160 + 2 * 8,
        "session_held": 8, "pending_release": 0, "uncached": 0, "held": 0, "total": 256}
    assert e.scheduler.sessions.reclaimable_tokens() == 256 - 72
    big = e.add(toks(5000, 150), rid="big", max_new_tokens=4)
    e.run_until_idle()
    assert big.output_ids == e.reference(toks(5000, 150), 4)
    assert e.scheduler.sessions.stats.reclaimed == 2
    for sid, _ in held:
        assert e.close_session(sid)
    e.assert_idle_and_full()


def test_admission_does_not_count_a_slot_prefix_a_new_request_locked():
    """A plain request that locks the prefix an idle slot holds makes that prefix
    unreclaimable: the next request of the step must not be admitted on it (it was,
    and its allocation missed after admission)."""
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256)
    sid = e.open_session()
    system = toks(100, 160)
    h = turn(e, sid, system, "t0", max_new=1)
    e.run_until_idle()
    done(e, h, system, 1)
    assert e.pools.allocator.available_size() == 96
    shared = e.add(system + toks(900, 40), rid="shared", max_new_tokens=30)
    other = e.add(toks(5000, 60), rid="other", max_new_tokens=4)
    e.run_until_idle()
    assert shared.output_ids == e.reference(system + toks(900, 40), 30)
    assert other.output_ids == e.reference(toks(5000, 60), 4)
    assert e.scheduler.stats.retractions == 0
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_a_turn_in_another_cache_namespace_does_not_take_over_the_slot():
    """``extra_key`` namespaces the KV (cache salt, adapter): a turn with another one must
    not continue the slot's KV, it matches its own namespace in the tree."""
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    h0 = e.add(toks(100, 22), rid="t0", session_params={"id": sid}, extra_key="a",
               max_new_tokens=6)
    e.run_until_idle()
    ctx0 = done(e, h0, toks(100, 22))
    h1 = e.add([7], rid="t1", session_params={"id": sid, "rid": "t0"}, extra_key="b",
               max_new_tokens=6)
    assert not session(e, sid).slot.is_holding_kv
    e.run_until_idle()
    ctx1 = done(e, h1, ctx0 + [7])
    assert h1.req.cached_tokens == 0
    h2 = e.add([8], rid="t2", session_params={"id": sid, "rid": "t1"}, extra_key="b",
               max_new_tokens=6)
    e.run_until_idle()
    done(e, h2, ctx1 + [8])
    assert h2.req.cached_tokens == len(ctx1) - 1
    assert e.scheduler.sessions.stats == SessionStats(opened=1, slot_hits=1, mismatches=1)
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_reclaim_takes_a_slot_whose_turn_waits_last():
    e = ScriptedEngine(page_size=4, num_tokens=256, num_rows=4, context_len=256,
                       max_running_requests=1)
    (a, ctx_a), (b, _) = hold_sessions(e, 2, prompt_len=21, max_new=3)
    plain = e.add(toks(5000, 30), rid="p", max_new_tokens=12)
    ta = turn(e, a, [9], "a-1", base=f"{a}-0")  # a is older, but its turn waits
    e.step()
    assert ta.state is ReqState.WAITING
    while e.scheduler.sessions.stats.reclaimed == 0:
        e.tree_cache.evict(10**9)
        e.exhaust_pool(10**9)
        e.step()
        e.restore_pool()
    assert e.scheduler.sessions.stats.reclaimed == 1
    assert session(e, a).slot.is_holding_kv and not session(e, b).slot.is_holding_kv
    e.run_until_idle()
    assert plain.output_ids == e.reference(toks(5000, 30), 12)
    done(e, ta, ctx_a + [9])
    assert ta.req.cached_tokens == len(ctx_a) - 1
    for sid in (a, b):
        assert e.close_session(sid)
    e.assert_idle_and_full()


def test_replaced_turn_ending_after_its_closing_session_was_dropped():
    """Turn t1 decodes, t2 replaces it (t1's abort waits for its next batch), the session
    is closed: t2 finishes in its prefill and drops the session, then t1's abort is
    processed; it must release only its own KV (it dropped the session a second time)."""
    e = ScriptedEngine(page_size=4, num_tokens=512, num_rows=4, context_len=256)
    sid = e.open_session()
    ctx0, _ = two_turns(e, sid)
    t2 = turn(e, sid, [900], "t2", base="t1", max_new=20)
    e.step()
    e.step()
    assert t2.state is ReqState.RUNNING
    t3 = turn(e, sid, [910], "t3", base="t0", replace=True, max_new=1)
    assert e.close_session(sid)
    e.step()  # t3's prefill: its only token, the session is dropped
    done(e, t3, ctx0 + [910], 1)
    assert sid not in e.scheduler.sessions.sessions and t2.state is ReqState.RUNNING
    e.run_until_idle()
    assert t2.finished_reason.kind is FinishKind.ABORT
    assert e.scheduler.sessions.stats == SessionStats(opened=1, closed=1, slot_hits=2,
                                                      rollbacks=1)
    e.assert_idle_and_full()
