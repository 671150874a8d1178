"""Streaming sessions through the in-process ``Engine`` API (SGLang's session API):
open/close, every refused turn (nothing changes, the engine keeps serving), replace,
offset, capacity, close during a turn, flush with an idle session holding KV, chat,
the session timeout and the typed messages. Tiny random model, checker strict."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve import Engine
from kvserve.engine import EngineArgs, EngineCore
from kvserve.engine.messages import AddReq, CloseSession, OpenSession, Reply, SessionReply
from kvserve.sched.req import RequestRejected, SamplingParams
from kvserve.sched.session import SessionError, SessionParams

POOL_TOKENS = 512


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


LONG = greedy(400)  # decodes for far longer than a test needs to act on it


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Iterator[Engine]:
    with Engine(model_path=ckpt, page_size=4, chunked_prefill_size=8,
                max_total_tokens=POOL_TOKENS, device="cpu", strict_checks=True) as e:
        yield e


@pytest.fixture
def sid(engine: Engine) -> Iterator[str]:
    """A fresh session, closed after the test; the pools must then be full."""
    session_id = engine.open_session()
    yield session_id
    engine.close_session(session_id)
    assert_pools_full(engine)


def assert_pools_full(engine: Engine) -> dict[str, Any]:
    report = engine.check()
    kv, rows = report["pools"]["kv_tokens"], report["pools"]["rows"]
    assert report["ok"], report["violations"]
    assert report["idle"] and report["open_sessions"] == 0, report
    assert kv["available"] + kv["evictable"] == kv["total"] == POOL_TOKENS, kv
    assert kv["protected"] == kv["session_held"] == 0, kv
    assert rows["free"] == rows["size"] and rows["session"] == 0, rows
    return report


def ids(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def test_open_session_returns_an_id_and_close_is_true_once(engine: Engine) -> None:
    before = engine.stats()
    sid = engine.open_session()
    assert len(sid) == 32 and int(sid, 16) >= 0  # uuid4 hex
    assert engine.open_session("my-session", capacity_of_str_len=64) == "my-session"
    assert engine.stats().open_sessions == before.open_sessions + 2
    assert engine.close_session(sid) is True
    assert engine.close_session(sid) is False
    assert engine.close_session("my-session") is True
    assert engine.close_session("never-opened") is False
    after = engine.stats()
    assert (after.sessions_opened - before.sessions_opened,
            after.sessions_closed - before.sessions_closed, after.open_sessions) == (2, 2, 0)
    assert_pools_full(engine)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"session_id": "dup"}, "session 'dup' is already open"),
    ({"session_id": ""}, "session_id must be a non-empty string"),
    ({"capacity_of_str_len": 0}, "capacity_of_str_len must be a positive integer, got 0"),
    ({"capacity_of_str_len": "8"}, "capacity_of_str_len must be a positive integer"),
    ({"capacity_of_str_len": True}, "capacity_of_str_len must be a positive integer"),
])
def test_open_session_refuses_a_duplicate_id_and_a_bad_capacity(
        engine: Engine, kwargs: dict[str, Any], message: str) -> None:
    assert engine.open_session("dup") == "dup"
    with pytest.raises(SessionError, match=message):
        engine.open_session(**kwargs)
    assert engine.stats().open_sessions == 1
    assert engine.close_session("dup") is True
    assert_pools_full(engine)


@pytest.mark.parametrize(("params", "message"), [
    ({"id": "nope"}, "no open session 'nope'"),
    ("not-an-object", "session_params must be an object"),
    ({"rid": "x"}, "session_params needs the session 'id'"),
    ({"id": "s", "extra": 1}, "unknown session_params field"),
    ({"id": ""}, "session_params.id must be a non-empty string"),
    ({"id": "s", "offset": 2}, "give the rid"),
    ({"id": "s", "replace": "yes"}, "replace must be true or false"),
])
def test_a_malformed_or_unknown_session_turn_is_refused(
        engine: Engine, params: Any, message: str) -> None:
    with pytest.raises(RequestRejected, match=message):
        engine.generate(input_ids=ids(4), sampling_params=greedy(2), session_params=params)
    assert engine.generate(input_ids=ids(4), sampling_params=greedy(2)).completion_tokens == 2
    assert_pools_full(engine)


def test_batch_generate_with_session_params_is_refused(engine: Engine, sid: str) -> None:
    with pytest.raises(SessionError, match="session_params takes one prompt"):
        engine.generate(input_ids=[ids(3), ids(3, 40)], session_params={"id": sid})


def test_a_turn_while_another_is_in_flight_is_refused(engine: Engine, sid: str) -> None:
    stream = engine.generate_stream(input_ids=ids(6), sampling_params=LONG,
                                    session_params={"id": sid})
    assert next(stream).finish_reason is None
    with pytest.raises(RequestRejected, match=f"session '{sid}' has a turn in flight"):
        engine.generate(input_ids=ids(3), session_params={"id": sid})
    stream.close()  # walks away: the turn is aborted, the session rolls back
    engine.check()  # answered once idle: the abort is done
    stats = engine.stats()
    turn = engine.generate(input_ids=ids(3), sampling_params=greedy(2),
                           session_params={"id": sid})
    assert turn.finish_reason == "length" and turn.cached_tokens == 0
    assert engine.stats().session_rollbacks == stats.session_rollbacks


def test_replace_aborts_the_turn_in_flight_and_forgets_later_turns(
        engine: Engine, sid: str) -> None:
    stream = engine.generate_stream(input_ids=ids(6), sampling_params=LONG,
                                    session_params={"id": sid})
    first = next(stream)
    b = engine.generate(input_ids=ids(5), sampling_params=greedy(4),
                        session_params={"id": sid, "replace": True})
    a = list(stream)[-1]
    assert (a.finish_reason, a.finish_message) == ("abort",
                                                   "replaced by a newer turn of its session")
    assert b.finish_reason == "length" and b.prompt_tokens == 5
    with pytest.raises(RequestRejected, match=f"has no completed turn '{first.rid}'"):
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": first.rid})
    c = engine.generate(input_ids=ids(2), sampling_params=greedy(3),
                        session_params={"id": sid, "rid": b.rid})
    assert c.prompt_tokens == 5 + 4 + 2 and c.cached_tokens == 5 + 4 - 1
    # replace with rid b: turn c is forgotten, the context is b's again
    d = engine.generate(input_ids=ids(3), sampling_params=greedy(2),
                        session_params={"id": sid, "rid": b.rid, "replace": True})
    assert d.prompt_tokens == 5 + 4 + 3
    with pytest.raises(RequestRejected, match=f"has no completed turn '{c.rid}'"):
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": c.rid})


def test_rid_of_an_unknown_or_aborted_turn_is_refused(engine: Engine, sid: str) -> None:
    with pytest.raises(RequestRejected, match="has no completed turn 'nope'"):
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": "nope"})
    stream = engine.generate_stream(input_ids=ids(6), sampling_params=LONG,
                                    session_params={"id": sid})
    aborted = next(stream).rid
    engine.abort(aborted)
    assert list(stream)[-1].finish_reason == "abort"
    with pytest.raises(RequestRejected, match=f"has no completed turn '{aborted}'"):
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": aborted})
    assert engine.generate(input_ids=ids(2), sampling_params=greedy(1),
                           session_params={"id": sid}).finish_reason == "length"


def test_offset_cuts_the_context_and_a_bad_offset_is_refused(engine: Engine, sid: str) -> None:
    t1 = engine.generate(input_ids=ids(8), sampling_params=greedy(5),
                         session_params={"id": sid})
    context = ids(8) + t1.output_ids  # 13 tokens
    for offset in (14, -14):
        with pytest.raises(RequestRejected, match=f"offset {offset} is outside turn "
                           f"'{t1.rid}'.*13 tokens"):
            engine.generate(input_ids=ids(3), session_params={"id": sid, "rid": t1.rid,
                                                              "offset": offset})
    with pytest.raises(SessionError, match="offset must be an integer, got '2'"):
        engine.generate(input_ids=ids(3), session_params={"id": sid, "rid": t1.rid,
                                                          "offset": "2"})
    for offset, kept in ((6, 6), (-3, 10)):
        cut = engine.generate(input_ids=ids(3, 50), sampling_params=greedy(4),
                              session_params={"id": sid, "rid": t1.rid, "offset": offset})
        plain = engine.generate(input_ids=context[:kept] + ids(3, 50),
                                sampling_params=greedy(4))
        assert cut.prompt_tokens == kept + 3 and cut.output_ids == plain.output_ids


def test_capacity_exceeded_is_refused_and_the_session_is_unchanged(engine: Engine) -> None:
    sid = engine.open_session(capacity_of_str_len=12)
    with pytest.raises(RequestRejected, match=f"the turn's context of 13 tokens exceeds "
                       f"session '{sid}'.* capacity_of_str_len of 12"):
        engine.generate(input_ids=ids(13), session_params={"id": sid})
    t1 = engine.generate(input_ids=ids(8), sampling_params=greedy(3),
                         session_params={"id": sid})
    with pytest.raises(RequestRejected, match="context of 13 tokens"):  # 8 + 3 + 2
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": t1.rid})
    t2 = engine.generate(input_ids=ids(1), sampling_params=greedy(1),
                         session_params={"id": sid, "rid": t1.rid})
    assert t2.prompt_tokens == 12 and t2.cached_tokens == 8 + 3 - 1  # the slot was kept
    assert engine.close_session(sid) is True
    assert_pools_full(engine)


def test_close_during_a_turn_waits_for_it_then_the_pools_are_full(engine: Engine) -> None:
    sid = engine.open_session()
    stream = engine.generate_stream(input_ids=ids(6), sampling_params=greedy(40),
                                    session_params={"id": sid})
    assert next(stream).finish_reason is None
    assert engine.close_session(sid) is True
    assert engine.close_session(sid) is False  # already closing
    last = list(stream)[-1]
    assert (last.finish_reason, last.completion_tokens) == ("length", 40)
    assert_pools_full(engine)
    with pytest.raises(RequestRejected, match=f"no open session '{sid}'"):
        engine.generate(input_ids=ids(2), session_params={"id": sid, "rid": last.rid})


def test_flush_cache_gives_back_an_idle_sessions_kv(engine: Engine, sid: str) -> None:
    t1 = engine.generate(input_ids=ids(9), sampling_params=greedy(4),
                         session_params={"id": sid})
    held = engine.check()["pools"]
    kv = held["kv_tokens"]  # 9 + 4 - 1 = 12 committed: 3 full pages, in the tree, locked
    assert (held["rows"]["session"], kv["protected"], kv["session_held"]) == (1, 12, 0)
    assert engine.flush_cache() is True
    kv = engine.check()["pools"]["kv_tokens"]
    assert kv["available"] == kv["total"]
    assert kv["evictable"] == kv["protected"] == kv["session_held"] == 0
    t2 = engine.generate(input_ids=ids(3, 60), sampling_params=greedy(3),
                         session_params={"id": sid, "rid": t1.rid})
    assert t2.prompt_tokens == 9 + 4 + 3 and t2.cached_tokens == 0  # nothing left to match
    plain = engine.generate(input_ids=ids(9) + t1.output_ids + ids(3, 60),
                            sampling_params=greedy(3))
    assert t2.output_ids == plain.output_ids


def test_chat_turns_reuse_the_held_kv_and_refuse_rid(engine: Engine, sid: str) -> None:
    messages = [{"role": "user", "content": "Hi there!"}]
    one = engine.chat(messages, sampling_params=greedy(1), session_params={"id": sid})
    messages += [{"role": "assistant", "content": one.text},
                 {"role": "user", "content": "Tell me more."}]
    two = engine.chat(messages, sampling_params=greedy(2), session_params={"id": sid})
    assert two.cached_tokens == one.prompt_tokens  # prompt + 1 output - the last token
    with pytest.raises(SessionError, match="whole conversation: session_params takes only"):
        engine.chat(messages, session_params={"id": sid, "rid": two.rid})
    with pytest.raises(SessionError, match="whole conversation"):
        engine.chat(messages, session_params={"id": sid, "rid": two.rid, "offset": 3})


def test_an_idle_session_past_its_timeout_is_closed(ckpt: Path) -> None:
    with Engine(model_path=ckpt, page_size=4, max_total_tokens=POOL_TOKENS, device="cpu",
                strict_checks=True, session_timeout=0.2) as e:
        sid = e.open_session()
        e.generate(input_ids=ids(6), sampling_params=greedy(2), session_params={"id": sid})
        deadline = time.monotonic() + 10
        while e.stats().open_sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = e.stats()
        assert (stats.open_sessions, stats.sessions_expired, stats.sessions_closed) == (0, 1, 1)
        assert e.core.rpc("info")["session_timeout"] == 0.2
        assert_pools_full(e)


def test_session_commands_are_typed_messages(ckpt: Path) -> None:
    core = EngineCore(EngineArgs(model_path=ckpt, page_size=4, max_total_tokens=POOL_TOKENS,
                                 device="cpu", strict_checks=True))
    assert core.handle(OpenSession(1, "s")) == Reply(1, SessionReply(True, "s"))
    assert core.handle(OpenSession(2, "s")) == \
        Reply(2, SessionReply(False, "s", "session 's' is already open"))
    turn = AddReq("t1", [1, 2, 3], SamplingParams(max_new_tokens=2), SessionParams("s"))
    assert pickle.loads(pickle.dumps(turn)) == turn  # crosses the engine process's sockets
    assert core.add(turn).rid == "t1"
    core.scheduler.run_until_idle()
    assert core.handle(CloseSession(3, "s")) == Reply(3, SessionReply(True, "s"))
    assert core.handle(CloseSession(4, "s")) == \
        Reply(4, SessionReply(False, "s", "no open session 's'"))
    assert core.rpc("info")["session_timeout"] is None
