"""W1: prefix-cache replay through the engine's own RadixCache and allocator.

Per request, in order (``shared/bench/README.md``): match_prefix -> lock the
matched node -> evict the shortfall if free < needed -> allocate the unmatched
tail -> insert -> free the pages insert reports as already cached -> unlock. A
request that cannot fit even after eviction is skipped. The timed region starts
from plain token lists: key building is inside it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache.radix import RadixCache
from kvserve.mem.pools import build_pools


@dataclass
class PrefixCacheResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    skipped: int
    seconds: float
    gc_seconds: float
    bytes_per_cached_page: float
    cached_pages: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    def line(self) -> str:
        return (
            f"requests={self.requests} prompt_tokens={self.prompt_tokens} "
            f"hit_tokens={self.hit_tokens} hit_ratio={self.hit_ratio:.4f} "
            f"seconds={self.seconds:.3f} req_per_s={self.requests / self.seconds:.0f} "
            f"gc_seconds={self.gc_seconds:.3f} "
            f"bytes_per_cached_page={self.bytes_per_cached_page:.0f}"
        )


class _GcTimer:
    """Sums the time Python's cyclic garbage collector runs, via gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def build_cache(cap_tokens: int, page_size: int) -> RadixCache:
    """A RadixCache over a fresh allocator of ``cap_tokens`` (the W1 pool)."""
    return RadixCache(build_pools(num_rows=1, context_len=page_size, pool_tokens=cap_tokens,
                                  page_size=page_size))


def replay(prompts: list[list[int]], page_size: int, cap_tokens: int) -> PrefixCacheResult:
    """Run W1 over ``prompts``; returns counts, time, GC time and memory per cached page."""
    gc.collect()
    _reset_peak_rss()
    rss_base = _rss_bytes("VmRSS")
    tree = build_cache(cap_tokens, page_size)
    alloc = tree.pools.allocator
    gc_timer = _GcTimer()
    gc.callbacks.append(gc_timer)
    hit = total = skipped = requests = 0
    start = time.perf_counter()
    try:
        for tokens in prompts:
            n = len(tokens) - len(tokens) % page_size
            if n == 0:
                continue
            requests += 1
            total += n
            match = tree.match_prefix(tokens)
            lock = tree.inc_lock_ref(match.last_node)
            pre_pages = match.prefix_len // page_size
            need = n // page_size - pre_pages
            if alloc.available_pages() < need:
                tree.evict((need - alloc.available_pages()) * page_size)
            new_pages = alloc.alloc_pages(need)
            if new_pages is None:
                if lock is not None:
                    tree.dec_lock_ref(lock)
                skipped += 1
                continue
            result = tree.insert(tokens, [*match.page_ids, *new_pages])
            cached_pages = result.prefix_len // page_size
            if cached_pages > pre_pages:
                alloc.free(new_pages[: cached_pages - pre_pages])
            if lock is not None:
                tree.dec_lock_ref(lock)
            hit += match.prefix_len
        seconds = time.perf_counter() - start
    finally:
        gc.callbacks.remove(gc_timer)
    cached = (tree.evictable_size() + tree.protected_size()) // page_size
    peak = _rss_bytes("VmHWM")
    per_page = (peak - rss_base) / cached if cached and peak else float("nan")
    return PrefixCacheResult(requests, total, hit, skipped, seconds, gc_timer.seconds, per_page,
                             cached)
