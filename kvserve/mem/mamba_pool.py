"""Per-request SSM state for hybrid (Mamba) models (SGLang's ``MambaPool``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.mem.errors import DoubleFreeError, PoolError


class MambaPool:
    """Conv and temporal (SSM) state slots.

    ``conv_state``: ``[num_layers, size + 1, *conv_shape]``;
    ``temporal_state``: ``[num_layers, size + 1, *temporal_shape]``. Slot 0 is
    padding and never handed out.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        conv_shape: Sequence[int],
        temporal_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if size < 1 or num_layers < 1:
            raise PoolError(f"bad MambaPool sizes: size={size} num_layers={num_layers}")
        self.size = size
        self.conv_state = torch.zeros(
            (num_layers, size + 1, *conv_shape), dtype=dtype, device=device
        )
        self.temporal_state = torch.zeros(
            (num_layers, size + 1, *temporal_shape), dtype=dtype, device=device
        )
        self._is_free = bytearray([1]) * (size + 1)
        self._is_free[0] = 0
        self._free_slots: list[int] = list(range(size, 0, -1))

    def available_size(self) -> int:
        """Free slots."""
        return len(self._free_slots)

    def alloc(self, num_slots: int = 1) -> list[int] | None:
        """``num_slots`` slot ids, or None (and nothing taken) when short."""
        if num_slots < 0 or num_slots > len(self._free_slots):
            return None
        taken = [self._free_slots.pop() for _ in range(num_slots)]
        for slot in taken:
            self._is_free[slot] = 0
        return taken

    def check_held(self, slots: Sequence[int]) -> None:
        """Raise DoubleFreeError / PoolError unless every slot is allocated, once."""
        if len(set(slots)) != len(slots):
            raise DoubleFreeError(f"slots {list(slots)} contain a repeat")
        for slot in slots:
            if not 0 < slot <= self.size:
                raise PoolError(f"mamba slot {slot} outside 1..{self.size}")
            if self._is_free[slot]:
                raise DoubleFreeError(f"mamba slot {slot} freed while free")

    def free(self, slots: Sequence[int]) -> None:
        """Return slots. Raises DoubleFreeError (nothing freed) on a free slot."""
        self.check_held(slots)
        for slot in slots:
            self._is_free[slot] = 1
        self._free_slots.extend(slots)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy both states of slot ``src`` into slot ``dst`` (copy-on-write of a cached state)."""
        self.conv_state[:, dst] = self.conv_state[:, src]
        self.temporal_state[:, dst] = self.temporal_state[:, src]

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
