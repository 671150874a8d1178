"""KV buffers indexed by slot id (SGLang's ``MHATokenToKVPool``)."""

from __future__ import annotations

import torch

from kvserve.mem.errors import PoolError


class MHATokenToKVPool:
    """Per-layer K and V tensors ``[num_slots + page_size, num_kv_heads, head_dim]``.

    Slot ids come from ``TokenToKVPoolAllocator``; the first page (slots
    ``0..page_size-1``) belongs to the reserved page 0, the padding target.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
    ) -> None:
        if min(num_slots, page_size, num_layers, num_kv_heads, head_dim) < 1:
            raise PoolError("MHATokenToKVPool sizes must all be >= 1")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[num_slots + page_size, num_kv_heads, head_dim]``."""
        return self.k_buffers[layer], self.v_buffers[layer]

    def set_kv_buffer(
        self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` (``[n, num_kv_heads, head_dim]``) at ``slot_ids`` (``[n]``)."""
        kb, vb = self.k_buffers[layer], self.v_buffers[layer]
        idx = slot_ids.to(device=kb.device, dtype=torch.long)
        kb[idx] = k.to(kb.dtype)
        vb[idx] = v.to(vb.dtype)
