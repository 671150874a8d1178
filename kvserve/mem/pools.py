"""The bundle of pools one engine owns, and the one function that sizes and builds it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.mem.allocator import TokenToKVPoolAllocator
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.mem.mamba_pool import MambaPool
from kvserve.mem.req_to_token import ReqToTokenPool

MIN_CPU_POOL_TOKENS = 65536  # CPU default: four contexts, but never fewer slots than this


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


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV buffers of one model: per layer, K and V of
    ``[slots, num_kv_heads, head_dim]`` in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take over all layers."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element


def build_pools(num_rows: int, context_len: int, pool_tokens: int, page_size: int,
                kv_layout: KVLayout | None = None, spec_reserve: int = 0,
                device: str | torch.device = "cpu") -> MemoryPools:
    """Rows, allocator and (when ``kv_layout`` is given) KV buffers on ``device``.

    Args:
        num_rows: request rows of ``req_to_token`` (most running requests).
        context_len: longest request in tokens.
        pool_tokens: KV capacity in tokens, page 0 not included (rounded down to pages).
        page_size: tokens per page.
        kv_layout: shape of the KV buffers; None for a pool without buffers (the
            scripted model and cache benchmarks keep no K/V).
        spec_reserve: extra row width in tokens for speculative over-allocation.

    Raises PoolError for sizes below one row, one token or one page.
    """
    kv_buffer = None
    if kv_layout is not None:
        kv_buffer = MHATokenToKVPool(pool_tokens, page_size, kv_layout.num_layers,
                                     kv_layout.num_kv_heads, kv_layout.head_dim,
                                     kv_layout.dtype, device)
    return MemoryPools(
        req_to_token_pool=ReqToTokenPool(num_rows, context_len, page_size, spec_reserve,
                                         device=device),
        allocator=TokenToKVPoolAllocator(pool_tokens, page_size),
        kv_buffer=kv_buffer,
    )


def pool_tokens_for_budget(kv_layout: KVLayout, budget_bytes: float) -> int:
    """Whole tokens of KV that ``budget_bytes`` holds (0 for a negative budget)."""
    return max(0, int(budget_bytes // kv_layout.bytes_per_token))


def default_pool_tokens(kv_layout: KVLayout, device: str | torch.device, context_len: int,
                        mem_fraction: float) -> int:
    """KV pool size in tokens: on CUDA what ``mem_fraction`` of the device memory leaves
    after what is already allocated (load the weights first); on CPU four contexts, at
    least ``MIN_CPU_POOL_TOKENS``.

    Raises RuntimeError when fewer than ``context_len`` tokens fit on CUDA.
    """
    if torch.device(device).type != "cuda":
        return max(context_len * 4, MIN_CPU_POOL_TOKENS)
    free, total = torch.cuda.mem_get_info(device)
    tokens = pool_tokens_for_budget(kv_layout, free - (1 - mem_fraction) * total)
    if tokens < context_len:
        raise RuntimeError(f"only {tokens} KV tokens fit in {mem_fraction:.0%} of the device "
                           f"memory; lower the context length or raise mem_fraction_static")
    return tokens
