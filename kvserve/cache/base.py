"""The prefix-cache interface (SGLang's ``BasePrefixCache``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kvserve.kv import KVOwner
from kvserve.mem.pools import MemoryPools


class MatchResult(NamedTuple):
    """Longest cached prefix of a key, in whole pages."""

    page_ids: array  # array('i'): one page id per matched page
    prefix_len: int  # tokens (a multiple of the page size)
    last_node: Any  # pass to inc_lock_ref to protect the prefix


class InsertResult(NamedTuple):
    prefix_len: int  # tokens of the key that were cached before this insert
    last_node: Any  # node ending exactly at the inserted key


@dataclass(slots=True, eq=False)
class PrefixLock:
    """Receipt of ``inc_lock_ref``: what to hand back to ``dec_lock_ref``, once.

    Each receipt is its own object (compared by identity): two requests that lock
    the same node hold two receipts, and spending one never touches the other's.
    """

    node: Any
    prefix_len: int  # tokens protected by the lock
    spent: bool = False  # handed back to dec_lock_ref already


class Reclaimable(Protocol):
    """Memory kept for later use that can be given back under pressure: the prefix
    cache's unlocked pages (``evict``) and idle streaming sessions (their held KV and
    rows). Admission budgets (``BasePrefixCache.reclaimable_size``) and the allocation
    sites (``BasePrefixCache.reclaim``) consult every source through this one interface.
    Sizes are in tokens; rows are rows of ``req_to_token``."""

    def reclaimable_tokens(self) -> int:
        """Tokens of KV that giving everything back would make free or evictable."""
        ...

    def reclaimable_rows(self) -> int:
        """Rows that giving everything back would free."""
        ...

    def reclaim(self, num_tokens: int, num_rows: int) -> None:
        """Give back, oldest first, until ``num_tokens`` tokens and ``num_rows`` rows are
        given back or nothing is left."""
        ...


class LockRefError(RuntimeError):
    """``dec_lock_ref`` on a node that is not locked."""


class SpentLockError(LockRefError):
    """``dec_lock_ref`` with a receipt that was handed back before."""


class BasePrefixCache(ABC):
    """Shares KV pages between requests with equal token prefixes.

    ``match_prefix`` never locks and never allocates; admission locks with
    ``inc_lock_ref``. Sizes are in tokens. The cache owns the pages it holds
    and frees them through ``pools.allocator`` when it evicts.
    """

    def __init__(self, pools: MemoryPools) -> None:
        self.pools = pools
        self._defer_batch: int | None = None
        self._deferred_locks: dict[int, list[PrefixLock]] = {}
        self.reclaimables: list[Reclaimable] = []

    # -- memory held elsewhere that may be given back (idle sessions) -------------------
    def register_reclaimable(self, source: Reclaimable) -> None:
        """Add ``source`` to what ``reclaim`` may take back after evicting from the cache."""
        self.reclaimables.append(source)

    def reclaimable_size(self) -> int:
        """Tokens that could be made available without touching a live request: the
        cache's evictable tokens plus every registered source's (the admission budget)."""
        return self.evictable_size() + sum(r.reclaimable_tokens() for r in self.reclaimables)

    def reclaimable_rows(self) -> int:
        return sum(r.reclaimable_rows() for r in self.reclaimables)

    def reclaim(self, num_tokens: int, num_rows: int = 0) -> None:
        """Make ``num_tokens`` more tokens available and ``num_rows`` rows free if
        possible: evict from the cache first (its pages are unused), then ask the
        registered sources, oldest first, evicting again what they hand to the cache."""
        allocator = self.pools.allocator
        want = allocator.available_size() + num_tokens
        rows = self.pools.req_to_token_pool
        want_rows = rows.available_size() + num_rows
        if num_tokens > 0:
            self.evict(num_tokens)
        for source in self.reclaimables:
            short = want - allocator.available_size()
            short_rows = want_rows - rows.available_size()
            if short <= 0 and short_rows <= 0:
                return
            source.reclaim(max(short, 0), max(short_rows, 0))
            short = want - allocator.available_size()
            if short > 0:
                self.evict(short)

    @property
    def page_size(self) -> int:
        return self.pools.allocator.page_size

    # -- rule 7: nothing an in-flight batch may read is freed before its results ----
    @contextmanager
    def deferring(self, batch_id: int) -> Iterator[None]:
        """Releases inside the block wait for ``release_deferred(batch_id)``: freed
        pages go to the allocator's deferred queue, unlocks are held back, and pages a
        finishing request hands to the cache stay locked until then."""
        outer, self._defer_batch = self._defer_batch, batch_id
        try:
            with self.pools.allocator.deferring(batch_id):
                yield
        finally:
            self._defer_batch = outer

    def release_deferred(self, batch_id: int) -> None:
        """The batch's results are processed: apply its held-back unlocks and frees."""
        for lock in self._deferred_locks.pop(batch_id, []):
            self._unlock(lock)
        self.pools.allocator.release_deferred(batch_id)

    def deferred_locks(self) -> list[PrefixLock]:
        """Locks held for in-flight batches (receipts the checker counts)."""
        return [lock for locks in self._deferred_locks.values() for lock in locks]

    def _hold_for_batch(self, lock: PrefixLock | None) -> None:
        if lock is not None and self._defer_batch is not None:
            self._deferred_locks.setdefault(self._defer_batch, []).append(lock)

    def dec_lock_ref(self, lock: PrefixLock) -> None:
        """Undo one ``inc_lock_ref`` (held back while deferring) and spend the receipt.

        Raises SpentLockError for a receipt already spent (even while another request
        still locks the node: the lock_ref it would take is that request's), and
        LockRefError when the node is not locked; either leaves every lock_ref as it was.
        """
        if lock.spent:
            raise SpentLockError(f"dec_lock_ref with a spent receipt: the lock on "
                                 f"{lock.node!r} ({lock.prefix_len} tokens) was released before")
        if self._defer_batch is not None:
            self._check_locked(lock)
            self._hold_for_batch(lock)
        else:
            self._unlock(lock)
        lock.spent = True

    def _check_locked(self, lock: PrefixLock) -> None:
        return None

    def _unlock(self, lock: PrefixLock) -> None:
        raise LockRefError(f"{type(self).__name__} hands out no locks")

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` (no lock, no allocation)."""

    @abstractmethod
    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], extra_key: str | None = None
    ) -> InsertResult:
        """Cache the full pages of ``token_ids`` held in ``page_ids`` (one id per page).

        Pages of the key that were already cached stay as they were; the caller
        frees its duplicates of them (``InsertResult.prefix_len`` says how many).
        """

    @abstractmethod
    def cache_unfinished_req(self, req: KVOwner) -> None:
        """Insert the committed full pages of a running request, point its row at
        the canonical cached pages, free its duplicates and move its lock."""

    @abstractmethod
    def cache_finished_req(self, req: KVOwner) -> None:
        """Release the pages and lock of a finishing request, inserting what it computed."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> PrefixLock | None:
        """Protect the path ending at ``node`` from eviction; None for an empty prefix."""

    def unlock_gain(self, locks: Sequence[PrefixLock]) -> int:
        """Tokens that would become evictable if every receipt in ``locks`` were handed
        back: the nodes on their paths that no other receipt locks (counted together, so
        a prefix two of them share counts once it is theirs alone); 0 for a cache
        without locks."""
        return 0

    @abstractmethod
    def lock_page_ids(self, lock: PrefixLock) -> list[int]:
        """Page ids of the prefix a lock protects, in order."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of unlocked cached KV if possible; returns tokens freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached and not locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens cached and locked by some request."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (returning its pages); only valid with no locks held."""

    def supports_mamba(self) -> bool:
        return False

    # -- for the invariant checker -------------------------------------------------
    @abstractmethod
    def cached_page_ids(self) -> Iterator[int]:
        """Every page id the cache owns."""

    @abstractmethod
    def lock_path_counts(self, locks: Sequence[PrefixLock]) -> list[str]:
        """Compare every node's lock_ref with the receipts given; returns problems."""

    @abstractmethod
    def verify(self) -> list[str]:
        """Structural self-check (sizes by recount, lock monotonicity, ...); returns problems."""


def duplicate_and_tail_pages(page_ids: Sequence[int], protected_pages: int,
                             cached_before_pages: int, inserted_pages: int) -> list[int]:
    """Pages a finishing request frees after inserting ``inserted_pages`` pages::

        [0, protected)        cache-owned, locked: not ours
        [protected, before)   duplicates of pages the cache already had: free
        [before, inserted)    now owned by the cache: keep
        [inserted, end)       unaligned tail and over-allocation: free
    """
    before = max(cached_before_pages, protected_pages)
    return [*page_ids[protected_pages:before], *page_ids[max(inserted_pages, before):]]
