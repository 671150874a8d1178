"""``RequestRouter``: one reader per rid, duplicates refused, an early-leaving reader's
rid held as an orphan until the engine's final event, so a reused rid never gets the
old request's outputs or its abort."""

from __future__ import annotations

import pytest

from kvserve.engine.messages import Rejected
from kvserve.engine.router import RequestRouter
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import FinishKind, FinishReason, RequestRejected


def _step(rid: str, token: int) -> ReqOutput:
    return ReqOutput(rid, [token], None, 3, 0, 1)


def _final(rid: str, kind: FinishKind = FinishKind.LENGTH) -> ReqOutput:
    return ReqOutput(rid, [9], FinishReason(kind), 3, 0, 2)


def test_a_second_open_of_a_live_rid_is_refused_and_the_first_reader_keeps_it():
    router: RequestRouter[str] = RequestRouter()
    router.open("a", "first")
    with pytest.raises(RequestRejected, match=r"^duplicate request id 'a'$"):
        router.open("a", "second")
    assert router.route(_step("a", 1)) == "first"
    assert router.rids() == ["a"] and router.channels() == ["first"]


def test_a_reader_that_read_the_final_output_frees_the_rid_on_close():
    router: RequestRouter[str] = RequestRouter()
    router.open("a", "ch")
    assert router.route(_step("a", 1)) == "ch"
    assert router.route(_final("a")) == "ch"
    assert router.close("a") is False  # nothing to abort
    assert len(router) == 0 and "a" not in router
    router.open("a", "again")  # free for reuse
    assert router.channels() == ["again"]


def test_orphan_holds_its_rid_until_the_final_output_then_the_reuse_gets_only_its_own():
    router: RequestRouter[str] = RequestRouter()
    router.open("a", "old")
    assert router.route(_step("a", 1)) == "old"
    assert router.close("a") is True  # left early: the caller aborts it
    assert router.orphans() == ["a"] and len(router) == 1
    with pytest.raises(RequestRejected, match="duplicate request id 'a'"):
        router.open("a", "new")  # the old request is still finishing
    assert router.route(_step("a", 2)) is None  # nobody reads an orphan
    assert router.route(_final("a", FinishKind.ABORT)) is None  # the final frees the rid
    assert router.orphans() == [] and len(router) == 0
    router.open("a", "new")
    assert router.route(_step("a", 3)) == "new"
    assert router.route(_final("a")) == "new"
    assert router.close("a") is False and len(router) == 0


def test_a_refusal_is_final_for_a_reader_and_for_an_orphan():
    router: RequestRouter[str] = RequestRouter()
    router.open("a", "ch")
    assert router.route(Rejected("a", "queue full", queue_full=True)) == "ch"
    assert router.close("a") is False and len(router) == 0
    router.open("b", "ch")
    assert router.close("b") is True  # cancelled before the engine answered
    assert router.route(Rejected("b", "context limit")) is None
    assert len(router) == 0


def test_events_for_unknown_rids_are_dropped_and_closing_one_is_a_no_op():
    router: RequestRouter[str] = RequestRouter()
    assert router.route(_final("ghost")) is None
    assert router.close("ghost") is False
    assert len(router) == 0


def test_closing_twice_keeps_one_orphan_and_channels_include_it():
    router: RequestRouter[str] = RequestRouter()
    router.open("a", "ch-a")
    router.open("b", "ch-b")
    assert router.close("a") is True
    assert router.close("a") is True  # still unfinished: still an orphan
    assert router.rids() == ["a", "b"] and router.orphans() == ["a"]
    assert router.channels() == ["ch-a", "ch-b"]  # the engine's death reaches both
