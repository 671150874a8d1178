"""A prefix cache that shares nothing (SGLang's ``ChunkCache``, radix cache disabled)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

from kvserve.cache.base import BasePrefixCache, InsertResult, MatchResult, PrefixLock
from kvserve.kv import KVOwner
from kvserve.mem.pools import MemoryPools


class ChunkCache(BasePrefixCache):
    """Same interface as ``RadixCache``; every match is empty, nothing is kept.

    Chunked prefill still works: a running request keeps its own pages between
    chunks and frees them all when it finishes.
    """

    def __init__(self, pools: MemoryPools) -> None:
        super().__init__(pools)

    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(array("i"), 0, None)

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], extra_key: str | None = None
    ) -> InsertResult:
        return InsertResult(0, None)

    def cache_unfinished_req(self, req: KVOwner) -> None:
        return None

    def cache_finished_req(self, req: KVOwner) -> None:
        self.pools.allocator.free(req.kv.owned_page_ids(self.pools.page_size))

    def inc_lock_ref(self, node: object) -> PrefixLock | None:
        return None

    def lock_page_ids(self, lock: PrefixLock) -> list[int]:
        return []

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def cached_page_ids(self) -> Iterator[int]:
        return iter(())

    def lock_path_counts(self, locks: Sequence[PrefixLock]) -> list[str]:
        return [f"ChunkCache cannot hold lock {lock!r}" for lock in locks]

    def verify(self) -> list[str]:
        return []
