"""A request's KV resources: the ``ReqKV`` record, its allocation sites and its one exit.

Length ladder (tokens, DESIGN section 2)::

    0 <= protected_len <= committed_len <= allocated_len <= row width
    [0, protected_len)              cache-owned prefix, locked by the request
    [protected_len, committed_len)  owned by the request, valid KV
    [committed_len, allocated_len)  over-allocation (speculative drafts, page tail)

``ReqKV.page_ids[i]`` is the page holding positions ``[i*P, (i+1)*P)``; it
covers ``ceil(allocated_len / P)`` pages and mirrors the request's row of
``req_to_token`` (the checker compares the two). Only ``alloc_for_extend``,
``alloc_for_decode`` and ``alloc_for_spec_decode`` grow ``allocated_len``;
only ``release_kv_cache`` gives anything back. This module and ``cache``/``mem``
never import the scheduler: they see a request through ``KVOwner``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from kvserve.mem.pages import ceil_page, num_pages, slot_ids
from kvserve.mem.pools import MemoryPools

if TYPE_CHECKING:
    from kvserve.cache.base import BasePrefixCache, PrefixLock


@dataclass(slots=True, eq=False)
class ReqKV:
    """Everything one request holds of the pools. One per request, never None.

    Each predicate reads its own field: holding a row says nothing about
    holding KV, and Mamba slots may be held before any row exists.
    """

    row: int | None = None
    protected_len: int = 0
    committed_len: int = 0
    allocated_len: int = 0
    page_ids: list[int] = field(default_factory=list)
    mamba_slots: tuple[int, ...] = ()
    lock: PrefixLock | None = None

    @property
    def holds_row(self) -> bool:
        return self.row is not None

    @property
    def holds_kv(self) -> bool:
        return self.allocated_len > 0

    @property
    def holds_mamba(self) -> bool:
        return bool(self.mamba_slots)

    @property
    def holds_lock(self) -> bool:
        return self.lock is not None

    @property
    def holds_anything(self) -> bool:
        return self.holds_row or self.holds_kv or self.holds_mamba or self.holds_lock

    def owned_page_ids(self, page_size: int) -> list[int]:
        """Pages the request owns itself: those covering ``[protected_len, allocated_len)``."""
        return self.page_ids[self.protected_len // page_size :]

    def _clear(self) -> None:
        """Forget every handle and length together (called by release_kv_cache only)."""
        self.row = None
        self.protected_len = self.committed_len = self.allocated_len = 0
        self.page_ids = []
        self.mamba_slots = ()
        self.lock = None


class KVOwner(Protocol):
    """What ``kv``, ``cache`` and ``mem`` may know of a request."""

    rid: str
    kv: ReqKV
    extra_key: str | None

    @property
    def fill_ids(self) -> Sequence[int]:
        """Token ids of the sequence so far (prompt + output); KV exists for a prefix."""
        ...


class KVAllocError(RuntimeError):
    """An allocation site was called on a request in the wrong state."""


def extend_pages_needed(kv: ReqKV, start_len: int, extend_len: int, page_size: int) -> int:
    """New pages ``alloc_for_extend`` takes to cover ``[start_len, start_len + extend_len)``.

    ``start_len`` is the matched prefix for a request without a row (its prefix
    pages come from the cache), else ignored in favour of the pages already held.
    The scheduler's admission estimate calls this same function.
    """
    held = len(kv.page_ids) if kv.holds_row else num_pages(start_len, page_size)
    start = kv.committed_len if kv.holds_row else start_len
    return max(num_pages(start + extend_len, page_size) - held, 0)


def spec_reserve_tokens(num_steps: int, topk: int, num_draft_tokens: int) -> int:
    """SGLang's speculative over-allocation: ``2 * max(steps * topk, num_draft_tokens)``."""
    return 2 * max(num_steps * topk, num_draft_tokens)


def write_row(pools: MemoryPools, kv: ReqKV, start: int, end: int) -> None:
    """Copy the slot ids of positions ``[start, end)`` from ``kv.page_ids`` into the row."""
    if end > start and kv.row is not None:
        slots = slot_ids(kv.page_ids, pools.page_size, start, end)
        pools.req_to_token_pool.write(kv.row, start, slots)


def req_slot_ids(pools: MemoryPools, kv: ReqKV, start: int, end: int):
    """KV slot ids (int32 tensor) of positions ``[start, end)`` of this request."""
    return slot_ids(kv.page_ids, pools.page_size, start, end)


# -- allocation sites: the only code that moves allocated_len ---------------------------


