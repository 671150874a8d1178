import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


def test_gpu_bench_dry_run_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["dry_run"] and report["device"] == "cpu"
    rows = report["results"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("tiny-qwen2", 1), ("tiny-qwen2", 4),
                                                        ("tiny-llama", 2)]
    for row in rows:
        assert row["ok"] and row["rel_l2_first_logits_max"] < 2e-2
        assert row["decode_steps"] == 7  # 8 output tokens: 1 from prefill, 7 decode steps
        for key in ("prefill_tok_s", "decode_roofline_pct", "e2e_tok_s", "hf_tok_s"):
            assert row[key] > 0
    assert "shape | batch" in capsys.readouterr().out
