"""Admission: SGLang's ``PrefillAdder`` budget rules and ``new_token_ratio``.

Budget of one prefill step, in tokens (SGLang ``schedule_policy.py``)::

    rem_total = available + evictable - reservation
    reservation = sum over running of min(max_new - generated, 4096) * new_token_ratio
                + sum over requests admitted this step of extend_len + min(max_new, 4096)

A request is admitted when ``extend_len + min(max_new, 4096) + page_size`` fits in
``rem_total``, checked once, then again after its prefix is locked (locking turns
evictable tokens into protected ones). ``max_prefill_tokens``, the chunk budget,
free rows and ``max_running_requests`` bound the step too.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from kvserve.cache.base import BasePrefixCache
from kvserve.kv import extend_pages_needed, lock_prefix, release_kv_cache
from kvserve.mem.pages import floor_page
from kvserve.sched.req import CLIP_MAX_NEW_TOKENS, Req
from kvserve.sched.state import ReqState

RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    """How much of their remaining ``max_new_tokens`` running requests are expected
    to use: init 0.7 x conservativeness, floor 0.14 x init for the decay, linear decay
    to the floor over 600 decode steps, recomputed after a retraction (which may set it
    below the floor until decoding raises it back, as in SGLang), reset at idle."""

    DECAY_STEPS = 600

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(0.7 * schedule_conservativeness, 1.0)
        self.min = min(self.init * 0.14, 1.0)
        self.decay = (self.init - self.min) / self.DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, running: Sequence[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.max_output_len for r in running)  # context-capped, as admission
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / (max_new + 1))

    def reset(self) -> None:
        self.value = self.init


def remaining_new_tokens(req: Req) -> int:
    """Tokens the request may still generate: ``max_new_tokens`` capped by the context
    limit (``Req.max_output_len``), less what it generated, clipped to 4096 (SGLang)."""
    return min(max(req.max_output_len - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


class PrefixSource(Protocol):
    """How admission takes a request's matched prefix: lock it in the tree
    (``TreePrefix``), or take over a session slot's KV (``SessionManager``)."""

    def acquire(self, req: Req) -> None:
        """Hold the prefix ``req.match_node`` names (admission)."""
        ...

    def give_back(self, req: Req) -> None:
        """Undo ``acquire`` (the request does not fit after all); nothing is allocated yet."""
        ...


class TreePrefix:
    """The prefix cache's own: ``lock_prefix`` on the matched node; undone by releasing."""

    def __init__(self, tree_cache: BasePrefixCache) -> None:
        self.tree_cache = tree_cache

    def acquire(self, req: Req) -> None:
        lock_prefix(req, self.tree_cache, req.match_node)

    def give_back(self, req: Req) -> None:
        release_kv_cache(req, self.tree_cache, insert=False)


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # memory budget exhausted
    OTHER = "other"  # another bound (prefill tokens, chunk, rows, running requests)


class PrefillAdder:
    """Chooses the requests of one prefill batch within the step's budgets."""

    def __init__(
        self,
        tree_cache: BasePrefixCache,
        running: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_new_requests: int,
        prefix: PrefixSource | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        self.prefix = prefix or TreePrefix(tree_cache)
        # what other sources (idle sessions) could give back; taken again after each
        # acquire, which may take over a slot or lock a prefix a slot locks too
        self.reclaimable = self._reclaimable()
        self.page_size = tree_cache.page_size
        # tokens held back for what running requests will still decode (a float, as SGLang)
        self.offset: float = sum(remaining_new_tokens(r) * new_token_ratio for r in running)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.new_slots = max_new_requests
        self.idle = not running
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def _reclaimable(self) -> int:
        return sum(r.reclaimable_tokens() for r in self.tree_cache.reclaimables)

    @property
    def rem_total_tokens(self) -> float:
        pools = self.tree_cache.pools
        return (pools.allocator.available_size() + self.tree_cache.evictable_size()
                + self.reclaimable - self.offset)

    def _real_tokens(self, req: Req, extend_len: int) -> int:
        """Tokens of new pages ``alloc_for_extend`` will take: the same function it calls."""
        pages = extend_pages_needed(req.kv, req.match_len, extend_len, self.page_size)
        return pages * self.page_size

    def _fits_memory(self, req: Req, extend_len: int) -> bool:
        """SGLang's estimate; an idle engine drops the output reservation of the first
        request so a long prompt can always start (the real need always fits)."""
        if self.idle and not self.can_run:
            return self._real_tokens(req, extend_len) <= self.rem_total_tokens
        estimate = extend_len + remaining_new_tokens(req) + self.page_size
        return estimate <= self.rem_total_tokens

    def add_chunked_req(self, req: Req) -> bool:
        """The request mid chunked prefill goes first; its next chunk is page aligned.
        False (nothing reserved) when even that chunk's pages do not fit now."""
        remaining = req.seq_len - req.kv.committed_len
        chunk = self.rem_chunk_tokens
        if chunk is None or remaining <= chunk:
            extend = remaining
        else:
            extend = floor_page(chunk, self.page_size)
        if self._real_tokens(req, extend) > self.rem_total_tokens:
            return False
        req.extend_len = extend
        self._spend(req, extend, remaining)
        self.can_run.append(req)
        if extend < remaining:
            self.new_chunked_req = req
        self.idle = False
        return True

    def add_one_req(self, req: Req, rows_free: int) -> AddResult:
        """Admit ``req`` (lock its matched prefix) if every budget allows."""
        extend_len = req.seq_len - req.match_len
        if self.new_slots <= 0 or rows_free <= 0:
            return AddResult.OTHER
        if not self._fits_memory(req, extend_len):
            return AddResult.NO_TOKEN
        if extend_len > self.rem_input_tokens and self.can_run:
            return AddResult.OTHER
        chunk = self.rem_chunk_tokens
        if chunk is not None and extend_len > chunk and floor_page(chunk, self.page_size) <= 0:
            return AddResult.OTHER
        self.prefix.acquire(req)
        if self.reclaimable:  # acquiring only ever lowers it
            self.reclaimable = self._reclaimable()
        kv = req.kv
        if kv.holds_row:  # a session slot's KV, taken over whole
            held = kv.committed_len
        else:
            held = kv.lock.prefix_len if kv.lock is not None else 0
        if held != req.match_len:  # a stale match: go by what is really held
            req.match_len = held
            extend_len = req.seq_len - held
        if not self._fits_memory(req, extend_len):  # the lock made part of evictable protected
            self.prefix.give_back(req)
            self.reclaimable = self._reclaimable()
            return AddResult.NO_TOKEN
        if chunk is None or extend_len <= chunk:
            req.extend_len = extend_len
        else:
            req.extend_len = floor_page(chunk, self.page_size)
            self.new_chunked_req = req
        self._spend(req, req.extend_len, extend_len)
        req.state = ReqState.ADMITTED
        self.can_run.append(req)
        self.new_slots -= 1
        if self.new_chunked_req is not None or self.rem_input_tokens <= 0:
            return AddResult.OTHER
        if chunk is not None and self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        return AddResult.CONTINUE

    def _spend(self, req: Req, extend_len: int, remaining_prompt: int) -> None:
        # Reserve this chunk's real pages, the rest of the prompt and the output.
        real = self._real_tokens(req, extend_len)
        self.offset += real + remaining_prompt - extend_len + remaining_new_tokens(req)
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
