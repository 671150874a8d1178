"""GGUF checkpoints (llama.cpp's single-file format): ``convert_gguf`` turns a ``.gguf``
file of a supported family into a Hugging Face checkpoint folder that
``kvserve.model.loader`` loads, the way vLLM and SGLang load GGUF through transformers'
metadata mapping.

What it writes: ``config.json`` (``architectures`` set, no quantization config),
``model.safetensors`` (every tensor dequantized to float32 by the ``gguf`` library's
reference dequantizers, through transformers' ``load_gguf_checkpoint``, which also undoes
llama.cpp's q/k row permutation for Llama) and the tokenizer files with the chat template,
all from the GGUF metadata. BOS/EOS/PAD/UNK come from ``tokenizer.ggml.*_token_id`` (the
engine stops at ``config.eos_token_id``). Llama 3 rope scaling, which llama.cpp stores as
a ``rope_freqs`` tensor, becomes transformers' ``llama3`` rope parameters (checked against
the tensor); other GGUF rope scaling is refused.

Cache: ``$KVSERVE_CACHE/gguf/<file stem>-<key>/`` (``KVSERVE_CACHE`` defaults to
``~/.cache/kvserve``); ``<key>`` hashes the file's name, size and its first and last MiB
(the header holds the metadata and tensor index), so an edited or replaced file is
converted again, while a reinstall of the same file (a fresh venv: a new modification
time) reuses the conversion. The first load converts (SmolLM2-135M: about
half a minute on 2 CPU cores, 540 MB on disk) and says so on stderr; later loads read the
folder. The conversion writes into a temporary folder beside it and renames it into place,
so an interrupted one leaves no half folder. Clear the cache with
``rm -rf ~/.cache/kvserve/gguf`` (or one folder of it).

Needs the ``gguf`` package (``pip install 'kvserve[gguf]'``); imported only here, so
``import kvserve`` and ``Engine`` work without it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model.errors import ModelLoadError
from kvserve.model.source import build_cache_folder, cache_dir

# general.architecture -> the transformers class kvserve serves it with
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Tensor types whose gguf-py dequantizer is used (and tested: quantize/dequantize round
# trip where gguf-py has a quantizer, shape and finiteness for the K-quants).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Bump when the folder layout changes: old cache entries are then converted again.
_FORMAT = 1
_KEY_BYTES = 1 << 20  # bytes at each end of a .gguf file its cache key hashes
SOURCE_KEY = "kvserve_gguf_source"  # config.json: the .gguf file the folder came from


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What ``inspect_gguf`` read from a file's metadata (no tensor data).

    Attributes:
        path: the ``.gguf`` file.
        gguf_architecture: ``general.architecture`` (``llama``, ``qwen2``, ``qwen3``).
        architecture: the transformers class name it is served as.
        tensor_types: the GGML tensor types it holds, sorted.
        special_ids: ``bos``/``eos``/``pad``/``unk`` -> token id, those the file names.
        head_dim: ``<arch>.attention.key_length`` when the file gives it, else None.
        rope_freqs: the ``rope_freqs.weight`` tensor (llama.cpp's Llama 3 rope scaling:
            per-frequency divisors of the inverse frequencies), or None.
    """

    path: Path
    gguf_architecture: str
    architecture: str
    tensor_types: tuple[str, ...]
    special_ids: dict[str, int]
    head_dim: int | None
    rope_freqs: tuple[float, ...] | None = None


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as err:
        raise ModelLoadError("loading a .gguf file needs the gguf package: "
                             "pip install 'kvserve[gguf]' (or pip install gguf)") from err
    return gguf


