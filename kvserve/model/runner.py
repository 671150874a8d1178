"""``ModelRunner``: the real model behind the scheduler's ``ForwardBatch`` interface."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.forward import ForwardBatch, ModelOutput
from kvserve.mem.pools import MemoryPools, build_pools
from kvserve.model.attention_backend import (
    AttentionBackend,
    make_attention_backend,
    resolve_backend,
)
from kvserve.model.config import ModelConfig
from kvserve.model.layers import CausalLM
from kvserve.model.loader import load_model
from kvserve.model.sampler import ban_tokens, sample


class ModelRunner:
    """Runs a ``CausalLM`` over the paged KV pool and samples the next tokens.

    ``forward`` returns one token for each request whose prompt (or chunk) reaches
    its end, none for a request mid chunked prefill. ``last_logits`` keeps the
    float32 logits of the sampled positions of the last call ([sampled, vocab]).
    """

    uses_sampling_params = True

    def __init__(self, model: CausalLM, config: ModelConfig, pools: MemoryPools,
                 seed: int = 0, attention_backend: str = "auto",
                 cuda_graph: bool | None = None) -> None:
        if pools.kv_buffer is None:
            raise ValueError("ModelRunner needs pools with a KV buffer (see build_pools)")
        self.model = model
        self.config = config
        self.pools = pools
        self.device = pools.kv_buffer.k_buffers[0].device
        self.attention_backend = resolve_backend(attention_backend, self.device)
        self.attention: AttentionBackend = make_attention_backend(
            self.attention_backend, pools.kv_buffer, pools.req_to_token_pool.req_to_token)
        from kvserve.model.cuda_graph import DecodeGraphRunner

        # decode batches go through padded static buffers (graphs on CUDA + Triton)
        self.graph_runner = DecodeGraphRunner(self, use_graphs=cuda_graph)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.last_logits: torch.Tensor | None = None
        # Tests: called with (batch, float32 logits of every input token) each forward.
        self.capture_logits: Callable[[ForwardBatch, torch.Tensor], None] | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_total_tokens: int, page_size: int,
                        max_requests: int, context_len: int, device: str = "cpu",
                        dtype: torch.dtype = torch.float32,
                        attention_backend: str = "auto") -> ModelRunner:
        model, config = load_model(model_dir, device, dtype)
        pools = build_pools(max_requests, context_len, max_total_tokens, page_size,
                            config.kv_layout(dtype), device=device)
        return cls(model, config, pools, attention_backend=attention_backend)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every input token, [tokens, hidden]; writes their KV."""
        if batch.speculative:
            raise NotImplementedError("the model runner has no draft model for speculation")
        if self.graph_runner.can_run(batch):
            return self.graph_runner.hidden_states(batch)
        metadata = self.attention.prepare(batch)
        return self.model(batch.input_ids.to(self.device), batch.positions.to(self.device),
                          self.attention, metadata)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        hidden = self.hidden_states(batch)
        if self.capture_logits is not None:
            self.capture_logits(batch, self.model.logits(hidden))
        new_lens = batch.seq_lens - batch.prefix_lens
        last = torch.cumsum(new_lens, 0) - 1
        sample_mask = batch.sample.to(torch.bool)
        picked = sample_mask.cpu()  # rows that sample (one host copy for all below)
        wanted = last[picked].to(self.device).long()
        result: list[list[int]] = [[] for _ in range(batch.batch_size)]
        if wanted.numel() == 0:
            return ModelOutput(result)
        logits = self.model.logits(hidden[wanted])
        self.last_logits = logits
        params = batch.sampling
        logprobs: list[list[float]] | None = None
        banned = batch.banned_token_ids
        allowed = ban_tokens(logits, None if banned is None else banned[picked])
        if params is None:
            tokens = allowed.argmax(dim=-1)
        else:
            sub = type(params)(*(getattr(params, f)[picked] for f in params.__dataclass_fields__))
            tokens = sample(allowed, sub, batch.seq_lens[picked].long(), self.generator)
            if bool(sub.return_logprob.any()):
                chosen = logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
                logprobs = [[] for _ in range(batch.batch_size)]
        rows = sample_mask.nonzero()[:, 0].tolist()
        for j, (i, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            result[i] = [int(token)]
            if logprobs is not None:
                logprobs[i] = [chosen[j]]
        return ModelOutput(result, logprobs)
