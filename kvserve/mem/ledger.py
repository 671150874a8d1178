"""Page ledger: the owner of every KV page, built by a full ownership walk.

Owners are plain strings: ``"free"``, ``"reserved"``, ``"tree"``,
``"req:<rid>"``, ``"session:<id>"``, ``"pending:<batch>"`` or any name an
external holder registers (for example a test that exhausts the pool). The
walk is the strict-mode half of the accounting; the always-on half is the
allocator's byte map.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Conflict(NamedTuple):
    page_id: int
    first_owner: str
    second_owner: str


class PageLedger:
    """Records one owner per page id ``0..num_pages``; a second claim is a conflict.

    Each claim also says which allocator state its pages must be in (a byte, as in
    ``TokenToKVPoolAllocator``); ``expected_states`` collects them for one comparison.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._owner: list[str | None] = [None] * (num_pages + 1)
        self.expected_states = bytearray(num_pages + 1)
        self.conflicts: list[Conflict] = []
        self.out_of_range: list[tuple[int, str]] = []

    def claim(self, page_ids: Iterable[int], owner: str, state: int = 0) -> None:
        owners, states, last = self._owner, self.expected_states, self.num_pages
        for page in page_ids:
            if not 0 <= page <= last:
                self.out_of_range.append((page, owner))
                continue
            held = owners[page]
            if held is None:
                owners[page] = owner
                states[page] = state
            else:
                self.conflicts.append(Conflict(page, held, owner))

    def owner(self, page_id: int) -> str | None:
        return self._owner[page_id]

    def unowned(self) -> list[int]:
        """Pages nobody claimed: leaked."""
        return [p for p, o in enumerate(self._owner) if o is None]

    def count(self, owner_prefix: str) -> int:
        """Pages whose owner starts with ``owner_prefix``."""
        return sum(1 for o in self._owner if o is not None and o.startswith(owner_prefix))
