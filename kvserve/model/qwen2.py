"""Qwen2 / Qwen2.5: the Llama layout with biases on the q, k and v projections."""

from __future__ import annotations

from kvserve.model.config import ModelConfig
from kvserve.model.layers import CausalLM, DecoderLayer, SelfAttention
from kvserve.model.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        return DecoderLayer(config, SelfAttention(config, layer_id, qkv_bias=True))
