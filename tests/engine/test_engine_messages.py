"""Engine commands are typed messages, dispatched by their class: each command type
gets its answer, and anything else (the old ("add", ...) tuples included) is a
TypeError naming it, not a silent no-op."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.engine import EngineArgs, EngineCore
from kvserve.engine.messages import (
    AbortReq,
    Accepted,
    AddReq,
    CheckReq,
    EngineStats,
    Rejected,
    Reply,
    RpcReq,
    ShutdownReq,
)
from kvserve.model.init import init_model
from kvserve.sched.req import SamplingParams


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineCore]:
    path = init_model(tmp_path_factory.mktemp("m") / "tiny-qwen2", "tiny-qwen2")
    yield EngineCore(EngineArgs(model_path=path, page_size=4, chunked_prefill_size=8,
                                max_total_tokens=256, device="cpu", strict_checks=True))


def _sampling(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("command", [("add", AddReq("x", [1, 2], SamplingParams())),
                                     ("abort", "x"), "stats", None])
def test_anything_but_a_command_message_is_a_type_error(core: EngineCore, command: Any):
    with pytest.raises(TypeError, match="^not an engine command: .*"
                       f"\\({type(command).__name__}\\)$"):
        core.handle(command)
    assert core.scheduler.is_idle and not core.scheduler.reqs


def test_each_command_type_gets_its_answer(core: EngineCore):
    assert core.handle(AddReq("a", [1, 2, 3], _sampling(4))) == Accepted("a")
    assert core.handle(AddReq("a", [1, 2, 3], _sampling(4))) == \
        Rejected("a", "duplicate request id 'a'", False)
    assert core.handle(RpcReq(7, "flush_cache")) == Reply(7, False)  # busy: not flushed
    assert core.handle(AbortReq("a")) is None
    outputs = core.scheduler.run_until_idle()
    assert [(o.rid, o.finished_reason.kind.value if o.finished_reason else None)
            for o in outputs][-1] == ("a", "abort")
    assert core.handle(RpcReq(8, "flush_cache")) == Reply(8, True)
    reply = core.handle(RpcReq(10, "stats"))
    assert isinstance(reply, Reply) and isinstance(reply.payload, EngineStats)
    assert (reply.payload.running, reply.payload.waiting, reply.payload.aborts) == (0, 0, 1)


def test_the_loop_answers_a_check_when_idle_and_stops_on_shutdown(core: EngineCore):
    assert core.handle(CheckReq(9)) is None  # answered by the loop, once idle
    script = [[CheckReq(3)], [ShutdownReq("bye")]]
    delivered: list[object] = []
    core.run(lambda timeout_s: script.pop(0) if script else [], delivered.extend)
    replies = [e for e in delivered if isinstance(e, Reply)]
    assert [r.tag for r in replies] == [9, 3]
    assert all(r.payload["ok"] is True and r.payload["idle"] is True for r in replies)


def test_messages_survive_the_engine_process_pickling():
    command = AddReq("r", [5, 6], SamplingParams(max_new_tokens=2, stop=("x",)))
    assert pickle.loads(pickle.dumps(command)) == command
    assert type(pickle.loads(pickle.dumps(AbortReq("r")))) is AbortReq
