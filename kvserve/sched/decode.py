"""The decode side: the running batch, its memory check, retraction and decode slots.

One decode step (``schedule``)::

    _check_memory()     evict the step's page shortfall from the cache, else retract
                        (SGLang's order: fewest output tokens first, then longest prompt)
    alloc_for_decode    a slot per request (plain decode), or
    alloc_for_spec_decode  a speculative window each

The memory check counts pages with the allocation's rule: plain decode takes a page
where the next position starts one, speculation ``_pages_needed`` per request.
"""

from __future__ import annotations

from typing import NamedTuple

from kvserve.cache.base import BasePrefixCache
from kvserve.kv import DecodeAlloc, alloc_for_decode, alloc_for_spec_decode, make_room
from kvserve.mem.pages import ceil_page, num_pages
from kvserve.sched.config import SchedulerConfig
from kvserve.sched.exits import Exits
from kvserve.sched.policy import NewTokenRatio
from kvserve.sched.queues import ListQueue, QueueRegistry
from kvserve.sched.req import OOM_MESSAGE, FinishKind, FinishReason, Req
from kvserve.sched.state import ReqState

_RUNNING = frozenset({ReqState.RUNNING})


class DecodeWork(NamedTuple):
    """One decode step's requests (batch order) and, for plain decode, their slots."""

    reqs: list[Req]
    slots: DecodeAlloc[Req] | None  # None with speculation: windows are in each ReqKV


class DecodeManager:
    """Owns the ``running`` queue (requests that decode), registered with ``queues``."""

    def __init__(self, config: SchedulerConfig, tree_cache: BasePrefixCache,
                 ratio: NewTokenRatio, queues: QueueRegistry, exits: Exits) -> None:
        self.config = config
        self.tree_cache = tree_cache
        self.ratio = ratio
        self.exits = exits
        self.running = ListQueue("running", _RUNNING)
        queues.register(self.running)

    def add(self, req: Req) -> None:
        """``req`` finished its prefill and decodes from the next step."""
        self.running.append(req)

    def drop_finished(self) -> None:
        """Drop the requests that finished while their results were processed."""
        self.running.keep(_RUNNING)

    def schedule(self) -> DecodeWork | None:
        """Room and slots for one decode step of every running request; None when no
        request is left to decode."""
        running = self.running
        if not running:
            return None
        retracted = self._check_memory()
        spec = self.config.speculative
        slots = None
        if spec is None:
            slots = alloc_for_decode(running.reqs, self.tree_cache)
            failed = slots.failed
        else:
            failed = [r for r in running
                      if not alloc_for_spec_decode(r, self.tree_cache, spec.reserve)]
        for req in failed:  # the memory check covers these; retract if it ever misses
            running.remove(req)
            self.exits.retract(req)
        if not running:
            return None
        if not retracted and not failed:
            self.ratio.on_decode_step()
        if failed and slots is not None:  # rare: the slots of the requests that stayed
            slots = alloc_for_decode(running.reqs, self.tree_cache)
        return DecodeWork(list(running.reqs), slots)

    def _pages_needed(self, req: Req) -> int:
        """New pages ``req`` needs for one decode step (its speculative window)."""
        spec = self.config.speculative
        page_size = self.config.page_size
        kv = req.kv
        if spec is None:
            target = kv.committed_len + 1
        else:
            target = ceil_page(kv.committed_len + spec.reserve, page_size)
        return max(num_pages(target, page_size) - len(kv.page_ids), 0)

    def _check_memory(self) -> bool:
        """Make room for one decode step: evict the shortfall from the cache, then
        retract. Returns whether anything was retracted."""
        running = self.running
        if self.config.speculative is None:  # a page where the next position starts one
            page_size = self.config.page_size
            need = sum(1 for r in running if r.kv.committed_len >= len(r.kv.page_ids) * page_size)
        else:
            need = sum(self._pages_needed(r) for r in running)
        if make_room(self.tree_cache, need):
            return False
        order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)),
                       reverse=True)
        retracted = False
        # A victim's pages may go to the cache (its prompt was inserted after prefill):
        # evict again after each one before deciding another is needed (as SGLang).
        while not make_room(self.tree_cache, need):
            if len(running) == 1:
                last = running.reqs.pop()
                self.exits.finish(last, FinishReason(FinishKind.ABORT, OOM_MESSAGE), insert=False)
                break
            victim = order.pop()
            need -= self._pages_needed(victim)
            running.remove(victim)
            self.exits.retract(victim)
            retracted = True
        if retracted:
            self.ratio.on_retract(running.reqs)
        return retracted
