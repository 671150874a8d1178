"""The engine core loop, and ``Engine``: that loop in a background thread.

    from kvserve import Engine, SamplingParams
    with Engine(model_path="/path/to/hf-checkpoint") as engine:
        out = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16})
        print(out.text, out.finish_reason)

``EngineCore`` owns the model runner, the scheduler and a tokenizer (for stop
strings, checked inside the step on a tail decode, so no token past a stop is cached
or counted). ``EngineCore.run`` is the one loop: take commands (blocking only when
idle), step, deliver events. ``Engine`` runs it in a thread behind queues, so
``abort`` works while another thread reads a stream; ``kvserve serve`` runs it in a
process of its own behind ZMQ (``kvserve.server.engine_proc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvserve.detokenize import TextStream
from kvserve.sched.req import QueueFull, Req, RequestRejected, SamplingParams
from kvserve.sched.scheduler import ReqOutput, Scheduler, SchedulerConfig

_STOP_TAIL_TOKENS = 16  # at least this many tokens decoded to look for a stop string
_STATS_INTERVAL_S = 0.1  # the loop emits an EngineStats at most this often while busy
_IDLE_WAIT_S = 0.05  # how long an idle loop waits for a command before looking again


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


@dataclass
class GenerateOutput:
    """A finished (or, when streaming, partial) request. Token counts are tokens."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    finish_message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    delta: str = ""  # streaming: text new since the previous chunk
    output_logprobs: list[float] | None = None  # with return_logprob, on the final output


class AddRequest(NamedTuple):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams


class Rejected(NamedTuple):
    """Event: ``add`` refused ``rid`` (nothing was queued). ``queue_full`` -> retry later."""

    rid: str
    message: str
    queue_full: bool = False


class Accepted(NamedTuple):
    """Event: ``rid`` is queued."""

    rid: str


class Reply(NamedTuple):
    """Event: the answer to an ``rpc`` command."""

    tag: int
    payload: Any


class EngineStats(NamedTuple):
    """Event: a snapshot of the engine's gauges and counters (tokens, requests)."""

    time: float  # time.time() of the snapshot
    running: int
    waiting: int
    kv_used_tokens: int  # held by live requests (owned or locked prefix)
    kv_cached_tokens: int  # evictable prefix cache
    kv_total_tokens: int
    prompt_tokens: int  # of admitted requests
    cached_tokens: int  # of those, served by the prefix cache
    retractions: int
    aborts: int
    finished: int
    queue_full: int  # requests refused by max_queued_requests
    checker_runs: int
    violations: int


Event = ReqOutput | Rejected | Accepted | Reply | EngineStats
Command = tuple[str, Any]  # ("add", AddRequest) | ("abort", rid) | ("rpc", (tag, name)) | ...


