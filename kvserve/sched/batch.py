"""The scheduler's side of a step (``ScheduleBatch``) and the builder that turns chosen
requests into the ``ForwardBatch`` the model reads.

Index ranges of one request in an EXTEND batch (``committed_len`` = c)::

    row:  [0 ........ c)[c .......... c + extend_len)
           already in KV  new this step: input ids, positions and out_cache_loc slots
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvserve.forward import ForwardBatch, ForwardMode, SamplingBatch
from kvserve.kv import DecodeAlloc, req_slot_ids
from kvserve.mem.pages import int_tensor
from kvserve.mem.pools import MemoryPools
from kvserve.sched.config import SpecConfig
from kvserve.sched.req import Req


@dataclass(slots=True)
class ScheduleBatch:
    """The scheduler's side of a step: the requests and the snapshot sent to the model."""

    batch_id: int
    forward_mode: ForwardMode
    reqs: list[Req]
    forward_batch: ForwardBatch


class BatchBuilder:
    """Builds ``ScheduleBatch``es over ``pools``; batch ids count from 1.

    Args:
        pools: the rows and KV pool the slots refer to (tensors go to its device).
        speculative: the speculative shape, or None.
        with_sampling: attach a ``SamplingBatch`` (the real model runner samples).
    """

    def __init__(self, pools: MemoryPools, speculative: SpecConfig | None,
                 with_sampling: bool) -> None:
        self.pools = pools
        self.speculative = speculative
        self.with_sampling = with_sampling
        self.device = pools.req_to_token_pool.req_to_token.device
        self._batch_ids = itertools.count(1)

    def decode(self, reqs: list[Req], decode: DecodeAlloc[Req]) -> ScheduleBatch:
        """One token per request at position ``committed_len`` (the hot path)."""
        device = self.device
        n = len(reqs)
        # one host->device copy for the four per-request vectors
        packed = int_tensor(
            [r.output_ids[-1] for r in reqs] + decode.positions + decode.out_cache_loc
            + decode.rows, torch.int32, device,
        )
        input_ids, positions, out_cache_loc, rows = packed.view(4, n).unbind(0)
        batch_id = next(self._batch_ids)
        forward = ForwardBatch(
            batch_id=batch_id,
            forward_mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=positions + 1,
            prefix_lens=positions,
            extend_lens=torch.ones(n, dtype=torch.int32, device=device),
            sample=torch.ones(n, dtype=torch.bool, device=device),
            sampling=self._sampling_batch(reqs),
            banned_token_ids=self._banned_token_ids(reqs),
        )
        return ScheduleBatch(batch_id, ForwardMode.DECODE, reqs, forward)

    def extend(self, reqs: list[Req]) -> ScheduleBatch:
        """Each request's ``extend_len`` tokens from ``committed_len`` (prefill chunks)."""
        return self._build(ForwardMode.EXTEND, reqs)

    def spec_decode(self, reqs: list[Req]) -> ScheduleBatch:
        """One input token per request and a window of ``speculative.reserve`` slots."""
        return self._build(ForwardMode.DECODE, reqs)

    def _build(self, mode: ForwardMode, reqs: list[Req]) -> ScheduleBatch:
        pools = self.pools
        device = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        rows, seq_lens, prefix_lens, extend_lens, sample = [], [], [], [], []
        spec = self.speculative
        for req in reqs:
            kv = req.kv
            start = kv.committed_len
            if mode is ForwardMode.EXTEND:
                end = start + req.extend_len
                input_ids += req.fill_ids[start:end]
                positions += range(start, end)
                slots.append(req_slot_ids(pools, kv, start, end))
                width, last = end - start, end
                sample.append(end >= req.seq_len)
            else:  # speculative window (plain decode: decode())
                assert spec is not None
                input_ids.append(req.output_ids[-1])
                positions.append(start)
                width = spec.reserve
                slots.append(req_slot_ids(pools, kv, start, start + width))
                last = start + 1
                sample.append(True)
            rows.append(kv.row)
            seq_lens.append(last)
            prefix_lens.append(start)
            extend_lens.append(width)
        out_cache_loc = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int32)

        def i32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        batch_id = next(self._batch_ids)
        forward = ForwardBatch(
            batch_id=batch_id,
            forward_mode=mode,
            input_ids=i32(input_ids),
            positions=i32(positions),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=i32(rows),
            seq_lens=i32(seq_lens),
            prefix_lens=i32(prefix_lens),
            extend_lens=i32(extend_lens),
            sample=torch.tensor(sample, dtype=torch.bool, device=device),
            speculative=mode is ForwardMode.DECODE and spec is not None,
            sampling=self._sampling_batch(reqs),
            banned_token_ids=self._banned_token_ids(reqs),
        )
        return ScheduleBatch(batch_id, mode, reqs, forward)

    def _banned_token_ids(self, reqs: list[Req]) -> torch.Tensor | None:
        """``ForwardBatch.banned_token_ids``: the stop ids of each request whose output is
        still below ``min_new_tokens`` (SGLang's min-new-tokens penalizer, vLLM's
        MinTokensLogitsProcessor); None, and no tensor built, when no row needs one."""
        banned = {i: r.stop_ids for i, r in enumerate(reqs)
                  if r.stop_ids and len(r.output_ids) < r.sampling.min_new_tokens}
        if not banned:
            return None
        width = max(len(ids) for ids in banned.values())
        table = [[-1] * width for _ in reqs]
        for i, ids in banned.items():
            table[i][: len(ids)] = sorted(ids)
        return torch.tensor(table, dtype=torch.int64, device=self.device)

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch | None:
        if not self.with_sampling:
            return None
        device = self.device
        params = [r.sampling for r in reqs]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=int_tensor([p.top_k for p in params], torch.int32, device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            seed=int_tensor([-1 if p.seed is None else p.seed for p in params], torch.int64,
                            device),
            return_logprob=torch.tensor([p.return_logprob for p in params], dtype=torch.bool,
                                        device=device),
        )
