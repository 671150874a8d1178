"""The engine process of ``kvserve serve``: ``EngineCore.run`` behind two ZMQ sockets.

    HTTP process --PUSH--> commands (a pickled message each)     --PULL--> engine process
    HTTP process <--PULL-- events (a pickled list per loop turn)   <--PUSH-- engine process

The first message the engine sends is ``EngineReady`` (or ``EngineFailed`` when the
model cannot be loaded: the one-line reason of a ModelLoadError, else the traceback).
SIGINT is ignored here (a terminal's Ctrl-C reaches the whole process group; the HTTP
process shuts the engine down in order), SIGTERM stops the loop after releasing every
request, and the loop stops on its own when the HTTP process is gone.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Sequence

import zmq

from kvserve.engine.core import EngineArgs, EngineCore
from kvserve.engine.messages import Command, EngineFailed, EngineReady, Event, ShutdownReq
from kvserve.model.errors import ModelLoadError


def run_engine_process(args: EngineArgs, command_addr: str, event_addr: str) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 2000)
    events.connect(event_addr)
    try:
        core = EngineCore(args)
    except Exception as err:
        events.send_pyobj(EngineFailed(str(err) if isinstance(err, ModelLoadError)
                                       else traceback.format_exc()))
        events.close()
        ctx.term()
        raise SystemExit(1) from None
    events.send_pyobj(EngineReady(core.rpc("info"), core.stats()))
    parent = os.getppid()

    def recv(timeout_s: float) -> list[Command]:
        if terminated:
            return [ShutdownReq("engine process terminated")]
        if os.getppid() != parent:
            return [ShutdownReq("HTTP process is gone")]
        received: list[Command] = []
        if timeout_s <= 0 or commands.poll(int(timeout_s * 1000)):
            while True:
                try:
                    received.append(commands.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    return received
        return received

    def deliver(batch: Sequence[Event]) -> None:
        events.send_pyobj(batch)

    try:
        core.run(recv, deliver)
    except BaseException:
        events.send_pyobj(EngineFailed(traceback.format_exc()))
        raise
    finally:
        commands.close(linger=0)
        events.close()
        ctx.term()
