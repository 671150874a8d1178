#!/usr/bin/env python3
"""W1 side by side: kvserve's prefix cache against SGLang and vLLM, in one run.

    V_SGL=$(../shared/bench/setup_sglang_peer.sh) V_VLLM=$(../shared/bench/setup_vllm_peer.sh)
    python benchmarks/w1_side_by_side.py --sglang $V_SGL --vllm $V_VLLM --repeat 3

Runs every standard point (conversation trace, page 16, cap 200k and 2M, block
16 and 24) for kvserve (``kvserve bench prefix-cache``), SGLang's default
``UnifiedRadixCache`` on its Rust core and vLLM's v1 prefix caching, interleaved
so machine noise hits all three alike, then prints median req/s, hit ratios and
kvserve's ratio against each peer as a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def parse_line(text: str) -> dict[str, str]:
    for line in text.splitlines()[::-1]:
        if "req_per_s=" in line:
            return dict(part.split("=", 1) for part in line.split() if "=" in part)
    raise RuntimeError(f"no result line in:\n{text}")


def run(cmd: list[str]) -> dict[str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return parse_line(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", help="SGLang peer venv (setup_sglang_peer.sh)")
    ap.add_argument("--vllm", help="vLLM peer venv (setup_vllm_peer.sh)")
    ap.add_argument("--trace",
                    default=str(SHARED / "data/traces/mooncake_conversation_trace.jsonl"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0)
    a = ap.parse_args()
    points = [(16, 200_000), (16, 2_000_000), (24, 200_000), (24, 2_000_000)]
    engines: dict[str, list[str]] = {
        "kvserve": [sys.executable, "-m", "kvserve.cli", "bench", "prefix-cache", a.trace],
    }
    if a.sglang:
        engines["sglang-unified-rust"] = [f"{a.sglang}/bin/python",
                                          str(SHARED / "bench/peer_sglang_unified.py"), a.trace]
    if a.vllm:
        engines["vllm"] = [f"{a.vllm}/bin/python", str(SHARED / "bench/peer_vllm_prefix.py"),
                           a.trace]
    results: dict[tuple[str, int, int], list[dict[str, str]]] = {}
    for block, cap in points:
        for _ in range(a.repeat):
            for name, base in engines.items():
                cmd = [*base, "--block", str(block), "--page", "16", "--cap", str(cap)]
                if a.limit:
                    cmd += ["--limit", str(a.limit)]
                res = run(cmd)
                results.setdefault((name, block, cap), []).append(res)
                fields = " ".join(f"{k}={v}" for k, v in res.items())
                print(f"block={block} cap={cap} {name}: {fields}", file=sys.stderr, flush=True)
    print("| block | cap | engine | req/s (median) | runs | hit ratio | kvserve ratio |")
    print("|---:|---:|---|---:|---|---:|---:|")
    for block, cap in points:
        ours = statistics.median(float(r["req_per_s"]) for r in results[("kvserve", block, cap)])
        for name in engines:
            rows = results[(name, block, cap)]
            rps = [float(r["req_per_s"]) for r in rows]
            med = statistics.median(rps)
            ratio = "" if name == "kvserve" else f"{ours / med:.2f}x"
            runs = ", ".join(f"{x:,.0f}" for x in rps)
            print(f"| {block} | {cap:,} | {name} | {med:,.0f} | {runs} "
                  f"| {rows[0]['hit_ratio']} | {ratio} |")
    for block, cap in points:
        r = results[("kvserve", block, cap)][0]
        print(f"kvserve block={block} cap={cap}: gc_seconds={r['gc_seconds']} "
              f"bytes_per_cached_page={r['bytes_per_cached_page']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