def _field(reader: Any, path: Path, key: str, kind: type[str] | type[int]) -> Any:
    """The metadata value ``key`` (a ``kind``: str, or int >= 0: ids, counts, lengths), or
    None when the file lacks it.

    Raises ModelLoadError when the value has another type or sign, or a string is not
    UTF-8."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except UnicodeDecodeError:
        value = None
    # bool is an int in Python, not in GGUF
    if not isinstance(value, kind) or isinstance(value, bool) or (
            isinstance(value, int) and value < 0):
        what = "a UTF-8 string" if kind is str else "a non-negative integer"
        raise ModelLoadError(f"GGUF metadata {key} of {path} is not {what}")
    return value


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Read and validate a ``.gguf`` file's metadata (tensor data is not read).

    Raises ModelLoadError (one line) for a file that cannot be read, a truncated file or
    one that is not GGUF, a split (multi-file) GGUF, an unsupported ``general.architecture``
    or tensor type, GGUF rope scaling other than Llama's ``rope_freqs`` tensor
    (``rope.scaling.type``), a file without a tokenizer, and a special token id outside
    its vocabulary.
    """
    gguf = _import_gguf()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror or err}") from err
    except (ValueError, IndexError, KeyError) as err:
        # gguf-py raises ValueError on a bad magic and on every truncation we tried
        raise ModelLoadError(f"truncated or not a GGUF file: {path}") from err
    arch = _field(reader, path, "general.architecture", str)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if arch is None:
        raise ModelLoadError(f"{path} has no general.architecture (not a model GGUF)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} of {path} is not supported "
                             f"(supported: {supported})")
    if (_field(reader, path, "split.count", int) or 1) > 1:
        raise ModelLoadError(f"{path} is one part of a split GGUF; split files are not "
                             "supported (merge them with llama.cpp's gguf-split --merge)")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    bad = [t for t in types if t not in SUPPORTED_TENSOR_TYPES]
    if bad:
        first = next(t.name for t in reader.tensors if t.tensor_type.name == bad[0])
        raise ModelLoadError(f"GGUF tensor type {', '.join(bad)} of {path} is not supported "
                             f"(first: {first}; supported: "
                             f"{', '.join(SUPPORTED_TENSOR_TYPES)})")
    scaling = _field(reader, path, f"{arch}.rope.scaling.type", str)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and (arch != "llama" or freqs.tensor_type.name != "F32"):
        scaling = "rope_freqs"
    if scaling not in (None, "none"):
        # transformers' GGUF mapping drops these; serving without them is silently wrong
        raise ModelLoadError(f"GGUF rope scaling {scaling} of {path} is not supported "
                             "(load the Hugging Face checkpoint instead)")
    if _field(reader, path, "tokenizer.ggml.model", str) is None:
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.ggml.model)")
    special = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id"), ("unk", "unknown_token_id")):
        value = _field(reader, path, f"tokenizer.ggml.{key}", int)
        if value is not None:
            special[name] = value
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:  # an id past the vocabulary is never sampled: EOS would not stop
        for name, token_id in special.items():
            if token_id >= len(tokens.data):
                raise ModelLoadError(f"GGUF {name} token id {token_id} of {path} is outside "
                                     f"its vocabulary ({len(tokens.data)} tokens)")
    head_dim = _field(reader, path, f"{arch}.attention.key_length", int)
    rope_freqs = None if freqs is None else tuple(float(x) for x in freqs.data.ravel())
    return GGUFInfo(path, arch, SUPPORTED_ARCHITECTURES[arch], tuple(types), special,
                    head_dim, rope_freqs)


