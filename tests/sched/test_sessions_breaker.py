"""Adversarial regressions for streaming sessions (issue 12) through the scripted
runtime: each test is one attack that once broke the session bookkeeping. Checker
strict after every step; tokens equal the reference for the context the test builds."""

from kvserve.sched import ReqState
from kvserve.sched.req import FinishKind
from kvserve.sched.session import SessionError
from kvserve.testing.scripted import ScriptedEngine


def _turn(e, sid, new, rid, base=None, replace=None, max_new=3):
    params = {"id": sid}
    if base is not None:
        params["rid"] = base
    if replace is not None:
        params["replace"] = replace
    h = e.add(new, rid=rid, session_params=params, max_new_tokens=max_new)
    e.run_until_idle()
    assert h.state is ReqState.FINISHED and h.finished_reason.kind is FinishKind.LENGTH
    return h


def test_a_reused_turn_rid_counts_as_completed_last_for_replace():
    """A client may name a new turn with the rid of an earlier one (it is not live): the
    turn list is in completion order, so replace with that rid forgets only the turns
    completed after its newest completion (here none)."""
    e = ScriptedEngine(page_size=4, num_tokens=256)
    sid = e.open_session("s")
    a = _turn(e, sid, [5, 6, 7], "A")
    ctx_a = [5, 6, 7] + a.output_ids
    b = _turn(e, sid, [8], "B", base="A")
    ctx_b = ctx_a + [8] + b.output_ids
    a2 = _turn(e, sid, [9], "A", base="B")  # "A" again, completed after "B"
    ctx_a2 = ctx_b + [9] + a2.output_ids
    turns = e.scheduler.sessions.sessions[sid].turns
    assert list(turns) == ["B", "A"]
    assert turns["A"].tolist() == ctx_a2 and turns["B"].tolist() == ctx_b
    c = _turn(e, sid, [10], "C", base="A", replace=True)  # nothing completed after A
    assert c.req.prompt_ids == ctx_a2 + [10]
    assert c.output_ids == e.reference(ctx_a2 + [10], 3)
    assert list(turns) == ["B", "A", "C"]
    d = _turn(e, sid, [11], "D", base="B")  # B is still a completed turn
    assert d.output_ids == e.reference(ctx_b + [11], 3)
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_null_session_params_fields_mean_their_defaults():
    """SGLang's ``SessionParams`` fields are all optional: a client that serialises the
    whole object sends ``"rid": null, "offset": null, "replace": null``; null is the
    default for each of them (``replace`` too), not a refusal."""
    e = ScriptedEngine(page_size=4, num_tokens=256)
    sid = e.open_session("s")
    h = e.add([5, 6, 7], rid="A", max_new_tokens=3,
              session_params={"id": sid, "rid": None, "offset": None, "replace": None})
    e.run_until_idle()
    assert h.output_ids == e.reference([5, 6, 7], 3)
    assert list(e.scheduler.sessions.sessions[sid].turns) == ["A"]
    assert e.close_session(sid)
    e.assert_idle_and_full()


def test_reopening_a_closing_session_says_it_is_closing_then_works_after_its_turn():
    """Close with a turn in flight defers the release; opening the same id meanwhile is
    refused as closing (not 'already open', which the client just closed), and works
    once the turn has ended."""
    e = ScriptedEngine(page_size=4, num_tokens=256)
    sid = e.open_session("s")
    h = e.add([5, 6, 7], rid="A", max_new_tokens=5, session_params={"id": sid})
    e.step()
    assert e.close_session(sid)
    try:
        e.open_session(sid)
    except SessionError as err:
        assert str(err) == ("session 's' is closing: its turn in flight ('A') ends first, "
                            "open it again after that")
    else:
        raise AssertionError("reopening a closing session was accepted")
    e.run_until_idle()
    assert h.output_ids == e.reference([5, 6, 7], 5)
    assert e.open_session(sid) == sid
    assert e.scheduler.sessions.sessions[sid].turns == {}
    assert e.close_session(sid)
    e.assert_idle_and_full()
