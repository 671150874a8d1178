"""The request-to-token table (SGLang's ``ReqToTokenPool``)."""

from __future__ import annotations

import torch

from kvserve.mem.errors import DoubleFreeError, PoolError


class ReqToTokenPool:
    """Rows mapping a request's token positions to KV slot ids.

    ``req_to_token``: int32 ``[size + 1, row_width]``; row 0 is padding (never
    handed out), rows ``1..size`` are allocated one per running request
    (``req_pool_idx``). ``row_width = context_len + spec_reserve + page_size - 1``
    so speculative over-allocation near the context limit never writes past the row.
    """

    def __init__(
        self,
        size: int,
        context_len: int,
        page_size: int = 1,
        spec_reserve: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if size < 1 or context_len < 1 or page_size < 1 or spec_reserve < 0:
            raise PoolError(
                f"bad ReqToTokenPool sizes: size={size} context_len={context_len} "
                f"page_size={page_size} spec_reserve={spec_reserve}"
            )
        self.size = size
        self.row_width = context_len + spec_reserve + page_size - 1
        self.req_to_token = torch.zeros(
            (size + 1, self.row_width), dtype=torch.int32, device=device
        )
        self._is_free = bytearray([1]) * (size + 1)
        self._is_free[0] = 0
        self._free_rows: list[int] = list(range(size, 0, -1))

    def available_size(self) -> int:
        """Free rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index (``req_pool_idx``), or None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = 0
        return row

    def free(self, row: int) -> None:
        """Return a row. Raises DoubleFreeError for a free row or row 0."""
        if not 0 < row <= self.size:
            raise PoolError(f"row {row} outside 1..{self.size}")
        if self._is_free[row]:
            raise DoubleFreeError(f"row {row} freed while free")
        self._is_free[row] = 1
        self._free_rows.append(row)

    def write(self, row: int, start: int, slot_ids: torch.Tensor) -> None:
        """Set ``req_to_token[row, start:start + len(slot_ids)] = slot_ids``."""
        end = start + slot_ids.numel()
        if end > self.row_width:
            raise PoolError(f"row write [{start}, {end}) past row width {self.row_width}")
        self.req_to_token[row, start:end] = slot_ids.to(self.req_to_token.device)

    def write_many(self, rows: list[int], cols: list[int], slot_ids: list[int]) -> None:
        """Set ``req_to_token[rows[i], cols[i]] = slot_ids[i]`` for all ``i`` in one copy."""
        if not rows:
            return
        if max(cols) >= self.row_width:
            raise PoolError(f"row write at column {max(cols)} past row width {self.row_width}")
        dev = self.req_to_token.device
        self.req_to_token[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = (
            torch.tensor(slot_ids, dtype=torch.int32, device=dev)
        )

    def is_free(self, row: int) -> bool:
        return bool(self._is_free[row])