# The Llama 3.1/3.2 rope scaling constants (only ``factor`` differs between them)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def llama3_rope_parameters(config: Any, rope_freqs: tuple[float, ...],
                           path: Path) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for a Llama GGUF with a ``rope_freqs`` tensor.

    llama.cpp stores Llama 3 rope scaling as per-frequency divisors of the inverse
    frequencies; GGUF keeps no parameters. The published Llama 3 constants with
    ``factor = max(rope_freqs)`` are checked to give the same divisors (relative 1e-5),
    so the served frequencies are the file's. Raises ModelLoadError when they do not.
    """
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = float(config.rope_parameters["rope_theta"])
    factor = max(rope_freqs)
    if factor <= 1.0:  # all ones: plain rope
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **_LLAMA3_ROPE}
    saved = config.rope_parameters
    config.rope_parameters = params
    try:
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    finally:
        config.rope_parameters = saved
    dim = scaled.numel() * 2
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    got = torch.tensor(rope_freqs, dtype=torch.float64)
    if got.numel() != scaled.numel() or not torch.allclose(
            plain / scaled.double(), got, rtol=1e-5, atol=0.0):
        raise ModelLoadError(f"GGUF rope scaling rope_freqs of {path} is not Llama 3's "
                             f"(factor {factor:g}, low/high frequency factors 1/4, original "
                             "context 8192); not supported")
    return params


def converted_dir(path: str | Path) -> Path:
    """The cache folder ``path`` converts to (``$KVSERVE_CACHE/gguf/<stem>-<key>``).

    Raises ModelLoadError when the file cannot be read."""
    path = Path(path)
    digest = hashlib.sha256(f"{_FORMAT}\0{path.name}\0".encode())
    try:
        size = path.stat().st_size
        with path.open("rb") as f:  # the header (metadata, tensor index) and the tail
            digest.update(f"{size}\0".encode() + f.read(_KEY_BYTES))
            f.seek(max(size - _KEY_BYTES, 0))
            digest.update(f.read(_KEY_BYTES))
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror or err}") from err
    return cache_dir() / "gguf" / f"{path.stem}-{digest.hexdigest()[:12]}"


def convert_gguf(path: str | Path) -> Path:
    """The Hugging Face checkpoint folder of a ``.gguf`` file, converted on first use.

    Returns the cache folder (see the module docstring). Raises ModelLoadError (one line)
    for what ``inspect_gguf`` refuses, and when transformers cannot map the file or the
    cache cannot be written.
    """
    path = Path(path)
    out = converted_dir(path)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    info = inspect_gguf(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ModelLoadError(f"cannot write the GGUF cache {out.parent}: "
                             f"{err.strerror or err}") from err
    print(f"kvserve: converting {path.name} to float32 safetensors in {out} (once; "
          f"clear with: rm -rf {out})", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        build_cache_folder(out, lambda tmp: _write_folder(info, tmp))
    except OSError as err:
        raise ModelLoadError(f"cannot write the GGUF cache {out}: "
                             f"{err.strerror or err}") from err
    except ModelLoadError:
        raise
    except (ValueError, KeyError, AttributeError, TypeError, RuntimeError) as err:
        # transformers' GGUF mapping fails on metadata it does not expect
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelLoadError(f"cannot convert {path}: {reason}") from err
    print(f"kvserve: converted {path.name} in {time.monotonic() - start:.1f} s",
          file=sys.stderr, flush=True)
    return out


def _write_folder(info: GGUFInfo, out: Path) -> None:
    """config.json, model.safetensors (float32) and tokenizer files of ``info.path``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(info.path.parent), info.path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [info.architecture]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are written dequantized
    if info.head_dim is not None:
        config.head_dim = info.head_dim  # transformers maps it for llama only
    if info.rope_freqs is not None:  # transformers' GGUF mapping drops it
        config.rope_parameters = llama3_rope_parameters(config, info.rope_freqs, info.path)
    for which, token_id in info.special_ids.items():
        if which != "unk":
            setattr(config, f"{which}_token_id", token_id)
    setattr(config, SOURCE_KEY, str(info.path.absolute()))
    with torch.device("meta"):  # names and shapes only: the tensors come from the file
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(info.path), return_tensors=True,
                                  model_to_load=skeleton, torch_dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in loaded["tensors"].items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers' GGUF tokenizer guesses the special tokens (SmolLM2: EOS <|im_start|>);
    # the file's ids are what llama.cpp uses
    vocab = tokenizer.convert_ids_to_tokens(list(info.special_ids.values()))
    for which, token in zip(info.special_ids, vocab, strict=True):
        setattr(tokenizer, f"{which}_token", token)
    # clean-up rewrites " ," and " 's" in decoded text; byte-level BPE must not
    tokenizer.clean_up_tokenization_spaces = False
    out.mkdir(parents=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "kvserve_gguf.json").write_text(json.dumps(
        {"source": str(info.path.absolute()), "architecture": info.gguf_architecture,
         "tensor_types": list(info.tensor_types)}, indent=2) + "\n")