def alloc_for_extend(req: KVOwner, tree_cache: BasePrefixCache, extend_len: int) -> bool:
    """Row (if not yet held) and pages for ``extend_len`` tokens after ``committed_len``.

    On the first extend the row is taken and filled with the locked prefix
    (``protected_len = committed_len = lock.prefix_len``). All or nothing:
    returns False and leaves the request as it was when a row or pages are
    short even after evicting from ``tree_cache``.
    """
    kv, pools = req.kv, tree_cache.pools
    if extend_len < 1:
        raise KVAllocError(f"extend_len must be >= 1, got {extend_len}")
    if kv.holds_row:
        return _grow(kv, tree_cache, kv.committed_len + extend_len)
    if kv.holds_kv:
        raise KVAllocError(f"request {req.rid} holds KV without a row")
    prefix_len = kv.lock.prefix_len if kv.lock is not None else 0
    if prefix_len + extend_len > pools.req_to_token_pool.row_width:
        return False
    row = _take_row(tree_cache)
    if row is None:
        return False
    prefix_pages = tree_cache.lock_page_ids(kv.lock) if kv.lock is not None else []
    need = extend_pages_needed(kv, prefix_len, extend_len, pools.page_size)
    pages = _take_pages(tree_cache, need)
    if pages is None:
        pools.req_to_token_pool.free(row)
        return False
    kv.row = row
    kv.page_ids = [*prefix_pages, *pages]
    kv.protected_len = kv.committed_len = kv.allocated_len = prefix_len
    write_row(pools, kv, 0, prefix_len)
    return _grow(kv, tree_cache, prefix_len + extend_len)


OwnerT = TypeVar("OwnerT", bound=KVOwner)


class DecodeAlloc(NamedTuple, Generic[OwnerT]):
    """Result of ``alloc_for_decode``, in batch order of the requests that got a slot."""

    out_cache_loc: list[int]  # slot of position committed_len
    positions: list[int]  # committed_len
    rows: list[int]  # req_pool_idx
    failed: list[OwnerT]  # requests that could not get a slot (nothing taken for them)


