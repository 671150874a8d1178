"""What the model code needs from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.mem.pools import KVLayout
from kvserve.model.errors import ModelLoadError
from kvserve.model.registry import resolve_architecture

__all__ = ["ModelConfig", "ModelLoadError"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture constants (sizes in elements, ``head_dim`` per head)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # config.attention_bias (a family may add biases of its own)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # the transformers config (rope parameters are computed from it)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Raises ModelLoadError when no architecture of ``hf`` is registered."""
        arch = resolve_architecture(list(getattr(hf, "architectures", None) or []))
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = hf.eos_token_id
        eos_list = eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]
        eos_ids = tuple(eos_list)
        return cls(
            architecture=arch,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            max_position_embeddings=hf.max_position_embeddings,
            eos_token_ids=eos_ids,
            hf_config=hf,
        )

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """Shape of this model's KV buffers when they hold ``dtype``."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype)
