"""``EngineCore``: model runner + scheduler + tokenizer, and ``run``, the one engine loop.

``EngineCore`` owns the model runner, the scheduler and a tokenizer (for stop
strings, checked inside the step on a tail decode, so no token past a stop is cached
or counted). ``EngineCore.run`` is the one loop: take commands (blocking only when
idle), step, deliver events (``kvserve.engine.messages``). The in-process ``Engine``
runs it in a thread behind queues; ``kvserve serve`` runs it in a process of its own
behind ZMQ (``kvserve.engine.process``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.messages import (
    AbortReq,
    Accepted,
    AddReq,
    CheckReq,
    CloseSession,
    Command,
    EngineStats,
    Event,
    OpenSession,
    Rejected,
    Reply,
    RpcReq,
    SessionReply,
    ShutdownReq,
)
from kvserve.mem.pools import build_pools, default_pool_tokens
from kvserve.sched.config import SchedulerConfig
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import QueueFull, Req, RequestRejected
from kvserve.sched.scheduler import Scheduler
from kvserve.sched.session import SessionError

_STOP_TAIL_TOKENS = 16  # at least this many tokens decoded to look for a stop string
_STATS_INTERVAL_S = 0.1  # the loop emits an EngineStats at most this often while busy
_IDLE_WAIT_S = 0.05  # how long an idle loop waits for a command before looking again
CHECK_DEADLINE_S = 10.0  # a CheckReq is answered at the latest this long after it came
_EXPIRE_INTERVAL_S = 1.0  # idle sessions are checked against session_timeout this often


@dataclass
class EngineArgs:
    """Everything that builds an engine (``Engine`` and ``kvserve serve`` share it).

    Args:
        model_path: checkpoint folder; None uses the tiny random-weight default model
            (created once in ``~/.cache/kvserve``; its output is meaningless text).
        page_size, chunked_prefill_size, max_total_tokens (KV pool size in tokens),
        disable_radix_cache, max_running_requests, context_len, schedule_policy:
            scheduler limits (see ``SchedulerConfig``).
        max_queued_requests: bound of the waiting queue; a request beyond it is refused
            with ``QueueFull`` (HTTP 429). None: unbounded.
        device: "cpu" or "cuda" (default: cuda when available); dtype: default float32
            on CPU, bfloat16 on GPU.
        attention_backend: "auto" (Triton on CUDA, else torch), "torch" or "triton".
        mem_fraction_static: on CUDA without ``max_total_tokens``, the share of the
            device memory (weights included) the engine may use; the KV pool gets what
            the weights leave of it.
        disable_cuda_graph: decode eagerly on CUDA (graphs are used by default with the
            Triton backend; see ``kvserve.model.cuda_graph``).
        strict_checks: run the strict invariant checker after every step (tests);
            otherwise it runs once each time the engine becomes idle.
        session_timeout: seconds a streaming session may stay idle (no turn in flight)
            before the engine closes it (checked about once a second). None (default):
            never, as in SGLang, whose sessions live until ``close_session``; idle
            sessions' KV is given back under pool pressure either way.
    """

    model_path: str | Path | None = None
    page_size: int = 16
    chunked_prefill_size: int | None = 2048
    max_total_tokens: int | None = None
    disable_radix_cache: bool = False
    device: str | None = None
    dtype: torch.dtype | str | None = None
    context_len: int | None = None
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    schedule_policy: str = "fcfs"
    strict_checks: bool = False
    seed: int = 0
    attention_backend: str = "auto"
    mem_fraction_static: float = 0.85
    disable_cuda_graph: bool = False
    session_timeout: float | None = None


def leave_a_core_free(device: str) -> None:
    """On CPU, at most (cores - 1) torch threads unless OMP_NUM_THREADS says otherwise:
    intra-op threads spinning on every core starve whoever feeds the loop (the HTTP
    process, or the caller's threads of an in-process ``Engine``): on 2 cores streaming
    over HTTP was 10x slower and in-process decode steps 4x slower with 2 threads."""
    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (cores or 1) - 1)))


class EngineCore:
    """Model runner + scheduler + tokenizer, driven by ``run``. Single-threaded: only
    the loop's thread touches it."""

    def __init__(self, args: EngineArgs) -> None:
        from kvserve.model.loader import load_model, load_tokenizer
        from kvserve.model.runner import ModelRunner
        from kvserve.model.source import resolve_model

        self.model = resolve_model(args.model_path)
        model_path = self.model.path
        if self.model.note:
            print(f"kvserve: {self.model.note}", file=sys.stderr)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        leave_a_core_free(device)
        dtype = getattr(torch, args.dtype) if isinstance(args.dtype, str) else args.dtype
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model, config = load_model(model_path, device, dtype)
        context_len = args.context_len or min(config.max_position_embeddings, 8192)
        layout = config.kv_layout(dtype)
        max_total_tokens = args.max_total_tokens or default_pool_tokens(
            layout, device, context_len, args.mem_fraction_static)
        pools = build_pools(args.max_running_requests, context_len, max_total_tokens,
                            args.page_size, layout, device=device)
        self.runner = ModelRunner(model, config, pools, seed=args.seed,
                                  attention_backend=args.attention_backend,
                                  cuda_graph=False if args.disable_cuda_graph else None)
        self.tokenizer = load_tokenizer(model_path)
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=args.page_size, context_len=context_len,
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                disable_radix_cache=args.disable_radix_cache,
                schedule_policy=args.schedule_policy,
                eos_token_ids=config.eos_token_ids, vocab_size=config.vocab_size,
                strict_checks=args.strict_checks, session_timeout=args.session_timeout,
            ),
            pools, self.runner,
        )
        self.scheduler.stop_string_matcher = self._match_stop
        self.model_path = str(model_path)
        self.context_len = context_len
        self.device, self.dtype = device, dtype
        self.max_queued_requests = args.max_queued_requests
        self.queue_full = 0
        self._pending_checks: list[tuple[int, float]] = []  # (tag, deadline)

    # -- commands ------------------------------------------------------------------------
    def add(self, request: AddReq) -> Rejected | Accepted:
        """Queue a request, or say why not (nothing is held for a refused one; a refused
        session turn leaves its session as it was)."""
        bound = self.max_queued_requests
        try:
            if bound is not None and len(self.scheduler.waiting) >= bound:
                self.queue_full += 1
                raise QueueFull(f"the waiting queue is full ({bound} requests); retry later")
            self.scheduler.add_request(request.input_ids, request.sampling, rid=request.rid,
                                       session_params=request.session_params)
        except RequestRejected as err:
            return Rejected(request.rid, str(err), isinstance(err, QueueFull))
        return Accepted(request.rid)

    def handle(self, command: Command) -> Event | None:
        """Carry out one command (not ``ShutdownReq``: the loop's own); its answer event,
        if any. Raises TypeError for an object that is no engine command."""
        match command:
            case AddReq():
                return self.add(command)
            case AbortReq(rid=rid):
                self.scheduler.abort_request(rid)
                return None
            case RpcReq(tag=tag, method=method):
                return Reply(tag, self.rpc(method))
            case CheckReq(tag=tag):  # answered once idle, or at the deadline
                self._pending_checks.append((tag, time.monotonic() + CHECK_DEADLINE_S))
                return None
            case OpenSession(tag=tag):
                return Reply(tag, self.open_session(command))
            case CloseSession(tag=tag, session_id=session_id):
                closed = self.scheduler.close_session(session_id)
                return Reply(tag, SessionReply(closed, session_id,
                                               "" if closed else f"no open session {session_id!r}"))
        raise TypeError(f"not an engine command: {command!r} ({type(command).__name__})")

    def open_session(self, command: OpenSession) -> SessionReply:
        """``Scheduler.open_session``; a refusal (id in use, bad capacity) is ``ok`` False."""
        try:
            sid = self.scheduler.open_session(command.session_id, command.capacity_of_str_len)
        except SessionError as err:
            return SessionReply(False, command.session_id or "", str(err))
        return SessionReply(True, sid)

    def rpc(self, method: str) -> Any:
        """Synchronous queries: "stats", "flush_cache" (True when idle and flushed; idle
        sessions' held KV is given back first, their next turns match the tree), "info".
        Raises ValueError for another name. (The invariant check is ``CheckReq``.)"""
        if method == "stats":
            return self.stats()
        if method == "flush_cache":
            if not self.scheduler.is_idle:
                return False
            self.scheduler.sessions.reclaim_all()  # slots lock tree nodes a reset would drop
            self.scheduler.tree_cache.reset()
            return True
        if method == "info":
            alloc = self.scheduler.pools.allocator
            cfg = self.scheduler.config
            return {"model_path": self.model_path, "model_name": self.model.name,
                    "random_weights": self.model.random_weights,
                    "model_source": self.model.source, "context_len": self.context_len,
                    "model_type": self.runner.config.hf_config.model_type,
                    "architectures": [self.runner.config.architecture],
                    "max_total_num_tokens": alloc.size, "page_size": alloc.page_size,
                    "max_running_requests": self.scheduler.config.max_running_requests,
                    "max_queued_requests": self.max_queued_requests,
                    # engine settings as SGLang's server_args name them, for reports
                    "chunked_prefill_size": cfg.chunked_prefill_size,
                    "schedule_policy": cfg.schedule_policy,
                    "disable_radix_cache": cfg.disable_radix_cache,
                    "session_timeout": cfg.session_timeout,
                    "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                    "torch_version": torch.__version__,
                    "torch_num_threads": torch.get_num_threads()}
        raise ValueError(f"unknown engine query {method!r}")

    def check(self) -> dict[str, Any]:
        """The full invariant check now, as JSON-ready numbers per pool; ``idle`` says
        whether the engine was idle (only then must every pool be at its total)."""
        sched = self.scheduler
        report = sched.check()
        alloc = sched.pools.allocator
        return {"ok": report.ok, "idle": sched.is_idle, "violations": report.violations,
                "pools": report.pools, "kv_total_tokens": alloc.size,
                "kv_available_tokens": alloc.available_size(),
                "kv_evictable_tokens": sched.tree_cache.evictable_size(),
                "live_requests": len(sched.reqs),
                "open_sessions": len(sched.sessions.sessions)}

    def stats(self) -> EngineStats:
        sched = self.scheduler
        alloc = sched.pools.allocator
        cached = sched.tree_cache.evictable_size()
        s = sched.stats
        ss = sched.sessions.stats
        return EngineStats(
            time.time(), len(sched.running) + (sched.chunked_req is not None),
            len(sched.waiting), alloc.size - alloc.available_size() - cached, cached,
            alloc.size, s.prompt_tokens, s.cached_tokens, s.retractions, s.aborts, s.finished,
            self.queue_full, s.checker_runs, s.violations, sched.results.generated_tokens,
            len(sched.sessions.sessions), ss.opened, ss.closed, ss.expired, ss.slot_hits,
            ss.mismatches, ss.rollbacks, ss.reclaimed)

    def abort_all(self, message: str) -> list[ReqOutput]:
        """Shutdown: release every live request through the scheduler's exit path."""
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort_request(rid, message)
        return self.scheduler.run_until_idle()

    # -- the loop --------------------------------------------------------------------------
    def run(self, recv: Callable[[float], list[Command]],
            deliver: Callable[[Sequence[Event]], None]) -> None:
        """The engine core loop, until a ``ShutdownReq``.

        ``recv(timeout_s)`` returns the commands that arrived (waiting up to
        ``timeout_s`` for the first; 0 = just look); ``deliver`` takes each step's
        events in order. The loop blocks only when idle; stats go out at most every
        ``_STATS_INTERVAL_S`` while busy, on becoming idle or busy, and after commands.
        Sessions idle past ``session_timeout`` are closed every ``_EXPIRE_INTERVAL_S``.
        """
        sched = self.scheduler
        last_stats = last_expire = 0.0
        was_idle = True
        while True:
            events: list[Event] = []
            commands = recv(_IDLE_WAIT_S if sched.is_idle else 0.0)
            handled = bool(commands)  # e.g. a flush or an abort while idle: fresh stats
            if time.monotonic() - last_expire >= _EXPIRE_INTERVAL_S:
                last_expire = time.monotonic()
                handled |= bool(sched.sessions.expire())
            for command in commands:
                if isinstance(command, ShutdownReq):
                    deliver(self.abort_all(command.message))
                    return
                event = self.handle(command)
                if event is not None:
                    events.append(event)
            events += sched.step() if not sched.is_idle else sched.take_outputs()
            events += self._answer_checks()
            now = time.monotonic()
            busy_due = not sched.is_idle and now - last_stats >= _STATS_INTERVAL_S
            if busy_due or sched.is_idle != was_idle or handled:
                events.append(self.stats())
                last_stats, was_idle = now, sched.is_idle
            if events:
                deliver(events)

    def _answer_checks(self) -> list[Event]:
        if not self._pending_checks:
            return []
        now = time.monotonic()
        due = [c for c in self._pending_checks if self.scheduler.is_idle or c[1] <= now]
        if not due:
            return []
        self._pending_checks = [c for c in self._pending_checks if c not in due]
        report = self.check()
        return [Reply(tag, report) for tag, _ in due]

    def _match_stop(self, req: Req) -> str | None:
        # a token is at least one byte of text: the tail must cover the longest stop string
        # in bytes (+2 for characters cut at its edges), or a long stop is never seen
        longest = max(len(s.encode()) for s in req.sampling.stop)
        tail_tokens = max(_STOP_TAIL_TOKENS, longest + 2)
        tail_ids = req.output_ids[-tail_tokens:]
        tail = self._decode(tail_ids)
        # min_new_tokens: a stop string completed within the first min_new_tokens - 1
        # tokens (stops were off) never ends the request; it must end after their text
        quiet = req.sampling.min_new_tokens - 1 - (len(req.output_ids) - len(tail_ids))
        start = len(self._decode(tail_ids[:quiet])) if quiet > 0 else 0
        return next((s for s in req.sampling.stop
                     if tail.find(s, max(start - len(s) + 1, 0)) >= 0), None)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


__all__ = ["EngineArgs", "EngineCore", "leave_a_core_free"]
