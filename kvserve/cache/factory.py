"""One place that builds the prefix cache an engine runs with.

Today: ``radix`` (``RadixCache``, SGLang's default) or ``chunk`` (``ChunkCache``,
SGLang's ``--disable-radix-cache``: nothing is shared between requests). Later kinds
(a Mamba radix cache for hybrid models, the streaming-session wrapper) are added here,
so the scheduler and the engine never choose a class themselves.
"""

from __future__ import annotations

import enum

from kvserve.cache.base import BasePrefixCache
from kvserve.cache.chunk import ChunkCache
from kvserve.cache.radix import RadixCache
from kvserve.mem.pools import MemoryPools


class PrefixCacheKind(enum.Enum):
    RADIX = "radix"
    CHUNK = "chunk"


def prefix_cache_kind(disable_radix_cache: bool) -> PrefixCacheKind:
    """The kind SGLang's ``--disable-radix-cache`` flag selects."""
    return PrefixCacheKind.CHUNK if disable_radix_cache else PrefixCacheKind.RADIX


def make_prefix_cache(pools: MemoryPools, kind: PrefixCacheKind) -> BasePrefixCache:
    """The prefix cache of ``kind`` over ``pools`` (empty)."""
    if kind is PrefixCacheKind.RADIX:
        return RadixCache(pools)
    return ChunkCache(pools)
