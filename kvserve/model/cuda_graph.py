"""Decode under CUDA graphs (SGLang's CudaGraphRunner, reduced to what kvserve needs).

One graph per captured batch size records the model forward of a decode step
(embedding to final hidden states, Triton attention included) over static input
buffers owned by this runner. A batch of ``bs`` requests runs the graph of the
smallest captured size ``>= bs``; the padding rows point at row 0 of
``req_to_token`` (all zeros, so their context is slot 0 of the reserved page 0)
and write their KV to slot 0, so they can never touch a real request's pages.
Batches above the largest size, and every batch on CPU, run eagerly through the
same static-buffer path (which is how the CPU tests check the padding). Sampling
runs after the graph, outside it. If capture fails, graphs are switched off with a
warning and decoding goes on eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.forward import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from kvserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeGraphRunner:
    """Pads decode batches to captured sizes; replays CUDA graphs where it can.

    Args:
        runner: the ``ModelRunner`` whose model and pools the graphs record.
        batch_sizes: sizes to capture (ascending); padded batches use the next one up.
        use_graphs: capture and replay (default: on CUDA with the Triton backend).
    """

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 use_graphs: bool | None = None) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        device = runner.device
        if use_graphs is None:
            use_graphs = device.type == "cuda" and runner.attention_backend == "triton"
        self.use_graphs = use_graphs
        n = self.max_bs

        def zeros() -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.rows, self.seq_lens = zeros(), zeros()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.forward_mode is ForwardMode.DECODE and not batch.speculative
                and batch.batch_size <= self.max_bs)

    def padded_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states ``[bs, hidden]`` of a decode batch (writes its KV)."""
        bs = batch.batch_size
        size = self.padded_size(bs)
        self._load(batch, bs, size)
        if self.use_graphs:
            try:
                return self._replay(size)[:bs]
            except RuntimeError as err:  # capture is best effort: keep serving eagerly
                logger.warning("CUDA graph capture failed (%s); decoding eagerly", err)
                self.use_graphs = False
                self.graphs.clear()
        return self._run_static(size)[:bs]

    def _load(self, batch: ForwardBatch, bs: int, size: int) -> None:
        for static, value in ((self.input_ids, batch.input_ids),
                              (self.positions, batch.positions),
                              (self.out_cache_loc, batch.out_cache_loc),
                              (self.rows, batch.req_pool_indices),
                              (self.seq_lens, batch.seq_lens)):
            static[:bs].copy_(value, non_blocking=True)
        # padding: row 0 / page 0, a context of one slot (slot 0), position 0
        for static in (self.input_ids, self.positions, self.out_cache_loc, self.rows):
            static[bs:size].zero_()
        self.seq_lens[bs:size].fill_(1)

    def _as_batch(self, size: int) -> ForwardBatch:
        """The padded static buffers as a decode batch (``prepare`` reads no device
        value of a decode batch, so the graph records the metadata's kernels too)."""
        ones = torch.ones(size, dtype=torch.int32, device=self.seq_lens.device)
        return ForwardBatch(0, ForwardMode.DECODE, self.input_ids[:size], self.positions[:size],
                            self.out_cache_loc[:size], self.rows[:size], self.seq_lens[:size],
                            self.seq_lens[:size] - 1, ones, ones.bool())

    def _run_static(self, size: int) -> torch.Tensor:
        runner = self.runner
        with torch.inference_mode():
            metadata = runner.attention.prepare(self._as_batch(size))
            return runner.model(self.input_ids[:size], self.positions[:size], runner.attention,
                                metadata)

    def _replay(self, size: int) -> torch.Tensor:
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (Triton compiles, allocator settles)
                self._run_static(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run_static(size)
        return graph, out
