"""Memory pools: rows, paged KV allocator, KV buffers, Mamba state, page ledger."""

from kvserve.mem.allocator import TokenToKVPoolAllocator
from kvserve.mem.errors import DoubleFreeError, PoolError
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.mem.ledger import PageLedger
from kvserve.mem.mamba_pool import MambaPool
from kvserve.mem.pages import ceil_page, floor_page, num_pages, slot_ids
from kvserve.mem.pools import MemoryPools
from kvserve.mem.req_to_token import ReqToTokenPool

__all__ = [
    "DoubleFreeError",
    "MHATokenToKVPool",
    "MambaPool",
    "MemoryPools",
    "PageLedger",
    "PoolError",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "ceil_page",
    "floor_page",
    "num_pages",
    "slot_ids",
]