def _default_pool_tokens(config: Any, device: str, dtype: torch.dtype, context_len: int,
                         mem_fraction: float) -> int:
    """KV pool size in tokens: on CUDA what ``mem_fraction`` of the device memory leaves
    after the (already loaded) weights; on CPU four contexts, at least 65,536."""
    if not device.startswith("cuda"):
        return max(context_len * 4, 65536)
    free, total = torch.cuda.mem_get_info()
    budget = free - (1 - mem_fraction) * total
    per_token = (config.num_layers * 2 * config.num_kv_heads * config.head_dim
                 * torch.tensor([], dtype=dtype).element_size())
    tokens = int(budget // per_token)
    if tokens < context_len:
        raise RuntimeError(f"only {tokens} KV tokens fit in {mem_fraction:.0%} of the device "
                           f"memory; lower the context length or raise mem_fraction_static")
    return tokens


def parse_sampling(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """``SamplingParams`` from an object, a dict of its fields or None (defaults).
    Raises RequestRejected for unknown fields or bad values."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params.validate()
        return params
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(params) - names
    if unknown:
        raise RequestRejected(f"unknown sampling parameters: {sorted(unknown)}")
    values = dict(params)
    for key in ("stop_token_ids", "stop"):
        if key in values:
            v = values[key]
            values[key] = () if v is None else (v,) if isinstance(v, str | int) else tuple(v)
    sampling = SamplingParams(**values)
    sampling.validate()
    return sampling


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
        from transformers import AutoTokenizer

        from kvserve.model.init import default_model_dir
        from kvserve.model.loader import load_model
        from kvserve.model.runner import ModelRunner, make_pools

        model_path = args.model_path
        if model_path is None:
            model_path = default_model_dir()
            print(f"kvserve: using the tiny default model at {model_path} "
                  "(random weights: the text it writes is meaningless)", file=sys.stderr)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        leave_a_core_free(device)
        dtype = getattr(torch, args.dtype) if isinstance(args.dtype, str) else args.dtype
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model, config = load_model(model_path, device, dtype)
        context_len = args.context_len or min(config.max_position_embeddings, 8192)
        max_total_tokens = args.max_total_tokens or _default_pool_tokens(
            config, device, dtype, context_len, args.mem_fraction_static)
        pools = make_pools(config, max_total_tokens, args.page_size, args.max_running_requests,
                           context_len, device, dtype)
        self.runner = ModelRunner(model, config, pools, seed=args.seed,
                                  attention_backend=args.attention_backend,
                                  cuda_graph=False if args.disable_cuda_graph else None)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=args.page_size, context_len=context_len,
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                disable_radix_cache=args.disable_radix_cache,
                schedule_policy=args.schedule_policy,
                eos_token_ids=config.eos_token_ids, vocab_size=config.vocab_size,
                strict_checks=args.strict_checks,
            ),
            pools, self.runner,
        )
        self.scheduler.stop_string_matcher = self._match_stop
        self.model_path = str(model_path)
        self.context_len = context_len
        self.max_queued_requests = args.max_queued_requests
        self.queue_full = 0
        self._pending_checks: list[tuple[int, float]] = []  # (tag, deadline)

    # -- commands ------------------------------------------------------------------------
    def add(self, request: AddRequest) -> Rejected | Accepted:
        """Queue a request, or say why not (nothing is held for a refused one)."""
        bound = self.max_queued_requests
        try:
            if bound is not None and len(self.scheduler.waiting) >= bound:
                self.queue_full += 1
                raise QueueFull(f"the waiting queue is full ({bound} requests); retry later")
            self.scheduler.add_request(request.input_ids, request.sampling, rid=request.rid)
        except RequestRejected as err:
            return Rejected(request.rid, str(err), isinstance(err, QueueFull))
        return Accepted(request.rid)

    def handle(self, command: Command) -> Event | None:
        name, arg = command
        if name == "add":
            return self.add(arg)
        if name == "abort":
            self.scheduler.abort_request(arg)
            return None
        if name == "rpc":
            tag, what = arg
            if what == "check":  # answered once idle, or at the deadline
                self._pending_checks.append((tag, time.monotonic() + 10.0))
                return None
            return Reply(tag, self.rpc(what))
        raise ValueError(f"unknown engine command {name!r}")

    def rpc(self, what: str) -> Any:
        """Synchronous queries: "stats", "flush_cache" (True when idle and flushed),
        "info". ("check" is answered by the loop once idle: see ``handle``.)"""
        if what == "stats":
            return self.stats()
        if what == "flush_cache":
            if not self.scheduler.is_idle:
                return False
            self.scheduler.tree_cache.reset()
            return True
        if what == "info":
            alloc = self.scheduler.pools.allocator
            return {"model_path": self.model_path, "context_len": self.context_len,
                    "model_type": self.runner.config.hf_config.model_type,
                    "architectures": [self.runner.config.architecture],
                    "max_total_num_tokens": alloc.size, "page_size": alloc.page_size,
                    "max_running_requests": self.scheduler.config.max_running_requests,
                    "max_queued_requests": self.max_queued_requests}
        raise ValueError(f"unknown engine query {what!r}")

    def check(self) -> dict[str, Any]:
        """The full invariant check now, as JSON-ready numbers per pool; ``idle`` says
        whether the engine was idle (only then must every pool be at its total)."""
        sched = self.scheduler
        report = sched.checker.check(sched.reqs.values(), sched.held_pages, full=True)
        alloc = sched.pools.allocator
        return {"ok": report.ok, "idle": sched.is_idle, "violations": report.violations,
                "pools": report.pools, "kv_total_tokens": alloc.size,
                "kv_available_tokens": alloc.available_size(),
                "kv_evictable_tokens": sched.tree_cache.evictable_size(),
                "live_requests": len(sched.reqs)}

    def stats(self) -> EngineStats:
        sched = self.scheduler
        alloc = sched.pools.allocator
        cached = sched.tree_cache.evictable_size()
        s = sched.stats
        return EngineStats(
            time.time(), len(sched.running) + (sched.chunked_req is not None),
            len(sched.waiting), alloc.size - alloc.available_size() - cached, cached,
            alloc.size, s.prompt_tokens, s.cached_tokens, s.retractions, s.aborts, s.finished,
            self.queue_full, s.checker_runs, s.violations)

    def abort_all(self, message: str) -> list[ReqOutput]:
        """Shutdown: release every live request through the scheduler's exit path."""
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort_request(rid, message)
        return self.scheduler.run_until_idle()

    # -- the loop --------------------------------------------------------------------------
    def run(self, recv: Callable[[float], list[Command]],
            deliver: Callable[[Sequence[Event]], None]) -> None:
        """The engine core loop, until a ("stop", message) command.

        ``recv(timeout_s)`` returns the commands that arrived (waiting up to
        ``timeout_s`` for the first; 0 = just look); ``deliver`` takes each step's
        events in order. The loop blocks only when idle; stats go out at most every
        ``_STATS_INTERVAL_S`` while busy, on becoming idle or busy, and after commands.
        """
        sched = self.scheduler
        last_stats = 0.0
        was_idle = True
        while True:
            events: list[Event] = []
            commands = recv(_IDLE_WAIT_S if sched.is_idle else 0.0)
            handled = bool(commands)  # e.g. a flush or an abort while idle: fresh stats
            for command in commands:
                if command[0] == "stop":
                    deliver(self.abort_all(command[1] or "engine shut down"))
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
        tail = str(self.tokenizer.decode(req.output_ids[-tail_tokens:],
                                         skip_special_tokens=True))
        return next((s for s in req.sampling.stop if s in tail), None)


class Engine:
    """An in-process engine over a local Hugging Face checkpoint: ``EngineCore.run`` in a
    background thread. Keyword arguments are ``EngineArgs`` fields (``model_path``,
    ``page_size``, ``chunked_prefill_size``, ``max_total_tokens``, ``device``, ...)."""

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        self.core = EngineCore(EngineArgs(model_path=model_path, **kwargs))
        self.runner = self.core.runner
        self.scheduler = self.core.scheduler
        self.tokenizer = self.core.tokenizer
        self.model_path = self.core.model_path
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._outboxes: dict[str, queue.Queue[ReqOutput | Exception]] = {}
        # rids whose reader left before the engine finished them: their outbox stays (outputs
        # dropped) until the engine's last output, so it never reaches a reuse of the rid
        self._orphans: set[str] = set()
        self._lock = threading.Lock()  # _outboxes / _orphans between callers and the loop
        self._rids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Run one request (a str or one id list) or many (a list of them) to completion.
        Raises RequestRejected for bad input (nothing is queued for it)."""
        single, requests = self._requests(prompt, input_ids)
        sampling = parse_sampling(sampling_params)
        rids = [self._submit(ids, sampling, rid if single else None) for ids in requests]
        try:
            results = [self._collect(r) for r in rids]
        except Exception:
            for other in rids:  # one was rejected: stop the rest instead of orphaning them
                self._leave(other)
            raise
        return results[0] if single else results

    def generate_stream(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> Generator[GenerateOutput, None, None]:  # close() it to walk away early
        """Yield a ``GenerateOutput`` per step that produced tokens; ``delta`` is the new
        text (incomplete UTF-8 held back); the last one has ``finish_reason`` set."""
        single, requests = self._requests(prompt, input_ids)
        if not single:
            raise RequestRejected("generate_stream takes one prompt")
        sampling = parse_sampling(sampling_params)
        rid = self._submit(requests[0], sampling, rid)
        yield from self._stream(rid, sampling.stop)

    def abort(self, rid: str) -> None:
        """Abort a request at any stage (no-op for an unknown or finished rid)."""
        self._inbox.put(("abort", rid))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop", None))
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request plumbing ---------------------------------------------------------------
    def _requests(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise RequestRejected("give exactly one of prompt or input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return True, [self.tokenizer.encode(prompt)]
            if not all(isinstance(p, str) for p in prompt):
                raise RequestRejected("prompt must be a string or a list of strings")
            return False, [self.tokenizer.encode(p) for p in prompt]
        if input_ids and all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            return True, [list(input_ids)]
        if input_ids and all(isinstance(t, list | tuple) for t in input_ids):
            return False, [list(t) for t in input_ids]
        raise RequestRejected("input_ids must be a non-empty list of ints or of int lists")

    def _submit(self, ids: list[int], sampling: SamplingParams, rid: str | None) -> str:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        rid = rid or f"gen-{next(self._rids)}"
        with self._lock:
            if rid in self._outboxes:
                raise RequestRejected(f"duplicate request id {rid!r}")
            self._outboxes[rid] = queue.Queue()
        self._inbox.put(("add", AddRequest(rid, ids, sampling)))
        return rid

    def _stream(self, rid: str, stops: Sequence[str] = ()) -> Iterator[GenerateOutput]:
        outbox = self._outboxes[rid]
        text = TextStream(self.tokenizer, stops)
        finished = False
        try:
            while not finished:
                item = outbox.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                reason = item.finished_reason
                finished = reason is not None
                delta = text.add(item.new_token_ids, finished,
                                 reason.matched_stop if reason else None)
                yield GenerateOutput(
                    rid, text.sent, list(text.ids), reason.kind.value if reason else None,
                    reason.message if reason else "", item.prompt_tokens, item.cached_tokens,
                    item.completion_tokens, delta,
                    list(item.output_logprobs) if item.output_logprobs is not None else None,
                )
        finally:
            if finished:
                self._outboxes.pop(rid, None)
            else:  # the reader walked away: stop the request
                self._leave(rid)

    def _leave(self, rid: str) -> None:
        """The reader of ``rid`` is gone before its end: abort it; the rid stays taken
        (an orphan) until the engine's last output for it, unless that came already."""
        with self._lock:
            box = self._outboxes.get(rid)
            if box is None:
                return
            done = False
            with contextlib.suppress(queue.Empty):
                while True:
                    item = box.get_nowait()
                    done = done or isinstance(item, Exception) or item.finished_reason is not None
            if done:
                del self._outboxes[rid]
                return
            self._orphans.add(rid)
        self.abort(rid)

    def _collect(self, rid: str) -> GenerateOutput:
        last = None
        for last in self._stream(rid):  # noqa: B007
            pass
        assert last is not None
        last.delta = ""
        return last

    # -- the engine core loop (background thread) ----------------------------------------
    def _recv(self, timeout_s: float) -> list[Command]:
        commands: list[Command] = []
        try:
            commands.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0
                            else self._inbox.get_nowait())
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            return commands

    def _deliver(self, events: Sequence[Event]) -> None:
        with self._lock:
            for event in events:
                if not isinstance(event, ReqOutput | Rejected):
                    continue
                box = self._outboxes.get(event.rid)
                if box is None:
                    continue
                if event.rid in self._orphans:  # nobody reads it: drop, free the rid at the end
                    if isinstance(event, Rejected) or event.finished_reason is not None:
                        self._orphans.discard(event.rid)
                        del self._outboxes[event.rid]
                    continue
                box.put(event if isinstance(event, ReqOutput) else RequestRejected(event.message))

    def _loop(self) -> None:
        try:
            self.core.run(self._recv, self._deliver)
        except BaseException as err:  # report to every waiting caller instead of hanging
            self._error = err
            with self._lock:  # a copy: readers pop their outbox as they finish
                boxes = list(self._outboxes.values())
            for box in boxes:
                box.put(RuntimeError(f"engine loop died: {err!r}"))
            raise
        with self._lock:
            boxes = list(self._outboxes.values())
        for box in boxes:
            box.put(RuntimeError("engine shut down"))


__all__ = ["Engine", "EngineArgs", "EngineCore", "GenerateOutput", "SamplingParams"]
