"""A small driver of the KV resource layer for tests (no scheduler, no model).

``KVHarness`` owns real pools, a real prefix cache and a strict
``InvariantChecker``, and moves ``FakeReq`` objects through the same calls the
scheduler makes: admit (match capped at ``len(prompt) - 1``, lock), extend
(chunked or whole), decode, speculative decode, finish, abort, retract.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.cache.base import BasePrefixCache
from kvserve.cache.chunk import ChunkCache
from kvserve.cache.radix import RadixCache
from kvserve.kv import (
    ReqKV,
    alloc_for_decode,
    alloc_for_extend,
    alloc_for_spec_decode,
    commit_kv,
    lock_prefix,
    release_kv_cache,
)
from kvserve.mem.allocator import TokenToKVPoolAllocator
from kvserve.mem.mamba_pool import MambaPool
from kvserve.mem.pages import num_pages
from kvserve.mem.pools import MemoryPools
from kvserve.mem.req_to_token import ReqToTokenPool
from kvserve.sched.invariants import CheckReport, InvariantChecker
from kvserve.sched.state import ReqState


@dataclass(eq=False)
class FakeReq:
    """The parts of a request the KV layer and the checker read."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKV = field(default_factory=ReqKV)
    state: ReqState = ReqState.WAITING
    extra_key: str | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def kv_pages(self) -> int:
        """SGLang's scripted-runtime ``kv_pages``: pages covering ``allocated_len``."""
        return len(self.kv.page_ids)


class KVHarness:
    """Pools + cache + strict checker + a registry of live requests."""

    def __init__(
        self,
        page_size: int = 1,
        num_tokens: int = 256,
        num_rows: int = 8,
        context_len: int = 128,
        spec_reserve: int = 0,
        radix: bool = True,
        mamba_slots: int = 0,
        strict: bool = True,
    ) -> None:
        self.pools = MemoryPools(
            req_to_token_pool=ReqToTokenPool(num_rows, context_len, page_size, spec_reserve),
            allocator=TokenToKVPoolAllocator(num_tokens, page_size),
            mamba_pool=MambaPool(mamba_slots, 1, (2,), (2,)) if mamba_slots else None,
        )
        self.cache: BasePrefixCache = RadixCache(self.pools) if radix else ChunkCache(self.pools)
        self.checker = InvariantChecker(self.cache, strict=strict)
        self.live: dict[str, FakeReq] = {}
        self.held_pages: dict[str, list[int]] = {}
        self._ids = itertools.count()
        self._next_token = itertools.count(50_000)

    @property
    def page_size(self) -> int:
        return self.pools.page_size

    def check(self) -> CheckReport:
        return self.checker.check(self.live.values(), self.held_pages, full=True)

    def assert_idle_and_full(self) -> None:
        """No live request; every page is free or cached, every row and slot free."""
        report = self.check()
        assert not self.live
        alloc = self.pools.allocator
        assert alloc.available_size() + self.cache.evictable_size() == alloc.size, report
        assert self.cache.protected_size() == 0
        assert self.pools.req_to_token_pool.available_size() == self.pools.req_to_token_pool.size
        if self.pools.mamba_pool is not None:
            assert self.pools.mamba_pool.available_size() == self.pools.mamba_pool.size

    # -- lifecycle ------------------------------------------------------------------
    def new(self, prompt_ids: list[int], extra_key: str | None = None) -> FakeReq:
        req = FakeReq(f"r{next(self._ids)}", list(prompt_ids), extra_key=extra_key)
        self.live[req.rid] = req
        return req

    def start(self, prompt_ids: list[int], extra_key: str | None = None) -> FakeReq:
        """A new request admitted and prefilled in one go (running)."""
        req = self.new(prompt_ids, extra_key)
        self.admit(req)
        assert self.extend(req)
        return req

    def complete(self, prompt_ids: list[int], extra_key: str | None = None) -> FakeReq:
        """A request run through prefill and finished with insert (warms the cache)."""
        req = self.start(prompt_ids, extra_key)
        self.finish(req)
        return req

    def admit(self, req: FakeReq, mamba: int = 0) -> int:
        """Match (capped so one token is computed), lock, take Mamba slots; returns the
        matched prefix length in tokens."""
        match = self.cache.match_prefix(req.prompt_ids[:-1], req.extra_key)
        lock_prefix(req, self.cache, match.last_node)
        if mamba:
            assert self.pools.mamba_pool is not None
            slots = self.pools.mamba_pool.alloc(mamba)
            assert slots is not None
            req.kv.mamba_slots = tuple(slots)
        req.state = ReqState.ADMITTED
        return match.prefix_len

    def extend(self, req: FakeReq, max_tokens: int | None = None) -> bool:
        """One prefill chunk of up to ``max_tokens`` tokens, then the 'forward'.

        Returns False (request unchanged) when memory is short.
        """
        start = req.kv.committed_len if req.kv.holds_row else (
            req.kv.lock.prefix_len if req.kv.lock is not None else 0
        )
        remaining = len(req.fill_ids) - start
        chunk = remaining if max_tokens is None else min(max_tokens, remaining)
        if not alloc_for_extend(req, self.cache, chunk):
            return False
        commit_kv(req, chunk)
        if req.kv.committed_len < len(req.prompt_ids):
            req.state = ReqState.CHUNKED
            self.cache.cache_unfinished_req(req)
        else:
            req.state = ReqState.RUNNING
            if len(req.fill_ids) == req.kv.committed_len:
                req.output_ids.append(next(self._next_token))
        return True

    def decode(self, req: FakeReq) -> bool:
        """One decode step: a slot for the last sampled token, commit, sample the next."""
        if alloc_for_decode([req], self.cache).failed:
            return False
        commit_kv(req, 1)
        req.output_ids.append(next(self._next_token))
        return True

    def spec_decode(self, req: FakeReq, reserve: int, accepted: int) -> bool:
        """A speculative step: over-allocate ``reserve``, then commit ``accepted`` tokens
        (bonus included); the sampled tokens become outputs."""
        if not alloc_for_spec_decode(req, self.cache, reserve):
            return False
        accepted = min(accepted, req.kv.allocated_len - req.kv.committed_len)
        commit_kv(req, accepted)
        req.output_ids += [next(self._next_token) for _ in range(accepted)]
        return True

    def finish(self, req: FakeReq, insert: bool = True) -> None:
        release_kv_cache(req, self.cache, insert=insert)
        req.state = ReqState.FINISHED
        self.live.pop(req.rid, None)

    def retract(self, req: FakeReq) -> None:
        release_kv_cache(req, self.cache, insert=False)
        req.state = ReqState.WAITING

    def pages_owned(self, req: FakeReq) -> int:
        """Pages covering ``[protected_len, allocated_len)``."""
        return len(req.kv.owned_page_ids(self.page_size))

    def expected_pages(self, num_tokens: int) -> int:
        return num_pages(num_tokens, self.page_size)
