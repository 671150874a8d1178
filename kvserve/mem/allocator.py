"""Paged KV slot allocator (SGLang's ``PagedTokenToKVPoolAllocator``, on CPU lists).

The unit of allocation is the page. Page ids run ``1..num_pages``; page 0 is
reserved as the padding target (CUDA-graph padding rows point at it) and is
never handed out. Slot ids of a page are ``[page_id * page_size,
(page_id + 1) * page_size)``; ``page_size == 1`` is token granularity.

Every page is in one of four states, kept in an always-on byte map, so a
double free raises ``DoubleFreeError`` in production too, not only in tests::

    USED  -> free()           -> FREE
    USED  -> defer_free(b)    -> PENDING -> release_deferred(b) -> FREE
    FREE  -> alloc_pages()    -> USED
    page 0: RESERVED forever
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvserve.mem.errors import DoubleFreeError, PoolError
from kvserve.mem.pages import num_pages as pages_for

USED, FREE, RESERVED, PENDING = 0, 1, 2, 3
_STATE_NAMES = {USED: "used", FREE: "free", RESERVED: "reserved", PENDING: "pending release"}


class TokenToKVPoolAllocator:
    """Free-page list over ``num_tokens // page_size`` usable pages.

    Args:
        num_tokens: capacity in tokens, page 0 not included; rounded down to
            whole pages.
        page_size: tokens per page, >= 1.

    Frees inside ``with free_group():`` are applied together at the end (speed
    only). Frees inside ``with deferring(batch_id):`` wait in the deferred-release
    queue until ``release_deferred(batch_id)``: an in-flight batch may still
    read those pages (DESIGN rule 7).
    """

    def __init__(self, num_tokens: int, page_size: int) -> None:
        if page_size < 1:
            raise PoolError(f"page_size must be >= 1, got {page_size}")
        if num_tokens < page_size:
            raise PoolError(f"num_tokens={num_tokens} holds no whole page of {page_size}")
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.size = self.num_pages * page_size
        self._state = bytearray([FREE]) * (self.num_pages + 1)
        self._state[0] = RESERVED
        # Popped from the end: pages come out as 1, 2, 3, ... on a fresh pool.
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._group: list[int] | None = None
        self._defer_batch: int | None = None
        self._deferred: dict[int, list[int]] = {}
        # Called with the page ids that just became free (the scripted runtime
        # poisons their KV so a stale read changes its output).
        self.on_free: Callable[[Sequence[int]], None] | None = None

    # -- sizes ---------------------------------------------------------------------
    def available_size(self) -> int:
        """Free capacity in tokens (whole free pages only)."""
        return len(self._free_pages) * self.page_size

    def available_pages(self) -> int:
        return len(self._free_pages)

    def pending_release_size(self) -> int:
        """Tokens waiting in the deferred-release queue."""
        return sum(len(p) for p in self._deferred.values()) * self.page_size

    # -- allocation ---------------------------------------------------------------
    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` free pages; None (and nothing taken) when short."""
        free = self._free_pages
        if num_pages > len(free) or num_pages < 0:
            return None
        if num_pages == 0:
            return []
        taken = free[-num_pages:]
        taken.reverse()  # ascending ids on a fresh pool: easier to read in tests and dumps
        del free[-num_pages:]
        state = self._state
        for page in taken:
            state[page] = USED
        return taken

    def alloc(self, num_tokens: int) -> list[int] | None:
        """Page ids of ``ceil(num_tokens / page_size)`` new pages, or None when short."""
        return self.alloc_pages(pages_for(num_tokens, self.page_size))

    def alloc_extend(self, seq_len: int, extend_len: int) -> list[int] | None:
        """New pages to grow a sequence of ``seq_len`` allocated tokens by ``extend_len``.

        The partly filled last page is continued first, so only
        ``ceil((seq_len + extend_len) / P) - ceil(seq_len / P)`` pages are taken.
        """
        p = self.page_size
        return self.alloc_pages(pages_for(seq_len + extend_len, p) - pages_for(seq_len, p))

    # -- release ------------------------------------------------------------------
    def free(self, page_ids: Sequence[int], immediate: bool = False) -> None:
        """Return pages (whole pages, by page id). Raises DoubleFreeError.

        Inside ``deferring(batch_id)`` the pages go to that batch's deferred queue
        instead; inside ``free_group()`` they are applied when the group ends.
        ``immediate`` skips both: for pages no batch can be reading (evicted cache
        pages), which an allocation waiting on the eviction needs at once.
        """
        if not page_ids:
            return
        if self._defer_batch is not None and not immediate:
            self.defer_free(self._defer_batch, page_ids)
        elif self._group is not None and not immediate:
            self._group.extend(page_ids)
        else:
            self._release(page_ids, USED, "one free() call")

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Batch the frees made inside the block (applied at exit, also on error)."""
        if self._group is not None:
            yield
            return
        self._group = []
        try:
            yield
        finally:
            group, self._group = self._group, None
            if group:
                self._release(group, USED, "one free_group() block")

    @contextmanager
    def deferring(self, batch_id: int) -> Iterator[None]:
        """Route every ``free`` inside the block to batch ``batch_id``'s deferred queue."""
        outer, self._defer_batch = self._defer_batch, batch_id
        try:
            yield
        finally:
            self._defer_batch = outer

    def defer_free(self, batch_id: int, page_ids: Sequence[int]) -> None:
        """Hold used pages until ``release_deferred(batch_id)``. Raises DoubleFreeError."""
        if not page_ids:
            return
        self._mark(page_ids, USED, PENDING, "one defer_free() call")
        self._deferred.setdefault(batch_id, []).extend(page_ids)

    def release_deferred(self, batch_id: int) -> int:
        """Free what batch ``batch_id`` deferred; returns the number of pages freed."""
        pages = self._deferred.pop(batch_id, None)
        if not pages:
            return 0
        self._release(pages, PENDING, f"batch {batch_id}'s deferred queue")
        return len(pages)

    def _release(self, page_ids: Sequence[int], expect: int, where: str) -> None:
        """Pages in state ``expect`` become FREE (all or none). Raises DoubleFreeError."""
        self._mark(page_ids, expect, FREE, where)
        self._free_pages.extend(page_ids)
        if self.on_free is not None:
            self.on_free(page_ids)

    def deferred_batches(self) -> dict[int, list[int]]:
        """Copy of the deferred-release queue: batch id -> page ids."""
        return {b: list(p) for b, p in self._deferred.items()}

    # -- inspection (checker) -------------------------------------------------------
    def free_page_ids(self) -> list[int]:
        return list(self._free_pages)

    def page_state(self, page_id: int) -> str:
        return _STATE_NAMES[self._state[page_id]]

    def is_free(self, page_id: int) -> bool:
        return self._state[page_id] == FREE

    def check_used(self, page_ids: Sequence[int]) -> None:
        """Raise PoolError unless every page is allocated (not free, reserved or pending)."""
        state, last = self._state, self.num_pages
        for page in page_ids:
            if not 0 < page <= last or state[page] != USED:
                found = _STATE_NAMES[state[page]] if 0 <= page <= last else "outside the pool"
                raise PoolError(f"page {page} is {found}, not an allocated page")

    def state_bytes(self) -> bytes:
        """The page-state byte map (``USED``/``FREE``/``RESERVED``/``PENDING`` per page id)."""
        return bytes(self._state)

    def state_counts(self) -> dict[str, int]:
        """Number of pages per state, from the byte map (page 0 included as reserved)."""
        return {name: self._state.count(code) for code, name in _STATE_NAMES.items()}

    def _mark(self, page_ids: Sequence[int], expect: int, new: int, where: str) -> None:
        """Move pages from state ``expect`` to ``new``, all or none; ``where`` names the
        list for the error (``"one free() call"``)."""
        state = self._state
        last = self.num_pages
        for i, page in enumerate(page_ids):
            if page < 0 or page > last or state[page] != expect:
                # Only a page this list already moved can be a repeat (else we stopped there).
                repeat = 0 <= page <= last and page in page_ids[:i]
                for undo in page_ids[:i]:
                    state[undo] = expect
                if repeat:
                    raise DoubleFreeError(f"page {page} listed twice in {where}")
                raise self._bad_page(page, expect)
            state[page] = new

    def _bad_page(self, page: int, expect: int) -> Exception:
        if page < 0 or page > self.num_pages:
            return PoolError(f"page id {page} outside 1..{self.num_pages}")
        found = _STATE_NAMES[self._state[page]]
        if expect == USED:
            return DoubleFreeError(f"page {page} freed while {found}")
        return DoubleFreeError(f"page {page} released from the deferred queue while {found}")
