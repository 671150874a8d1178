"""Smoke test of benchmarks/wire_overhead.py --dry-run: both paths run the same small
workload and count exactly the requests and tokens asked for (no timing asserted)."""

import importlib.util
import json
from pathlib import Path

from kvserve.model.init import init_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "wire_overhead.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("wire_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wire_overhead_dry_run_counts_every_request_and_token(tmp_path, capsys):
    model = init_model(tmp_path / "tiny-llama", "tiny-llama", seed=0)
    out = tmp_path / "wire.json"
    assert _load_script().main(["--dry-run", "--model", str(model), "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    assert report["dry_run"] and report["engine"]["page_size"] == 16
    assert report["workload"]["requests"] == 8 and report["workload"]["concurrency"] == 4
    assert len(report["rounds"]) == 1
    expected = {"warmup": (4, 4, 2), "batch": (8, 4, 4), "low_load": (2, 1, 2)}
    for side in ("inproc", "http"):
        phases = report["rounds"][0][side]
        assert set(phases) == set(expected)
        for name, (requests, concurrency, max_tokens) in expected.items():
            phase = phases[name]
            assert phase["requests"] == requests and phase["concurrency"] == concurrency
            assert phase["completion_tokens"] == requests * max_tokens  # ignore_eos
            assert phase["finish_reasons"] == {"length": requests}
            for key in ("wall_s", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms"):
                assert phase[key] > 0
    batch = report["rounds"][0]["inproc"]["batch"]
    assert batch["decode_steps"] > 0 and batch["decode_step_p50_us"] > 0
    for key in ("wire_us_per_token", "wire_us_per_request", "inproc_us_per_token",
                "added_ttft_p50_ms_batch", "added_ttft_p50_ms_low_load", "decode_step_p50_us",
                "wire_per_token_over_decode_step"):
        assert isinstance(report["summary"][key], float)
        assert report["summary"][key] == report["rounds"][0]["compare"][key]
    assert report["checks"] == {"server_ok": True, "server_idle": True, "server_exit_code": 0,
                                "inproc_violations": 0}
    assert len(report["machine"]["loadavg_before"]) == 3
    assert "wire us/token" in capsys.readouterr().out
