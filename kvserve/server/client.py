"""``EngineClient``: the HTTP process's side of the engine process (asyncio + ZMQ).

It starts the engine process, waits for ``EngineReady``, then one reader task
routes every event: a request's outputs to its own ``asyncio.Queue``, add
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvserve.engine import (
    Accepted,
    AddRequest,
    EngineArgs,
    EngineStats,
    Rejected,
    Reply,
)
from kvserve.sched.req import QueueFull, RequestRejected, SamplingParams
from kvserve.sched.scheduler import ReqOutput
from kvserve.server.engine_proc import EngineFailed, EngineReady, run_engine_process

_WATCH_INTERVAL_S = 0.1  # how often the engine process's liveness is checked


class EngineDead(RuntimeError):
    """The engine process exited; nothing more will come from it."""


@dataclass
class RequestChannel:
    """One request's outputs, in order; ``EngineDead`` ends it if the engine dies."""

    rid: str
    queue: asyncio.Queue[ReqOutput | Exception] = field(default_factory=asyncio.Queue)
    finished: bool = False
    # its reader left before the engine finished it: kept until the engine's last output
    # (or refusal) so that output never reaches a new request reusing the rid
    orphaned: bool = False


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
        self.channels: dict[str, RequestChannel] = {}
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
        EngineDead if it fails to start (the message says why)."""
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
                message = first.message if isinstance(first, EngineFailed) else repr(first)
                raise EngineDead(f"engine failed to start: {message}")
            if not self.process.is_alive():
                raise EngineDead(f"engine process exited with code {self.process.exitcode} "
                                 "before it was ready")
            if time.monotonic() > deadline:
                self.process.kill()
                raise EngineDead(f"engine not ready after {self.startup_timeout_s:.0f} s")
        self._tasks = [asyncio.create_task(self._read_events()),
                       asyncio.create_task(self._watch_process())]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (it aborts and releases every live request) and wait for it."""
        self._closing = True
        proc = self.process
        if proc is not None and proc.is_alive():
            # NOBLOCK: a dying engine has closed its socket, and a blocking send to no
            # peer would wait forever (SIGTERM then never ends the server)
            with contextlib.suppress(zmq.ZMQError):
                await self._commands.send_pyobj(("stop", "server shutting down"), zmq.NOBLOCK)
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
    async def add(self, rid: str, input_ids: list[int],
                  sampling: SamplingParams) -> RequestChannel:
        """Queue a request in the engine and return its channel once accepted.
        Raises RequestRejected (bad input, duplicate rid), QueueFull, EngineDead."""
        self._check_alive()
        if rid in self.channels:
            raise RequestRejected(f"duplicate request id {rid!r}")
        channel = RequestChannel(rid)
        self.channels[rid] = channel
        ack: asyncio.Future[Accepted | Rejected] = asyncio.get_running_loop().create_future()
        self._acks[rid] = ack
        try:
            await self._commands.send_pyobj(("add", AddRequest(rid, input_ids, sampling)))
            answer = await ack
        except BaseException:
            self._acks.pop(rid, None)
            if not ack.done() or not isinstance(ack.result(), Rejected):
                channel.orphaned = True  # until the engine's answer for this rid comes
                self.abort(rid)  # cancelled while queued: the engine may hold it
            else:
                self.channels.pop(rid, None)
            raise
        if isinstance(answer, Rejected):
            self.channels.pop(rid, None)
            raise QueueFull(answer.message) if answer.queue_full else \
                RequestRejected(answer.message)
        return channel

    def abort(self, rid: str) -> None:
        """Abort ``rid`` in the engine (at any stage; no-op when unknown or finished)."""
        if self.dead is None and not self._closing:
            self._commands.send_pyobj(("abort", rid))

    def release(self, rid: str) -> None:
        """Forget a request's channel (its reader is done with it). One the engine has
        not finished yet (the reader left early and aborted it) stays as an orphan until
        its final output arrives: the rid stays taken until the engine lets go of it."""
        channel = self.channels.get(rid)
        if channel is None or channel.finished:
            self.channels.pop(rid, None)
        else:
            channel.orphaned = True

    async def rpc(self, what: str, timeout_s: float = 30.0) -> Any:
        """Ask the engine (``EngineCore.rpc``: "stats", "info", "flush_cache", "check")."""
        self._check_alive()
        tag = next(self._tags)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[tag] = reply
        try:
            await self._commands.send_pyobj(("rpc", (tag, what)))
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
        if isinstance(event, ReqOutput):
            channel = self.channels.get(event.rid)
            if channel is not None:
                channel.finished = event.finished_reason is not None
                if not channel.orphaned:
                    channel.queue.put_nowait(event)
                elif channel.finished:
                    del self.channels[event.rid]
        elif isinstance(event, Accepted | Rejected):
            ack = self._acks.pop(event.rid, None)
            if ack is not None and not ack.done():
                ack.set_result(event)
            orphan = self.channels.get(event.rid)
            if isinstance(event, Rejected) and orphan is not None and orphan.orphaned:
                del self.channels[event.rid]
        elif isinstance(event, Reply):
            reply = self._replies.get(event.tag)
            if reply is not None and not reply.done():
                reply.set_result(event.payload)
        elif isinstance(event, EngineStats):
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
        for channel in self.channels.values():
            channel.queue.put_nowait(EngineDead(why))
        for future in [*self._acks.values(), *self._replies.values()]:
            if not future.done():
                future.set_exception(EngineDead(why))

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self._closing:
            raise EngineDead("server is shutting down")
