"""Llama (2, 3, 3.1): no biases unless ``attention_bias``; llama3 rope scaling comes
from ``rope_parameters`` through the shared ``RotaryEmbedding``."""

from __future__ import annotations

from kvserve.model.config import ModelConfig
from kvserve.model.layers import CausalLM, DecoderLayer, SelfAttention
from kvserve.model.registry import register_model


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        return DecoderLayer(config, SelfAttention(config, layer_id, config.attention_bias))
