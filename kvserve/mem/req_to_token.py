"""The request-to-token table (SGLang's ``ReqToTokenPool``)."""

from __future__ import annotations

import torch

from kvserve.mem.errors import DoubleFreeError, PoolError
from kvserve.mem.pages import int_tensor


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

    def write_flat(self, flat_index: list[int], slot_ids: list[int]) -> None:
        """Set ``req_to_token.view(-1)[flat_index[i]] = slot_ids[i]`` in one copy, where
        the flat index of (row, column) is ``row * row_width + column``."""
        if not flat_index:
            return
        dev = self.req_to_token.device
        self.req_to_token.view(-1)[int_tensor(flat_index, torch.int64, dev)] = int_tensor(
            slot_ids, torch.int32, dev
        )

    def is_free(self, row: int) -> bool:
        return bool(self._is_free[row])
