"""``EngineClient``: the HTTP process's side of the engine process (asyncio + ZMQ).

It starts the engine process, waits for ``EngineReady``, then one reader task
dispatches every event by type: a request's outputs to its own ``asyncio.Queue``
(through a ``RequestRouter``, as the in-process ``Engine`` does), add
acknowledgements and RPC replies to futures, stats snapshots to ``stats``. When
the engine process dies, every waiter gets ``EngineDead`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvserve.engine.core import EngineArgs
from kvserve.engine.messages import (
    AbortReq,
    Accepted,
    AddReq,
    CheckReq,
    CloseSession,
    Command,
    EngineFailed,
    EngineReady,
    EngineStats,
    OpenSession,
    Rejected,
    Reply,
    RpcReq,
    SessionReply,
    ShutdownReq,
)
from kvserve.engine.process import run_engine_process
from kvserve.engine.router import RequestRouter
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import QueueFull, RequestRejected, SamplingParams
from kvserve.sched.session import SessionError, SessionParams

_WATCH_INTERVAL_S = 0.1  # how often the engine process's liveness is checked


class EngineDead(RuntimeError):
    """The engine process exited; nothing more will come from it."""


class EngineStartError(EngineDead):
    """The engine process could not load the model. ``str()`` is one line (the last of
    ``detail``); ``detail`` is the engine's whole message (a traceback when the
    failure was not a ModelLoadError)."""

    def __init__(self, detail: str) -> None:
        lines = detail.strip().splitlines() or ["(no message)"]
        super().__init__(lines[-1])
        self.detail = detail


@dataclass
class RequestChannel:
    """One request's outputs, in order; ``EngineDead`` ends it if the engine dies."""

    rid: str
    queue: asyncio.Queue[ReqOutput | Exception] = field(default_factory=asyncio.Queue)


