"""The model registry: one class per architecture name, families differ only in their
layers, and a new family (a hybrid one too) registers without touching the others."""

import dataclasses

import pytest
import torch
from torch import nn

from kvserve.model import registry
from kvserve.model.config import ModelConfig, ModelLoadError
from kvserve.model.init import hf_config
from kvserve.model.layers import CausalLM, DecoderLayer, SelfAttention
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import build_model
from kvserve.model.qwen2 import Qwen2ForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM
from kvserve.model.registry import (
    get_model_class,
    register_model,
    resolve_architecture,
    supported_architectures,
)


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))


def test_the_three_families_are_registered_by_their_hf_names():
    assert supported_architectures() == ("LlamaForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM")
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ModelLoadError) as err:
        get_model_class("MambaForCausalLM")
    assert str(err.value) == ("unsupported architecture ['MambaForCausalLM']; kvserve supports "
                              "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \(none given\)"):
        resolve_architecture([])


def test_first_registered_architecture_of_the_config_wins():
    assert resolve_architecture(["Foo", "Qwen2ForCausalLM", "LlamaForCausalLM"]) == (
        "Qwen2ForCausalLM")


@pytest.mark.parametrize(("shape", "attn_keys"), [
    ("tiny-llama", {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}),
    ("tiny-qwen2", {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "q_proj.bias", "k_proj.bias", "v_proj.bias"}),
    ("tiny-qwen3", {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "q_norm.weight", "k_norm.weight"}),
])
def test_each_family_builds_its_own_attention_parameters(shape, attn_keys):
    config = ModelConfig.from_hf(hf_config(shape))
    keys = build_model(config).state_dict().keys()
    prefix = "model.layers.0.self_attn."
    assert {k.removeprefix(prefix) for k in keys if k.startswith(prefix)} == attn_keys


def test_registering_a_name_twice_raises(scratch_registry):
    with pytest.raises(ValueError, match="LlamaForCausalLM is already registered to "
                                         "LlamaForCausalLM"):
        register_model("LlamaForCausalLM")(Qwen2ForCausalLM)
    assert register_model("LlamaForCausalLM")(LlamaForCausalLM) is LlamaForCausalLM


class _ScaleLayer(nn.Module):
    """A stand-in for a second kind of layer (a Mamba mixer, say): no attention."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x, rope, attn, metadata):
        return x * self.weight


def test_a_hybrid_family_adds_a_second_kind_of_layer(scratch_registry):
    @register_model("ToyHybridForCausalLM")
    class ToyHybrid(CausalLM):
        def make_layer(self, config, layer_id):
            if layer_id % 2:
                return _ScaleLayer(config.hidden_size)
            return DecoderLayer(config, SelfAttention(config, layer_id, qkv_bias=False))

    llama = ModelConfig.from_hf(hf_config("tiny-llama"))
    model = build_model(dataclasses.replace(llama, architecture="ToyHybridForCausalLM"))
    assert type(model) is ToyHybrid
    assert [type(layer) for layer in model.model.layers] == [DecoderLayer, _ScaleLayer]
    assert "ToyHybridForCausalLM" in supported_architectures()
    # the registered families are untouched
    assert type(build_model(llama).model.layers[1]) is DecoderLayer
