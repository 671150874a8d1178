"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated SiLU
MLP, the paged self-attention block, the decoder layer and the ``CausalLM`` base class
(parameter names as in Hugging Face checkpoints).

A family module (``llama.py``, ``qwen2.py``, ...) subclasses ``CausalLM`` and says in
``make_layer`` which layer sits at each depth; a hybrid family returns a second kind
of layer there without touching the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention_backend import AttentionBackend, AttentionMetadata
from kvserve.model.config import ModelConfig


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of ``positions * inv_freq`` (rotate-half layout). Inverse frequencies come
    from transformers' rope functions, so llama3 scaling matches the reference exactly."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(config.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config.hf_config, "rope_theta", 10000.0))
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [tokens, heads, head_dim]; ``cos``/``sin``: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """q/k/v projections, rotary, paged attention through the backend, o projection.

    ``qkv_bias``: biases on q/k/v (Qwen2 always; otherwise ``config.attention_bias``).
    Subclasses change ``qk_norm`` (Qwen3 normalizes each head of q and k).
    """

    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scaling = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Applied to q, k ([tokens, heads, head_dim]) before rotary; none here."""
        return q, k

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                attn: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(q, k, v, self.layer_id, metadata, self.scaling)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention block and gated MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, self_attn: SelfAttention) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                attn: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """``model.*`` of a Hugging Face causal LM checkpoint."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """Base class of every family: embedding, ``make_layer`` per depth, norm, LM head.

    ``forward`` takes the flat input ids and positions of a ``ForwardBatch`` (int32
    [tokens]) and returns the final hidden states ``[tokens, hidden]``; each layer is
    called as ``layer(x, rope, attn, metadata)``. ``logits`` applies the LM head
    (float32 [tokens, vocab]).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, [self.make_layer(config, i)
                                           for i in range(config.num_layers)])
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """The decoder layer at depth ``layer_id`` (families override)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids.long())
        rope = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, attn, metadata)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()
