import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.bench.workloads import load_mooncake_prompts, synthetic_multiturn_prompts
from kvserve.cli import main

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_conversation_trace.jsonl"
FIELDS = ["requests", "prompt_tokens", "hit_tokens", "hit_ratio", "seconds", "req_per_s",
          "gc_seconds", "bytes_per_cached_page"]


def parse(line):
    return dict(part.split("=", 1) for part in line.split())


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompts_follow_the_w1_expansion(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 100, "output_length": 3, "hash_ids": [0]},
    ])
    prompts = load_mooncake_prompts(trace, block=16)
    assert prompts[0] == list(range(0, 16)) + [16, 17, 18]  # ceil(600 * 16 / 512) = 19
    assert prompts[1] == list(range(0, 4))  # ceil(100 * 16 / 512) = 4
    assert load_mooncake_prompts(trace, block=16, limit=1) == prompts[:1]


def test_bench_on_a_small_trace_prints_one_exact_line(tmp_path, capsys):
    rows = [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [0, i + 1]}
            for i in range(3)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    assert main(["bench", "prefix-cache", trace, "--block", "16", "--page", "16"]) == 0
    out = capsys.readouterr()
    line = parse(out.out.strip())
    assert list(line) == FIELDS
    # 3 prompts of 32 tokens; the 2nd and 3rd hit block 0 (16 tokens each).
    assert (line["requests"], line["prompt_tokens"], line["hit_tokens"]) == ("3", "96", "32")
    assert "cache=RadixCache allocator=TokenToKVPoolAllocator" in out.err


def test_bench_with_eviction_skips_nothing_that_fits(tmp_path, capsys):
    rows = [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [i, i + 100]}
            for i in range(10)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    assert main(["bench", "prefix-cache", trace, "--page", "16", "--cap", "64"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert (line["requests"], line["hit_tokens"]) == ("10", "0")


def test_builtin_workload_is_deterministic_multiturn():
    a = synthetic_multiturn_prompts(num_conversations=5, turns=3, seed=1)
    assert a == synthetic_multiturn_prompts(num_conversations=5, turns=3, seed=1)
    assert len(a) == 15
    by_first = {}
    for prompt in a:  # later turns of a conversation extend an earlier prompt
        by_first.setdefault(tuple(prompt[:300]), []).append(prompt)
    assert any(len(group) > 1 for group in by_first.values())


def test_main_job_default_workload(capsys):
    assert main(["bench", "prefix-cache", "--limit", "200"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert line["requests"] == "200" and float(line["hit_ratio"]) > 0.5


@pytest.mark.skipif(not TRACE.exists(), reason="shared/ traces are not beside this checkout")
def test_conversation_trace_slice(capsys):
    assert main(["bench", "prefix-cache", str(TRACE), "--limit", "300", "--cap", "200000"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert line["requests"] == "300"
    assert 0.0 < float(line["hit_ratio"]) < 1.0


def test_bad_input_gives_clear_errors(tmp_path, capsys):
    assert main(["bench", "prefix-cache", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [0]}\n{"oops": 1}\n')
    assert main(["bench", "prefix-cache", str(bad)]) == 2
    assert "bad.jsonl:2: not a Mooncake trace row" in capsys.readouterr().err
    assert main(["bench", "prefix-cache", "--page", "16", "--cap", "8"]) == 2
    assert "holds no page" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["bench", "prefix-cache", "--page", "0"])
    assert err.value.code == 2


def test_console_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "prefix-cache",
                           "--limit", "20"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert parse(proc.stdout.strip())["requests"] == "20"


def test_bench_replay_small_trace_is_clean(tmp_path, capsys):
    rows = [{"timestamp": 1000 * (i // 2), "input_length": 2048, "output_length": 40,
             "hash_ids": [0, i % 3 + 1, i + 10, i + 100]} for i in range(12)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    assert main(["bench", "replay", trace, "--no-progress"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert list(line)[:10] == ["requests", "steps", "hit_ratio", "retractions", "aborts",
                               "checker_runs", "violations", "sched_us_per_step_p50",
                               "sched_us_per_step_p99", "checker_us_per_step_p50"]
    assert line["requests"] == "12" and line["violations"] == "0" and line["aborts"] == "0"
    assert line["checker_runs"] == line["steps"]
    # every request shares block 0 (64 tokens at block 16); later ones also hit block 1..3
    assert float(line["hit_ratio"]) > 0.3


def test_bench_replay_bad_trace(tmp_path, capsys):
    assert main(["bench", "replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["bench", "replay", str(empty)]) == 2
    assert "no requests" in capsys.readouterr().err


def test_bench_decode_steady_small(capsys):
    assert main(["bench", "decode-steady", "--batch", "8", "--prompt-len", "40",
                 "--steps", "5", "--cached-tokens", "320"]) == 0
    line = parse(capsys.readouterr().out.strip())
    assert line["batch"] == "8" and line["cached_tokens"] == "320"
    assert float(line["sched_us_per_decode_step_p50"]) > 0


def test_serve_port_beyond_65535_is_a_usage_error(capsys):
    """getaddrinfo wraps 70000 to 4464: ``--port 70000`` served on port 4464."""
    for port in ("70000", "-1"):
        with pytest.raises(SystemExit) as err:
            main(["serve", "--port", port])
        assert err.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"kvserve serve: error: argument --port: must be in [0, 65535], got {port}")
