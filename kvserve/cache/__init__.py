"""Prefix caches: who shares which KV pages."""

from kvserve.cache.base import (
    BasePrefixCache,
    InsertResult,
    LockRefError,
    MatchResult,
    PrefixLock,
    SpentLockError,
)
from kvserve.cache.chunk import ChunkCache
from kvserve.cache.radix import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "InsertResult",
    "LockRefError",
    "MatchResult",
    "PrefixLock",
    "RadixCache",
    "SpentLockError",
    "TreeNode",
]