def alloc_for_decode(reqs: Sequence[OwnerT], tree_cache: BasePrefixCache
                     ) -> DecodeAlloc[OwnerT]:
    """A slot for each request's next token (position ``committed_len``).

    Batch-level, like SGLang's: a new page only where the position starts one,
    the row entries of the whole batch written in one indexed copy (rewriting an
    entry that over-allocation already set is harmless), and the slots returned
    as the batch's ``out_cache_loc``.
    """
    for req in reqs:  # refuse the whole batch before changing anything
        if req.kv.row is None:
            raise KVAllocError(f"decode of request {req.rid} without a row")
    pools = tree_cache.pools
    page_size = pools.page_size
    width = pools.req_to_token_pool.row_width
    out: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    flat: list[int] = []
    failed: list[OwnerT] = []
    for req in reqs:
        kv = req.kv
        pos = kv.committed_len
        page_ids = kv.page_ids
        if pos >= kv.allocated_len:
            if pos >= width:
                failed.append(req)
                continue
            if pos >= len(page_ids) * page_size:
                pages = _take_pages(tree_cache, 1)
                if pages is None:
                    failed.append(req)
                    continue
                page_ids.append(pages[0])
            kv.allocated_len = pos + 1
        row: int = kv.row  # type: ignore[assignment]  # checked above
        out.append(page_ids[pos // page_size] * page_size + pos % page_size)
        positions.append(pos)
        rows.append(row)
        flat.append(row * width + pos)
    pools.req_to_token_pool.write_flat(flat, out)
    return DecodeAlloc(out, positions, rows, failed)


def alloc_for_spec_decode(req: KVOwner, tree_cache: BasePrefixCache, reserve: int) -> bool:
    """Grow ``allocated_len`` to ``ceil_page(committed_len + reserve)`` before a
    speculative step (never shrinks). ``reserve`` from ``spec_reserve_tokens``."""
    kv = req.kv
    if not kv.holds_row:
        raise KVAllocError(f"speculative decode of request {req.rid} without a row")
    return _grow(kv, tree_cache, ceil_page(kv.committed_len + reserve, tree_cache.page_size))


def _grow(kv: ReqKV, tree_cache: BasePrefixCache, target_len: int) -> bool:
    """Raise ``allocated_len`` to ``target_len`` (no-op if already there); all or nothing."""
    if target_len <= kv.allocated_len:
        return True
    pools = tree_cache.pools
    if target_len > pools.req_to_token_pool.row_width:
        return False
    pages = _take_pages(tree_cache, num_pages(target_len, pools.page_size) - len(kv.page_ids))
    if pages is None:
        return False
    kv.page_ids += pages
    write_row(pools, kv, kv.allocated_len, target_len)
    kv.allocated_len = target_len
    return True


def make_room(tree_cache: BasePrefixCache, num_pages: int) -> bool:
    """Reclaim the shortfall of ``num_pages`` free pages (the cache's unlocked pages
    first, then idle sessions: ``BasePrefixCache.reclaim``); True when that many pages
    are free."""
    allocator = tree_cache.pools.allocator
    short = num_pages - allocator.available_pages()
    if short > 0:
        tree_cache.reclaim(short * allocator.page_size)
    return num_pages <= allocator.available_pages()


def _take_row(tree_cache: BasePrefixCache) -> int | None:
    """A free row of ``req_to_token``, reclaiming one from an idle session if none is."""
    rows = tree_cache.pools.req_to_token_pool
    row = rows.alloc()
    if row is None and tree_cache.reclaimables:
        tree_cache.reclaim(0, 1)
        row = rows.alloc()
    return row


def _take_pages(tree_cache: BasePrefixCache, count: int) -> list[int] | None:
    """``count`` free pages, evicting the shortfall from the cache first."""
    make_room(tree_cache, count)
    return tree_cache.pools.allocator.alloc_pages(count)


def commit_kv(req: KVOwner, num_tokens: int) -> None:
    """Mark ``num_tokens`` more positions as holding valid KV (after a forward)."""
    kv = req.kv
    if num_tokens < 0 or kv.committed_len + num_tokens > kv.allocated_len:
        raise KVAllocError(
            f"request {req.rid}: commit of {num_tokens} past allocated_len={kv.allocated_len} "
            f"(committed_len={kv.committed_len})"
        )
    kv.committed_len += num_tokens


def lock_prefix(req: KVOwner, tree_cache: BasePrefixCache, last_node: object) -> None:
    """Admission: lock the matched prefix ending at ``last_node`` for this request."""
    kv = req.kv
    if kv.holds_lock or kv.holds_row:
        raise KVAllocError(f"request {req.rid} already holds a lock or row")
    kv.lock = tree_cache.inc_lock_ref(last_node)


# -- between the turns of a streaming session -------------------------------------------


def trim_kv_tail(owner: KVOwner, tree_cache: BasePrefixCache) -> None:
    """Free the over-allocation ``[committed_len, allocated_len)`` beyond the page that
    holds the last committed position (speculative windows, a decode slot never used), so
    the record holds exactly its committed KV: ``allocated_len = committed_len``. A turn
    that ends with its KV kept for the next one (a streaming session) calls this; the
    pages go through the allocator (deferred while a batch is in flight)."""
    kv = owner.kv
    keep = num_pages(kv.committed_len, tree_cache.page_size)
    if keep < kv.protected_len // tree_cache.page_size:
        raise KVAllocError(f"{owner.rid}: committed_len {kv.committed_len} below the locked "
                           f"prefix {kv.protected_len}")
    tree_cache.pools.allocator.free(kv.page_ids[keep:])
    del kv.page_ids[keep:]
    kv.allocated_len = kv.committed_len


def move_kv(source: KVOwner, target: KVOwner) -> None:
    """Hand everything ``source`` holds to ``target``, which must hold nothing: the one
    record changes owner (it is never shared by two live owners) and ``source`` gets a
    fresh, empty one. Raises KVAllocError when ``target`` holds something."""
    if target.kv.holds_anything:
        raise KVAllocError(f"{target.rid} already holds KV; cannot take {source.rid}'s")
    target.kv, source.kv = source.kv, ReqKV()


# -- the one exit -----------------------------------------------------------------------


def release_kv_cache(req: KVOwner, tree_cache: BasePrefixCache, insert: bool) -> None:
    """Give back exactly what the request holds, whatever subset, then clear its record.

    With ``insert`` the committed full pages go to the cache
    (``cache_finished_req``); duplicates of pages the cache already had, the
    unaligned tail and ``[ceil_page(committed_len), allocated_len)`` are freed,
    each page once. Without it, every owned page is freed. Holding nothing is a
    no-op for any cache type, so a second call does nothing. Follows SGLang's
    ``release_kv_cache(req, tree_cache, is_insert)``.
    """
    kv = req.kv
    if not kv.holds_anything:
        return
    pools = tree_cache.pools
    if kv.mamba_slots:  # checked first, so an error leaves the record whole
        if pools.mamba_pool is None:
            raise KVAllocError(f"request {req.rid} holds Mamba slots but there is no Mamba pool")
        pools.mamba_pool.check_held(kv.mamba_slots)
    with pools.allocator.free_group():
        if kv.holds_kv and insert:
            tree_cache.cache_finished_req(req)
        else:
            pools.allocator.free(kv.owned_page_ids(pools.page_size))
            if kv.lock is not None:
                tree_cache.dec_lock_ref(kv.lock)
    if kv.row is not None:
        pools.req_to_token_pool.free(kv.row)
    if kv.mamba_slots and pools.mamba_pool is not None:
        pools.mamba_pool.free(kv.mamba_slots)
    kv._clear()
