"""Load a local Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer).

No network access: transformers is asked for local files only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvserve.model.config import ModelConfig, ModelLoadError
from kvserve.model.layers import CausalLM, RotaryEmbedding
from kvserve.model.registry import get_model_class

PROBE_TEXT = "Hello, world"  # the tokenizer must encode it to tokens and decode it back
TOKENIZER_FILES = ("tokenizer.json, or tokenizer_config.json with vocab.json+merges.txt "
                   "or tokenizer.model")  # what transformers builds a tokenizer from


def load_config(model_dir: str | Path) -> ModelConfig:
    """Raises ModelLoadError for a missing folder or config, or an unsupported architecture."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    try:
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {err}") from err
    return ModelConfig.from_hf(hf)


def build_model(config: ModelConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> CausalLM:
    """The registered class of ``config.architecture`` with uninitialised weights on
    ``device`` (rotary tables computed). Raises ModelLoadError for an unknown one."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb = RotaryEmbedding(config).to(device)  # float32, not meta
    return model.eval()


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[CausalLM, ModelConfig]:
    """Model and config from a checkpoint folder.

    Raises ModelLoadError for a missing folder, config or weights, an unsupported
    architecture, and missing, unexpected or wrongly shaped tensors.
    """
    from safetensors.torch import load_file

    config = load_config(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = build_model(config, device, dtype)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}")
        if unexpected:
            details.append(f"unexpected {unexpected[:5]}")
        for k in wrong[:5]:
            details.append(f"{k}: checkpoint {tuple(state[k].shape)}, model "
                           f"{tuple(expected[k].shape)}")
        raise ModelLoadError(f"weights of {model_dir} do not fit {config.architecture}: "
                             + "; ".join(details))
    model.load_state_dict(state, strict=True)
    return model, config


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer (transformers, local files only), checked as a server
    must before it serves: ``PROBE_TEXT`` encodes to a non-empty sequence that decodes
    back (case and surrounding spaces aside). Raises ModelLoadError (one line naming the
    files looked for) otherwise; a missing chat template is ``chat_prompt_ids``' to fill."""
    from transformers import AutoTokenizer

    found = ", ".join(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else ""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # transformers raises OSError, ValueError, TypeError... here
        raise ModelLoadError(f"no tokenizer in {folder}: expected {TOKENIZER_FILES} "
                             f"(found: {found or 'nothing'})") from None
    ids = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    if not ids:
        raise ModelLoadError(f"the tokenizer in {folder} encodes {PROBE_TEXT!r} to no "
                             f"tokens (files: {found})")
    back = str(tokenizer.decode(ids, skip_special_tokens=True))
    if back.strip().lower() != PROBE_TEXT.lower():
        raise ModelLoadError(f"the tokenizer in {folder} decodes {PROBE_TEXT!r} back as "
                             f"{back!r} (files: {found})")
    return tokenizer
