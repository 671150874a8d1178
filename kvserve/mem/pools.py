"""The bundle of pools one engine owns, handed to the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.mem.allocator import TokenToKVPoolAllocator
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.mem.mamba_pool import MambaPool
from kvserve.mem.req_to_token import ReqToTokenPool


@dataclass(slots=True)
class MemoryPools:
    """Rows, KV pages (allocator + optional buffers) and optional Mamba slots."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    kv_buffer: MHATokenToKVPool | None = None
    mamba_pool: MambaPool | None = None

    @property
    def page_size(self) -> int:
        return self.allocator.page_size
