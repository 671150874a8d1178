"""The scheduler: continuous batching, chunked prefill, retraction and aborts.

One step (SGLang's event loop, kept in the shape overlap scheduling needs)::

    prefill.process_pending_chunked_abort()  an aborted chunked request, never mid-step
    batch = get_next_batch_to_run()          prefill if one can be formed, else decode
    model.forward(batch.forward_batch)
    results.process(batch, result)           commit KV, append tokens, finish, cache
    tree_cache.release_deferred(batch_id)    frees made while the batch was in flight
    checker                                  strict after every step, or at idle

The managers own the queues (``PrefillManager``: waiting + chunked; ``DecodeManager``:
running) and register them with the ``QueueRegistry`` the checker walks. Every exit of
a request (finish, abort in any queue, retraction, out of memory) goes through this
class's ``finish`` / ``retract``, and so through ``release_kv_cache``.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.factory import make_prefix_cache, prefix_cache_kind
from kvserve.forward import ForwardMode, ModelOutput, ModelRunnerLike
from kvserve.kv import release_kv_cache
from kvserve.mem.pools import MemoryPools
from kvserve.sched.batch import BatchBuilder, ScheduleBatch
from kvserve.sched.config import ConfigError, SchedulerConfig, SpecConfig
from kvserve.sched.decode import DecodeManager
from kvserve.sched.invariants import CheckReport, InvariantChecker, InvariantViolation
from kvserve.sched.output import ReqOutput, ResultProcessor
from kvserve.sched.policy import NewTokenRatio
from kvserve.sched.prefill import LPM_FALLBACK_QUEUE_LEN, PrefillManager
from kvserve.sched.queues import QueueRegistry
from kvserve.sched.req import FinishKind, FinishReason, Req, RequestRejected, SamplingParams
from kvserve.sched.session import SessionManager, SessionParams
from kvserve.sched.state import ReqState

logger = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1

__all__ = [
    "LPM_FALLBACK_QUEUE_LEN",
    "AbortStatus",
    "ConfigError",
    "ReqOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulerStuck",
    "SpecConfig",
]


class SchedulerStuck(RuntimeError):
    """``run_until_idle`` saw steps stop making progress, or ran out of steps."""


class AbortStatus(enum.Enum):
    ABORTED = "aborted"  # released now
    PENDING = "pending"  # released when the running step's results (or next step) are processed
    NOT_FOUND = "not found"  # unknown or already finished: nothing done


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    retractions: int = 0
    aborts: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sched_seconds: list[float] = field(default_factory=list)
    model_seconds: list[float] = field(default_factory=list)
    checker_seconds: list[float] = field(default_factory=list)
    checker_runs: int = 0
    violations: int = 0  # checker runs that found at least one violation
    decode_step: list[bool] = field(default_factory=list)


class Scheduler:
    """Continuous batching over the pools, with the checker as its witness.

    Args:
        config: limits and policies (validated here; ConfigError on bad values).
        pools: rows, KV allocator (and buffers) the model reads.
        model: anything with ``forward(ForwardBatch) -> ModelOutput``.
    """

    def __init__(self, config: SchedulerConfig, pools: MemoryPools, model: ModelRunnerLike,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        if pools.page_size != config.page_size:
            raise ConfigError(f"pool page size {pools.page_size} != config {config.page_size}")
        self.config = config
        self.pools = pools
        self.model = model
        self.tree_cache = make_prefix_cache(pools, prefix_cache_kind(config.disable_radix_cache))
        self.checker = InvariantChecker(self.tree_cache, strict=config.strict_checks)
        self.queues = QueueRegistry()
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.sessions = SessionManager(self.tree_cache, self._release_owner, clock,
                                       config.session_timeout)
        self.prefill = PrefillManager(config, self.tree_cache, self.ratio, self.queues, self,
                                      self.sessions)
        self.decode = DecodeManager(config, self.tree_cache, self.ratio, self.queues, self)
        self.builder = BatchBuilder(pools, config.speculative,
                                    bool(getattr(model, "uses_sampling_params", False)))
        self._outputs: list[ReqOutput] = []
        self.results = ResultProcessor(config, self.tree_cache, self.decode, self,
                                       self._outputs)
        self.reqs: dict[str, Req] = {}
        self.held_pages: dict[str, list[int]] = {}
        self.stats = SchedulerStats()
        self.last_report: CheckReport | None = None
        self.on_admitted: Callable[[list[Req]], None] | None = None
        self.on_launch: Callable[[ScheduleBatch], None] | None = None
        self._arrivals = itertools.count()
        self._rids = itertools.count()
        self._inflight: ScheduleBatch | None = None
        self._retracted: list[Req] = []  # this step's, re-queued together at its end
        self._checked_idle = True

    # -- views of the managers' queues ----------------------------------------------
    @property
    def waiting(self) -> list[Req]:
        return self.prefill.waiting.reqs

    @property
    def running(self) -> list[Req]:
        return self.decode.running.reqs

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    @property
    def stop_string_matcher(self) -> Callable[[Req], str | None] | None:
        """req -> the stop string its output now ends with, if any. Set by the engine,
        which owns the tokenizer (checked after every appended token)."""
        return self.results.stop_string_matcher

    @stop_string_matcher.setter
    def stop_string_matcher(self, matcher: Callable[[Req], str | None] | None) -> None:
        self.results.stop_string_matcher = matcher

    # -- requests in and out ---------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        extra_key: str | None = None,
        session_params: SessionParams | dict[str, Any] | None = None,
    ) -> Req:
        """Queue a request. Raises RequestRejected (holding nothing) for a duplicate
        rid, an empty prompt, a prompt longer than ``context_len - 1`` or than the
        whole KV pool, token ids outside int32, or bad sampling limits.

        With ``session_params`` (``sched.session.SessionParams`` or its JSON object) the
        request is a turn of a streaming session: ``prompt_ids`` are the new tokens and
        the prompt becomes the turn's context (``SessionManager.context_for``); a refused
        turn (SessionError, a RequestRejected) leaves the session as it was."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        if rid in self.reqs:
            raise RequestRejected(f"duplicate request id {rid!r}")
        prompt = list(prompt_ids)
        if not prompt:
            raise RequestRejected("empty prompt")
        params = None
        if session_params is not None:
            params = SessionParams.parse(session_params)
            prompt = self.sessions.context_for(params, prompt)
        limit = self.config.context_len - 1
        if len(prompt) > limit:
            raise RequestRejected(f"prompt of {len(prompt)} tokens is longer than the context "
                                  f"limit of {limit} (context_len - 1)")
        if len(prompt) > self.pools.allocator.size:
            raise RequestRejected(f"prompt of {len(prompt)} tokens exceeds the KV pool of "
                                  f"{self.pools.allocator.size} tokens")
        vocab = self.config.vocab_size
        limit = _INT32_MAX if vocab is None else vocab - 1
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= limit
               for t in prompt):
            bound = "2**31 - 1" if vocab is None else f"{limit} (the vocabulary size is {vocab})"
            raise RequestRejected(f"token ids must be integers in [0, {bound}]")
        req = Req(rid, prompt, sampling, extra_key, arrival=next(self._arrivals))
        req.max_output_len = min(sampling.max_new_tokens, self.config.context_len - len(prompt))
        # decode's fast path (no finish possible) applies below this output length
        req.fast_path_outputs = 0 if sampling.stop else req.max_output_len - 1
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops.update(self.config.eos_token_ids)
        # ids the model cannot sample never match; kept out, they would index past the
        # logits when min_new_tokens masks the stops
        req.stop_ids = frozenset(t for t in stops if t <= limit)
        self.reqs[rid] = req
        self.prefill.waiting.append(req)
        if params is not None:
            self.sessions.attach(req, params, self.abort_request)
        return req

    # -- streaming sessions (sched.session) ------------------------------------------
    def open_session(self, session_id: str | None = None,
                     capacity_of_str_len: int | None = None) -> str:
        """Open a streaming session; returns its id (``SessionManager.open``)."""
        return self.sessions.open(session_id, capacity_of_str_len)

    def close_session(self, session_id: str) -> bool:
        """Close a session now, or at the end of its turn in flight; False if unknown."""
        return self.sessions.close(session_id)

    def abort_request(self, rid: str, message: str = "aborted by request") -> AbortStatus:
        """Abort at any stage. Waiting: released now. Admitted, chunked or running:
        ``to_finish`` is set and the request is released when the step's results are
        processed (the chunked one by ``process_pending_chunked_abort``)."""
        req = self.reqs.get(rid)
        if req is None:
            return AbortStatus.NOT_FOUND
        reason = FinishReason(FinishKind.ABORT, message)
        if req.state in (ReqState.WAITING, ReqState.RETRACTED):
            self.prefill.waiting.remove(req)
            self.finish(req, reason, insert=False)
            return AbortStatus.ABORTED
        req.to_finish = reason
        return AbortStatus.PENDING

    @property
    def is_idle(self) -> bool:
        return not self.reqs

    # -- the step -------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One scheduler iteration; returns what each touched request produced."""
        start = time.perf_counter()
        model_seconds = 0.0
        self.prefill.process_pending_chunked_abort()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self._inflight = batch
            if self.on_launch is not None:
                self.on_launch(batch)
            t0 = time.perf_counter()
            result = self.model.forward(batch.forward_batch)
            model_seconds = time.perf_counter() - t0
            self.process_batch_result(batch, result)
            self._inflight = None
            self.tree_cache.release_deferred(batch.batch_id)
        elif not self.running and self.chunked_req is None:
            self.ratio.reset()
        stats = self.stats
        stats.steps += 1
        stats.sched_seconds.append(time.perf_counter() - start - model_seconds)
        stats.model_seconds.append(model_seconds)
        stats.decode_step.append(batch is not None and batch.forward_mode is ForwardMode.DECODE)
        stats.checker_seconds.append(self._run_checker())
        return self.take_outputs()

    def take_outputs(self) -> list[ReqOutput]:
        """Outputs produced since the last call (``step`` returns them too; an abort of a
        waiting request between steps produces one without a step)."""
        outputs = self._outputs[:]
        self._outputs.clear()
        return outputs

    def run_until_idle(self, max_steps: int = 100_000) -> list[ReqOutput]:
        """Step until no request is live. Raises SchedulerStuck when a step changes
        nothing while requests wait (nothing else could change it) or after
        ``max_steps`` steps."""
        outputs: list[ReqOutput] = self.take_outputs()  # e.g. an abort made while waiting
        for _ in range(max_steps):
            if self.is_idle:
                return outputs
            before = self._progress_marker()
            outputs += self.step()
            if self._progress_marker() == before:
                raise SchedulerStuck(f"no progress with {len(self.reqs)} live requests:\n"
                                     f"{self.check(full=False)}")
        if not self.is_idle:
            raise SchedulerStuck(f"{len(self.reqs)} requests still live after {max_steps} steps")
        return outputs

    def _progress_marker(self) -> tuple[int, ...]:
        return (
            len(self.reqs),
            sum(r.seq_len + r.kv.committed_len for r in self.reqs.values()),
            self.stats.retractions,
            self.stats.prefill_batches,
        )

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill batch if one can be formed, else a decode batch, else None. The
        step's retracted requests go back to the waiting queue's head together."""
        batch = self.get_new_batch_prefill() or self.get_decode_batch()
        if self._retracted:
            self.prefill.waiting.push_front(self._retracted)
            self._retracted = []
        return batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        rows_free = self.pools.req_to_token_pool.available_size()
        if self.prefill.waiting:  # idle sessions' rows count only when someone may take them
            rows_free += self.tree_cache.reclaimable_rows()
        admission = self.prefill.admit(self.decode.running, rows_free)
        if admission is None:
            return None
        if admission.admitted:
            for req in admission.admitted:
                if req.admissions == 1:
                    self.stats.prompt_tokens += len(req.prompt_ids)
                    self.stats.cached_tokens += req.match_len
            if self.on_admitted is not None:
                self.on_admitted(admission.admitted)
        reqs = self.prefill.allocate(admission.can_run)
        if not reqs:
            return None
        self.stats.prefill_batches += 1
        return self.builder.extend(reqs)

    def get_decode_batch(self) -> ScheduleBatch | None:
        work = self.decode.schedule()
        if work is None:
            return None
        self.stats.decode_batches += 1
        if work.slots is None:
            return self.builder.spec_decode(work.reqs)
        return self.builder.decode(work.reqs, work.slots)

    def process_batch_result(self, batch: ScheduleBatch, result: ModelOutput) -> None:
        """Apply the model's result to ``batch`` (``ResultProcessor.process``)."""
        finished_before = self.stats.finished
        self.results.process(batch, result)
        if self.stats.finished != finished_before:
            self.decode.drop_finished()

    # -- exits ----------------------------------------------------------------------
    @contextmanager
    def _deferral(self) -> Iterator[None]:
        """Frees inside wait for the in-flight batch if there is one (rule 7)."""
        batch = self._inflight
        with nullcontext() if batch is None else self.tree_cache.deferring(batch.batch_id):
            yield

    def _release(self, req: Req, insert: bool) -> None:
        """The one exit (``release_kv_cache``), deferred while a batch is in flight."""
        self.prefill.forget(req)
        with self._deferral():
            release_kv_cache(req, self.tree_cache, insert=insert)

    def _release_owner(self, owner: Any, insert: bool) -> None:
        """``release_kv_cache`` for a session slot, deferred like a request's."""
        with self._deferral():
            release_kv_cache(owner, self.tree_cache, insert=insert)

    def finish(
        self, req: Req, reason: FinishReason, insert: bool, new_tokens: list[int] | None = None
    ) -> None:
        """Release what ``req`` holds and end it with ``reason`` (``Exits.finish``); a
        session turn's KV may move to its session instead (``SessionManager.end_turn``)."""
        if req.session is None:
            self._release(req, insert)
        else:
            self.prefill.forget(req)
            with self._deferral():
                self.sessions.end_turn(req, reason, insert)
        req.state = ReqState.FINISHED
        req.finished_reason = reason
        req.to_finish = None
        self.reqs.pop(req.rid, None)
        self.stats.finished += 1
        if reason.kind is FinishKind.ABORT:
            self.stats.aborts += 1
        self.emit(req, new_tokens or [])

    def retract(self, req: Req) -> None:
        """Back to waiting holding nothing (``Exits.retract``); its context is recomputed
        on readmission. Re-queued at the end of scheduling, with the step's others."""
        self._release(req, insert=False)
        self.stats.retractions += 1
        if req.to_finish is not None:
            self.finish(req, req.to_finish, insert=False)
            return
        req.state = ReqState.RETRACTED
        self._retracted.append(req)

    def emit(self, req: Req, new_tokens: list[int]) -> None:
        logprobs = req.output_logprobs if req.sampling.return_logprob else None
        self._outputs.append(ReqOutput(req.rid, new_tokens, req.finished_reason,
                                       len(req.prompt_ids), req.cached_tokens,
                                       len(req.output_ids), logprobs))

    # -- checking -------------------------------------------------------------------
    def check(self, full: bool = True) -> CheckReport:
        """The invariant checker over every live request, held page and queue (raises
        InvariantViolation in strict mode)."""
        return self.checker.check(self.reqs.values(), self.held_pages, full=full,
                                  queues=self.queues, sessions=self.sessions.holders())

    def _run_checker(self) -> float:
        """Strict: every step. Otherwise once each time the engine becomes idle."""
        if not self.config.strict_checks:
            if not self.is_idle:
                self._checked_idle = False
                return 0.0
            if self._checked_idle:
                return 0.0
            self._checked_idle = True
        t0 = time.perf_counter()
        report = self.check()
        self.last_report = report
        self.stats.checker_runs += 1
        if not report.ok:
            self.stats.violations += 1
            logger.error("invariant check failed:\n%s", report)
            if self.config.raise_on_violation:
                raise InvariantViolation(report)
        return time.perf_counter() - t0
