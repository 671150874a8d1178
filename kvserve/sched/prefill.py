"""The prefill side: the waiting queue, prefix matching, admission and the chunked request.

One prefill step::

    admit(running)      match waiting requests, run the PrefillAdder, lock prefixes
    (on_admitted hook)  the scheduler's, between admission and allocation
    allocate(can_run)   row + pages for each request's chunk (all or nothing each)

A request whose allocation misses after admission, or that was aborted since, leaves
through the scheduler's exits; nothing here frees memory itself.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

from kvserve.cache.base import BasePrefixCache
from kvserve.kv import alloc_for_extend
from kvserve.sched.config import SchedulerConfig
from kvserve.sched.exits import Exits
from kvserve.sched.policy import AddResult, NewTokenRatio, PrefillAdder, PrefixSource, TreePrefix
from kvserve.sched.queues import ListQueue, QueueRegistry, SlotQueue
from kvserve.sched.req import Req
from kvserve.sched.state import ReqState

logger = logging.getLogger(__name__)

LPM_FALLBACK_QUEUE_LEN = 128  # lpm acts as fcfs above this many waiting (SGLang)


class SessionMatcher(PrefixSource, Protocol):
    """What admission needs of the session manager: a slot match, then acquire."""

    def match(self, req: Req) -> bool: ...


class Admission(NamedTuple):
    """One step's admission: ``can_run`` in batch order (the chunked request first),
    ``admitted`` the requests that left the waiting queue this step."""

    can_run: list[Req]
    admitted: list[Req]


class PrefillManager:
    """Owns the ``waiting`` queue and the ``chunked`` slot (the request mid chunked
    prefill, at most one); both are registered with ``queues``.

    Args:
        config: the scheduler's config (policy, budgets, chunk size).
        tree_cache: the prefix cache requests are matched against and locked in.
        ratio: the shared ``new_token_ratio`` (read for the running reservation).
        queues: the scheduler's registry.
        exits: the scheduler's exits.
        sessions: matches and takes over a session turn's slot (``SessionManager``);
            None: every request matches the tree.
    """

    def __init__(self, config: SchedulerConfig, tree_cache: BasePrefixCache, ratio: NewTokenRatio,
                 queues: QueueRegistry, exits: Exits, sessions: SessionMatcher | None = None
                 ) -> None:
        self.config = config
        self.sessions = sessions
        self.prefix: PrefixSource = sessions if sessions is not None else TreePrefix(tree_cache)
        self.tree_cache = tree_cache
        self.ratio = ratio
        self.exits = exits
        self.waiting = ListQueue("waiting", (ReqState.WAITING, ReqState.RETRACTED))
        self.chunked = SlotQueue("chunked", (ReqState.CHUNKED,))
        queues.register(self.waiting)
        queues.register(self.chunked)

    @property
    def chunked_req(self) -> Req | None:
        return self.chunked.req

    def forget(self, req: Req) -> None:
        """``req`` leaves through an exit: it is no longer the chunked request."""
        if self.chunked.req is req:
            self.chunked.req = None

    def process_pending_chunked_abort(self) -> None:
        """Release the chunked request if it was aborted since the last step (never
        mid-step: its KV may be in the batch being computed)."""
        req = self.chunked.req
        if req is not None and req.to_finish is not None:
            self.exits.finish(req, req.to_finish, insert=True)

    # -- admission ------------------------------------------------------------------
    def admit(self, running: ListQueue, rows_free: int) -> Admission | None:
        """Choose this step's prefill requests within every budget (SGLang's rules,
        ``PrefillAdder``); their prefixes are locked. None when no prefill can start."""
        cfg = self.config
        chunked = self.chunked.req
        if chunked is None and not self.waiting:
            return None
        if chunked is None and len(running) >= cfg.max_running_requests:
            return None
        adder = PrefillAdder(
            self.tree_cache, running.reqs, self.ratio.value, cfg.max_prefill_tokens,
            cfg.chunk_size, cfg.max_running_requests - len(running) - (chunked is not None),
            self.prefix,
        )
        if chunked is not None and not adder.add_chunked_req(chunked):
            return None  # its next chunk does not fit yet: decode frees memory first
        match_each = not self._match_waiting()
        for req in self.waiting:
            if match_each:
                self._match(req)
            result = adder.add_one_req(req, rows_free)
            if req.state is ReqState.ADMITTED:
                rows_free -= 1
            if result is not AddResult.CONTINUE:
                break
        admitted = [r for r in adder.can_run if r is not chunked]
        if admitted:
            self.waiting.keep(self.waiting.states)
            for req in admitted:
                req.admissions += 1
                if req.admissions == 1:
                    req.cached_tokens = req.match_len
        self.chunked.req = adder.new_chunked_req
        return Admission(adder.can_run, admitted)

    def _match_waiting(self) -> bool:
        """``lpm``: match every waiting request and order by longest match; True when
        done. ``fcfs``, or ``lpm`` with more than ``LPM_FALLBACK_QUEUE_LEN`` waiting (as
        SGLang, so matching stays cheap under a long queue): False, and requests are
        matched one by one as the adder reaches them."""
        waiting = self.waiting
        if self.config.schedule_policy != "lpm" or len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            return False
        for req in waiting:
            self._match(req)
        waiting.reqs.sort(key=lambda r: -r.match_len)
        return True

    def _match(self, req: Req) -> None:
        """Prefix match without a lock, capped so at least one token is computed; a
        session turn whose slot holds its context's prefix matches the slot instead."""
        if req.session is not None and self.sessions is not None and self.sessions.match(req):
            return
        fill = req.fill_ids
        match = self.tree_cache.match_prefix(fill[: len(fill) - 1], req.extra_key)
        req.match_len, req.match_node = match.prefix_len, match.last_node

    # -- allocation -----------------------------------------------------------------
    def allocate(self, can_run: list[Req]) -> list[Req]:
        """Row + pages for each request's chunk; returns those that run this step.
        A request aborted since admission finishes; one whose allocation misses (the
        admission estimate covers it, so this is rare) is retracted."""
        reqs = []
        for req in can_run:
            if req.to_finish is not None:  # aborted after admission, before its extend
                self.exits.finish(req, req.to_finish, insert=True)
            elif not alloc_for_extend(req, self.tree_cache, req.extend_len):
                logger.warning("extend allocation of %s missed after admission", req.rid)
                self.exits.retract(req)
            else:
                done = req.kv.committed_len + req.extend_len >= req.seq_len
                req.state = ReqState.RUNNING if done else ReqState.CHUNKED
                reqs.append(req)
        return reqs

