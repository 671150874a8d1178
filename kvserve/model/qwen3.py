"""Qwen3 (dense): the Llama layout plus an RMSNorm over each head of q and k,
applied before rotary (``q_norm``, ``k_norm`` in the checkpoint)."""

from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.layers import CausalLM, DecoderLayer, RMSNorm, SelfAttention
from kvserve.model.registry import register_model


class Qwen3Attention(SelfAttention):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id, config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        return DecoderLayer(config, Qwen3Attention(config, layer_id))
