"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Sampling is Gumbel-max over the filtered logits. A seeded request draws its noise
from a counter-based hash of (seed, position, token id) computed in the batch
(splitmix64), so it gets the same tokens whatever the batch and needs no
per-request generator state (works inside a CUDA graph too).
"""

from __future__ import annotations

import torch

from kvserve.forward import SamplingBatch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                             0x94D049BB133111EB))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float64 ``[batch, vocab]`` from (seed, position, token id)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    x = (seed[:, None] * _GOLDEN + position[:, None] * _MIX1 + ids[None, :] * _MIX2 + _GOLDEN)
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)


def ban_tokens(logits: torch.Tensor, banned_token_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` (float32 [batch, vocab]) with the banned ids of each row set to -inf, so
    greedy and sampling both pick the best allowed token (min_new_tokens masks EOS and
    stop ids this way). ``banned_token_ids``: int64 [batch, max_banned], -1 padded, or
    None (``logits`` returned as is). A new tensor: the caller's logits stay unmasked."""
    if banned_token_ids is None:
        return logits
    vocab = logits.shape[-1]
    ids = banned_token_ids.to(logits.device)
    # padding goes to an extra column that is dropped: one scatter, no host sync
    ids = torch.where(ids < 0, vocab, ids)
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, ids, True)
    return logits.masked_fill(mask[:, :vocab], float("-inf"))


def sample(logits: torch.Tensor, params: SamplingBatch, positions: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row. ``logits``: float32 [batch, vocab]; ``positions``: int64 [batch],
    the position the sampled token will take. Returns int64 [batch]."""
    greedy_tokens = logits.argmax(dim=-1)
    temperature = params.temperature.to(logits.device)
    if bool((temperature == 0).all()):
        return greedy_tokens
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    vocab = logits.shape[-1]
    top_k = params.top_k.to(logits.device).long()
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    top_p = params.top_p.to(logits.device)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    min_p = params.min_p.to(logits.device)
    if bool((min_p > 0).any()):
        floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    seeds = params.seed.to(logits.device)
    uniform = torch.rand(logits.shape, dtype=torch.float64, device=logits.device,
                         generator=generator)
    seeded = seeds >= 0
    if bool(seeded.any()):
        hashed = hash_uniform(seeds.clamp_min(0), positions.to(logits.device).long(), vocab)
        uniform = torch.where(seeded[:, None], hashed, uniform)
    gumbel = -torch.log(-torch.log(uniform))
    sampled = (scaled.double() + gumbel).argmax(dim=-1)
    return torch.where(temperature == 0, greedy_tokens, sampled)