class EngineClient:
    """Start with ``await start()``; ``add`` / ``abort`` / ``rpc``; ``await shutdown()``.

    Args:
        args: the engine's build arguments (the model is loaded in the engine process).
        startup_timeout_s: how long to wait for the model to load.
    """

    def __init__(self, args: EngineArgs, startup_timeout_s: float = 300.0) -> None:
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.info: dict[str, Any] = {}
        self.stats: EngineStats | None = None
        self.dead: str | None = None  # why, once the engine process is gone
        self.router: RequestRouter[RequestChannel] = RequestRouter()
        self._acks: dict[str, asyncio.Future[Accepted | Rejected]] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._tags = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._events = self._ctx.socket(zmq.PULL)
        self.process: multiprocessing.process.BaseProcess | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and wait until its model is loaded. Raises
        EngineStartError when it reports a failure, EngineDead when it exits or is not
        ready within ``startup_timeout_s`` (then it is killed). Cancellable; then
        ``shutdown`` kills the process at once."""
        command_addr = f"ipc://{Path(self._tmp.name) / 'commands'}"
        event_addr = f"ipc://{Path(self._tmp.name) / 'events'}"
        self._commands.bind(command_addr)
        self._events.bind(event_addr)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_engine_process, name="kvserve-engine",
                                     args=(self.args, command_addr, event_addr), daemon=True)
        self.process.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if await self._events.poll(200):
                first = await self._events.recv_pyobj()
                if isinstance(first, EngineReady):
                    self.info, self.stats = first.info, first.stats
                    break
                raise EngineStartError(first.message if isinstance(first, EngineFailed)
                                       else f"unexpected first message {first!r}")
            if not self.process.is_alive():
                raise EngineDead(f"engine process exited with code {self.process.exitcode} "
                                 "before it was ready")
            if time.monotonic() > deadline:
                self.process.kill()
                raise EngineDead(f"engine not ready after {self.startup_timeout_s:.0f} s")
        self._tasks = [asyncio.create_task(self._read_events()),
                       asyncio.create_task(self._watch_process())]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (it aborts and releases every live request) and wait for it;
        one still loading its model is killed (it would read no command until loaded)."""
        self._closing = True
        proc = self.process
        if proc is not None and proc.is_alive() and not self.info:
            proc.kill()
            proc.join(timeout=5)
        elif proc is not None and proc.is_alive():
            # NOBLOCK: a dying engine has closed its socket, and a blocking send to no
            # peer would wait forever (SIGTERM then never ends the server)
            with contextlib.suppress(zmq.ZMQError):
                await self._commands.send_pyobj(ShutdownReq("server shutting down"),
                                                zmq.NOBLOCK)
            deadline = time.monotonic() + timeout_s
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for task in self._tasks:
            task.cancel()
        self._fail_all("server shut down")
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    # -- requests ------------------------------------------------------------------------
    async def add(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                  session_params: SessionParams | None = None) -> RequestChannel:
        """Queue a request in the engine and return its channel once accepted; with
        ``session_params`` a turn of a streaming session (``input_ids``: the new tokens).
        Raises RequestRejected (bad input, duplicate rid; SessionError for a refused
        turn), QueueFull, EngineDead."""
        self._check_alive()
        channel = RequestChannel(rid)
        self.router.open(rid, channel)
        ack: asyncio.Future[Accepted | Rejected] = asyncio.get_running_loop().create_future()
        self._acks[rid] = ack
        try:
            await self._commands.send_pyobj(AddReq(rid, input_ids, sampling, session_params))
            answer = await ack
        except BaseException:
            self._acks.pop(rid, None)
            self.release(rid)  # cancelled while queued: the engine may hold it
            raise
        if isinstance(answer, Rejected):
            self.router.close(rid)
            raise QueueFull(answer.message) if answer.queue_full else \
                RequestRejected(answer.message)
        return channel

    def abort(self, rid: str) -> None:
        """Abort ``rid`` in the engine (at any stage; no-op when unknown or finished)."""
        if self.dead is None and not self._closing:
            self._commands.send_pyobj(AbortReq(rid))

    def release(self, rid: str) -> None:
        """The reader of ``rid`` is done with its channel. One the engine has not
        finished yet (the reader left early) is aborted and stays as an orphan until its
        final output arrives: the rid stays taken until the engine lets go of it."""
        if self.router.close(rid):
            self.abort(rid)

    async def rpc(self, method: str, timeout_s: float = 30.0) -> Any:
        """Ask the engine (``EngineCore.rpc``: "stats", "info", "flush_cache")."""
        return await self._call(lambda tag: RpcReq(tag, method), timeout_s)

    async def open_session(self, session_id: str | None = None,
                           capacity_of_str_len: int | None = None) -> str:
        """Open a streaming session (``Engine.open_session``); returns its id. Raises
        SessionError (id in use, bad capacity), EngineDead."""
        reply: SessionReply = await self._call(
            lambda tag: OpenSession(tag, session_id, capacity_of_str_len), 30.0)
        if not reply.ok:
            raise SessionError(reply.message)
        return reply.session_id

    async def close_session(self, session_id: str) -> bool:
        """Close a streaming session (``Engine.close_session``); False when unknown."""
        reply: SessionReply = await self._call(lambda tag: CloseSession(tag, session_id),
                                               30.0)
        return reply.ok

    async def check(self, timeout_s: float = 30.0) -> Any:
        """The engine's full invariant check (``EngineCore.check``), run once it is idle."""
        return await self._call(CheckReq, timeout_s)

    async def _call(self, command: Callable[[int], Command], timeout_s: float) -> Any:
        self._check_alive()
        tag = next(self._tags)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[tag] = reply
        try:
            await self._commands.send_pyobj(command(tag))
            return await asyncio.wait_for(reply, timeout_s)
        finally:
            self._replies.pop(tag, None)

    # -- background tasks ----------------------------------------------------------------
    async def _read_events(self) -> None:
        while True:
            batch = await self._events.recv_pyobj()
            if isinstance(batch, EngineFailed):
                self._mark_dead(f"engine process failed: {batch.message.strip()[-2000:]}")
                return
            for event in batch:
                self._dispatch(event)

    def _dispatch(self, event: Any) -> None:
        match event:
            case ReqOutput() as out:
                channel = self.router.route(out)
                if channel is not None:
                    channel.queue.put_nowait(out)
            case Accepted(rid=rid) | Rejected(rid=rid):
                ack = self._acks.pop(rid, None)
                if ack is not None and not ack.done():
                    ack.set_result(event)
                if isinstance(event, Rejected):  # the answer goes by the ack, not the channel
                    self.router.route(event)
            case Reply(tag=tag, payload=payload):
                reply = self._replies.get(tag)
                if reply is not None and not reply.done():
                    reply.set_result(payload)
            case EngineStats():
                self.stats = event

    async def _watch_process(self) -> None:
        assert self.process is not None
        while self.process.is_alive() or self._closing:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        self._mark_dead(f"engine process exited with code {self.process.exitcode}")

    def _mark_dead(self, why: str) -> None:
        if self.dead is None and not self._closing:
            self.dead = why
            self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        for channel in self.router.channels():
            channel.queue.put_nowait(EngineDead(why))
        for future in [*self._acks.values(), *self._replies.values()]:
            if not future.done():
                future.set_exception(EngineDead(why))

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self._closing:
            raise EngineDead("server is shutting down")
