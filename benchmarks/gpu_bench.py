#!/usr/bin/env python3
"""W3: engine throughput with a real model forward, kvserve against transformers `generate`.

    PYTHONPATH=. python benchmarks/gpu_bench.py [--out DIR] [--dry-run]

Builds random weights directly on the device for both engines (same tensors), then:
- correctness in bf16: first generated tokens equal to transformers wherever its
  top-1 / top-2 logit margin exceeds 0.5, and the relative L2 error of the first-step
  logits under 2e-2;
- W3 (../shared/bench/README.md): 512 prompt tokens (random ids), 128 greedy output
  tokens (`ignore_eos`), `qwen2.5-0.5b` at batch 1, 64, 256 and `llama3-8b` at 1, 64;
  prefill tokens/s and % of the measured bf16 matmul peak, decode median step time
  and % of the decode roofline ((weight + KV bytes) / measured copy bandwidth),
  end-to-end tokens/s, and transformers `generate` tokens/s;
- prints a table and writes JSON to --out (default: $OUT, else benchmarks/out).

--dry-run runs the same code on CPU in float32 with the tiny shapes and small sizes
(part of the test suite); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.mem.pools import build_pools
from kvserve.model.config import ModelConfig
from kvserve.model.init import hf_config, random_state_dict
from kvserve.model.loader import build_model
from kvserve.model.runner import ModelRunner
from kvserve.sched.req import SamplingParams
from kvserve.sched.scheduler import Scheduler, SchedulerConfig

FULL = {"points": [("qwen2.5-0.5b", 1), ("qwen2.5-0.5b", 64), ("qwen2.5-0.5b", 256),
                   ("llama3-8b", 1), ("llama3-8b", 64)],
        "prompt": 512, "output": 128, "dtype": torch.bfloat16}
DRY = {"points": [("tiny-qwen2", 1), ("tiny-qwen2", 4), ("tiny-llama", 2)],
       "prompt": 32, "output": 8, "dtype": torch.float32}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes read + written per second of a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def matmul_peak(device: str, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def build_models(shape: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    state = random_state_dict(shape, seed=0, dtype=dtype, device=device)
    config = ModelConfig.from_hf(hf_config(shape))
    ours = build_model(config, device, dtype)
    ours.load_state_dict(state, strict=True)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(shape), dtype=dtype,
                                              attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return config, ours, hf.eval(), state


def engine(config: ModelConfig, model, batch: int, args, device: str, dtype: torch.dtype):
    context = args["prompt"] + args["output"] + 16
    pools = build_pools(batch, context, batch * context + 1024, 16, config.kv_layout(dtype),
                        device=device)
    runner = ModelRunner(model, config, pools)
    sched = Scheduler(SchedulerConfig(page_size=16, context_len=context,
                                      max_running_requests=batch, chunked_prefill_size=8192,
                                      max_prefill_tokens=max(16384, args["prompt"])),
                      pools, runner)
    return runner, sched


def check_correctness(config, ours, hf, device, dtype, args) -> dict:
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, min(config.vocab_size, 30000), (4, args["prompt"]),
                            generator=gen)
    runner, sched = engine(config, ours, 4, args, device, dtype)
    reqs = [sched.add_request(p.tolist(), SamplingParams(max_new_tokens=1, temperature=0))
            for p in prompts]
    logits_by_req = {}

    def capture(batch, logits):
        ends = (torch.cumsum(batch.seq_lens - batch.prefix_lens, 0) - 1).tolist()
        for i, end in enumerate(ends):
            if bool(batch.sample[i]):
                logits_by_req[int(batch.req_pool_indices[i])] = logits[end].float().cpu()

    runner.capture_logits = capture
    rows = {}
    sched.on_launch = lambda b: rows.update({int(r.kv.row): r.rid for r in b.reqs})
    sched.run_until_idle()
    by_rid = {rows[row]: lg for row, lg in logits_by_req.items()}
    with torch.no_grad():
        ref = hf(prompts.to(device)).logits[:, -1].float().cpu()
    agree = checked = 0
    errors = []
    for i, req in enumerate(reqs):
        ours_logits = by_rid[req.rid]
        errors.append(float((ours_logits - ref[i]).norm() / ref[i].norm()))
        top2 = ref[i].topk(2).values
        if float(top2[0] - top2[1]) > 0.5:
            checked += 1
            agree += int(req.output_ids[0] == int(ref[i].argmax()))
    return {"rel_l2_first_logits_max": max(errors), "first_tokens_checked": checked,
            "first_tokens_equal": agree,
            "ok": max(errors) < 2e-2 and agree == checked}


def run_kvserve(config, ours, batch, args, device, dtype) -> dict:
    _, sched = engine(config, ours, batch, args, device, dtype)
    gen = torch.Generator().manual_seed(2)
    for _ in range(batch):
        ids = torch.randint(100, min(config.vocab_size, 30000), (args["prompt"],), generator=gen)
        sched.add_request(ids.tolist(), SamplingParams(max_new_tokens=args["output"],
                                                       ignore_eos=True, temperature=0))
    sync(device)
    start = time.perf_counter()
    step_times = []
    while not sched.is_idle:
        t0 = time.perf_counter()
        sched.step()
        sync(device)
        step_times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    decode = [t for t, d in zip(step_times, sched.stats.decode_step, strict=True) if d]
    prefill = [t for t, d in zip(step_times, sched.stats.decode_step, strict=True) if not d]
    return {"wall_s": wall, "e2e_tok_s": batch * args["output"] / wall,
            "prefill_s": sum(prefill), "prefill_tok_s": batch * args["prompt"] / sum(prefill),
            "decode_step_ms_p50": statistics.median(decode) * 1e3 if decode else float("nan"),
            "decode_steps": len(decode)}


def run_hf(hf, config, batch, args, device) -> dict:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(100, min(config.vocab_size, 30000), (batch, args["prompt"]),
                        generator=gen).to(device)
    with torch.no_grad():
        mask = torch.ones_like(ids)
        hf.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2,
                    do_sample=False, pad_token_id=0)  # warm up
        sync(device)
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=args["output"],
                    min_new_tokens=args["output"], do_sample=False, eos_token_id=None,
                    pad_token_id=0)
        sync(device)
    wall = time.perf_counter() - start
    return {"hf_tok_s": batch * args["output"] / wall, "hf_wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/out")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    args = DRY if a.dry_run else FULL
    device = "cpu" if a.dry_run else "cuda"
    dtype = args["dtype"]
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    ceilings = {"copy_bytes_per_s": copy_bandwidth(device, 1 << (24 if a.dry_run else 30)),
                "matmul_flops": matmul_peak(device, 256 if a.dry_run else 8192, dtype)}
    results = []
    for shape in dict.fromkeys(s for s, _ in args["points"]):
        config, ours, hf, state = build_models(shape, device, dtype)
        weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
        params = sum(t.numel() for t in state.values())
        check = check_correctness(config, ours, hf, device, dtype, args)
        for s, batch in args["points"]:
            if s != shape:
                continue
            row = {"shape": shape, "batch": batch, **check,
                   **run_kvserve(config, ours, batch, args, device, dtype),
                   **run_hf(hf, config, batch, args, device)}
            avg_seq = args["prompt"] + args["output"] / 2
            kv_bytes = (batch * avg_seq * config.num_layers * 2 * config.num_kv_heads
                        * config.head_dim * torch.tensor([], dtype=dtype).element_size())
            floor_s = (weight_bytes + kv_bytes) / ceilings["copy_bytes_per_s"]
            row["decode_roofline_pct"] = 100 * floor_s / (row["decode_step_ms_p50"] / 1e3)
            row["prefill_matmul_pct"] = 100 * (2 * params * batch * args["prompt"]
                                               / row["prefill_s"]) / ceilings["matmul_flops"]
            row["speedup_vs_hf"] = row["e2e_tok_s"] / row["hf_tok_s"]
            results.append(row)
        del ours, hf, state
    header = ("shape", "batch", "prefill_tok_s", "prefill_matmul_pct", "decode_step_ms_p50",
              "decode_roofline_pct", "e2e_tok_s", "hf_tok_s", "speedup_vs_hf",
              "rel_l2_first_logits_max", "ok")
    print(" | ".join(header))
    for row in results:
        print(" | ".join(f"{row[h]:.4g}" if isinstance(row[h], float) else str(row[h])
                         for h in header))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dry_run": a.dry_run, "ceilings": ceilings, "results": results}
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'gpu_bench.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
