"""Memory pools: rows, paged KV allocator, KV buffers, Mamba state, page ledger."""

from kvserve.mem.allocator import TokenToKVPoolAllocator
from kvserve.mem.errors import DoubleFreeError, PoolError
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.mem.ledger import PageLedger
from kvserve.mem.mamba_pool import MambaPool
from kvserve.mem.pages import ceil_page, floor_page, num_pages, slot_ids
from kvserve.mem.pools import (
    KVLayout,
    MemoryPools,
    build_pools,
    default_pool_tokens,
    pool_tokens_for_budget,
)
from kvserve.mem.req_to_token import ReqToTokenPool

__all__ = [
    "DoubleFreeError",
    "KVLayout",
    "MHATokenToKVPool",
    "MambaPool",
    "MemoryPools",
    "PageLedger",
    "PoolError",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "build_pools",
    "ceil_page",
    "default_pool_tokens",
    "floor_page",
    "num_pages",
    "pool_tokens_for_budget",
    "slot_ids",
]
