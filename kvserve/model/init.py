"""``kvserve init-model``: random-weight checkpoints in the standard Hugging Face layout.

Tiny shapes (a few MB, for CPU tests) use an untied LM head and a larger init scale
so that greedy outputs depend on the whole context; real-size shapes follow the
published configs (for GPU benchmarks). The tokenizer is a byte-level BPE trained
with the ``tokenizers`` library on a fixed built-in text, saved so
``AutoTokenizer.from_pretrained(dir)`` loads it. Deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.model.source import RANDOM_WEIGHTS_KEY, build_cache_folder, cache_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 512

# A short fixed text to learn merges from (any text works; this one is varied English).
_CORPUS = """The quick brown fox jumps over the lazy dog. A serving engine keeps the keys and
values of every token it has seen in a paged pool, shares prefixes between requests in a
radix tree, and gives every page back when a request finishes, aborts or is retracted.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. Once upon a time there was a little model that learned to
count: one, two, three, four, five, six, seven, eight, nine, ten. user: hi assistant: hello
system: You are a helpful assistant. Please answer briefly and clearly. 0123456789
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    architecture: str
    config: dict[str, Any]
    init_std: float
    tiny: bool


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0}

SHAPES: dict[str, Shape] = {
    "tiny-llama": Shape("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_parameters={**_LLAMA3_ROPE,
                                                    "original_max_position_embeddings": 256}),
        init_std=0.25, tiny=True),
    "tiny-qwen2": Shape("Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=4096,
        tie_word_embeddings=False), init_std=0.25, tiny=True),
    "tiny-qwen3": Shape("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=TINY_VOCAB,
        max_position_embeddings=4096, tie_word_embeddings=False), init_std=0.25, tiny=True),
    "qwen2.5-0.5b": Shape("Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True), init_std=0.02, tiny=False),
    "llama3-8b": Shape("LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False),
        init_std=0.02, tiny=False),
}


def hf_config(shape_name: str, eos_token_id: int = 0) -> Any:
    """The transformers config object of a shape."""
    import transformers

    shape = SHAPES[shape_name]
    cls = getattr(transformers, shape.architecture.replace("ForCausalLM", "Config"))
    return cls(architectures=[shape.architecture], eos_token_id=eos_token_id,
               bos_token_id=None, pad_token_id=None, **shape.config)


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) of ``TINY_VOCAB`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_state_dict(shape_name: str, seed: int = 0,
                      dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random weights of a shape, named as in the checkpoint; norms start at one."""
    from kvserve.model.config import ModelConfig
    from kvserve.model.registry import get_model_class

    shape = SHAPES[shape_name]
    config = ModelConfig.from_hf(hf_config(shape_name))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
        names = {k: v.shape for k, v in model.state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, size in names.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            t = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
            state[name] = (t * shape.init_std).to(dtype)
    return state


def init_model(out_dir: str | Path, shape_name: str, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files to ``out_dir``."""
    from safetensors.torch import save_file

    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose from {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = hf_config(shape_name, eos_token_id=eos_id)
    config.dtype = str(dtype).replace("torch.", "")
    setattr(config, RANDOM_WEIGHTS_KEY, True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = random_state_dict(shape_name, seed, dtype)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def default_model_dir() -> Path:
    """The tiny random-weight model, created once in the cache folder: the default model's
    fallback when SmolLM2-135M-Instruct is not installed (``kvserve.model.source``)."""
    path = cache_dir() / "tiny-llama-default"
    if not (path / "model.safetensors").is_file():
        build_cache_folder(path, lambda tmp: init_model(tmp, "tiny-llama", seed=0))
    return path
