"""Token <-> page arithmetic, in one place (STYLE rule 2).

A KV slot id is ``page_id * page_size + offset``; position ``i`` of a request
lives at offset ``i % page_size`` of its ``i // page_size``-th page.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.int32,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """A 1-D integer tensor from Python ints, through one C-level ``array`` copy (several
    times faster than ``torch.tensor(list)`` for the few hundred values of a batch)."""
    buf = array(_ARRAY_CODES[dtype], values)
    if not buf:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(buf, dtype=dtype).to(device)


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens (ceil)."""
    return -(-num_tokens // page_size)


def ceil_page(num_tokens: int, page_size: int) -> int:
    """``num_tokens`` rounded up to a whole number of pages, in tokens."""
    return -(-num_tokens // page_size) * page_size


def floor_page(num_tokens: int, page_size: int) -> int:
    """``num_tokens`` rounded down to a whole number of pages, in tokens."""
    return num_tokens - num_tokens % page_size


def slot_ids(page_ids: Sequence[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """KV slot ids of token positions ``[start, end)`` of a sequence.

    ``page_ids[i]`` holds positions ``[i * page_size, (i + 1) * page_size)``.
    Returns int32 ``[end - start]``. Raises IndexError when ``page_ids`` does not
    cover ``end``.
    """
    if end <= start:
        return torch.empty(0, dtype=torch.int32)
    first, last = start // page_size, num_pages(end, page_size)
    if last > len(page_ids):
        raise IndexError(f"positions up to {end} need {last} pages, have {len(page_ids)}")
    pages = torch.tensor(page_ids[first:last], dtype=torch.int32)
    slots = (pages[:, None] * page_size + torch.arange(page_size, dtype=torch.int32)).flatten()
    offset = first * page_size
    return slots[start - offset : end - offset]
