#!/usr/bin/env python3
"""Overhead of the wire: the same workload through ``Engine`` in process and through
``kvserve serve`` over HTTP with streaming, from a client in another process.

    PYTHONPATH=. .venv/bin/python benchmarks/wire_overhead.py [--model DIR] [--out FILE]

Both sides run the same engine settings (page 16, the same pool, running-request
limit, chunked prefill and context, radix cache on) and the same requests: distinct
random prompts of 64-128 token ids (fixed seed, so the prefix cache makes neither side
cheaper), greedy, ``ignore_eos``, a fixed ``max_tokens``, so both generate exactly the
same number of tokens. Phases, in the same order on both sides:

- warm-up: ``concurrency`` requests of 2 tokens (opens the HTTP connections too);
- batch: ``--requests`` requests, ``--concurrency`` workers pulling the next request;
- low load: ``--low-load-requests`` requests one after another, ``--low-load-tokens``.

In process, worker threads call ``engine.generate_stream``; over HTTP, the client is
this script run as ``--client SPEC`` in a subprocess (httpx.AsyncClient, streaming
``/v1/completions`` with the prompt as token ids and ``stream_options.include_usage``).
TTFT is request start -> first chunk a streaming client sees (non-empty text or the
finish), the same rule on both sides. Rounds alternate (in process, HTTP, in process,
HTTP, ...) because the 2-core machine is noisy; each round uses fresh prompts.

Torch runs one intra-op thread on both sides by default (``--torch-threads``, given to
the server as ``OMP_NUM_THREADS``, which its engine process honours; without it the
engine process takes cores - 1). On the 2-core machine ``Engine``'s loop thread with
torch's default 2 threads ran decode steps about 4x slower than with one (2026-11-30),
which made the HTTP path look faster than the in-process one.

Reported per round: wall time and tokens each way, the wire cost in us per generated
token ((http_wall - inproc_wall) / tokens) and per request, the same in CPU time (all
three HTTP-side processes against the in-process run, from /proc; steadier than wall
time when other work shares the machine), TTFT p50/p90 each way at the batch
concurrency and at low load and the differences (added TTFT), the engine's median
decode step (scheduler + model seconds of the in-process run's decode steps)
and wire_us_per_token / decode_step_us. Prints a table, writes JSON to --out.

--dry-run: 8 requests, 4 concurrent, 4 tokens, 2 low-load requests, one round, a
small pool (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import Any

# This checkout's kvserve, also in the --client subprocess.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "wire"  # --served-model-name of the benchmark server


def process_tree_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root_pid`` ("root") and of all its
    descendants together ("children"), from /proc (Linux; zeros elsewhere)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    tree, frontier = set(), {root_pid}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - tree
    return {"root": cpu.get(root_pid, 0.0),
            "children": sum(cpu.get(pid, 0.0) for pid in tree - {root_pid})}


def summarize(name: str, wall_s: float, records: list[dict[str, Any]], concurrency: int,
              max_tokens: int) -> dict[str, Any]:
    """One phase's numbers from per-request records {ttft_s, e2e_s, tokens, finish}."""
    ttft = [r["ttft_s"] for r in records]
    finishes: dict[str, int] = {}
    for r in records:
        finishes[str(r["finish"])] = finishes.get(str(r["finish"]), 0) + 1
    return {"phase": name, "requests": len(records), "concurrency": concurrency,
            "max_tokens": max_tokens, "wall_s": wall_s,
            "completion_tokens": sum(r["tokens"] for r in records),
            "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else 0.0,
            "ttft_p90_ms": percentile(ttft, 90) * 1e3 if ttft else 0.0,
            "e2e_p50_ms": percentile([r["e2e_s"] for r in records], 50) * 1e3 if records
            else 0.0,
            "finish_reasons": finishes}


# -- workload ----------------------------------------------------------------------------
def make_prompts(num: int, seed: int, vocab_size: int, min_len: int = 64,
                 max_len: int = 128) -> list[list[int]]:
    """``num`` random token-id prompts of ``min_len``..``max_len`` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def make_spec(args: argparse.Namespace, vocab_size: int, round_index: int) -> dict[str, Any]:
    """The phases of one round (the same for both sides)."""
    seed = args.seed + 1000 * round_index
    return {"phases": [
        {"name": "warmup", "prompts": make_prompts(args.concurrency, seed + 1, vocab_size),
         "concurrency": args.concurrency, "max_tokens": 2},
        {"name": "batch", "prompts": make_prompts(args.requests, seed + 2, vocab_size),
         "concurrency": args.concurrency, "max_tokens": args.max_tokens},
        {"name": "low_load",
         "prompts": make_prompts(args.low_load_requests, seed + 3, vocab_size),
         "concurrency": 1, "max_tokens": args.low_load_tokens},
    ]}


# -- in process --------------------------------------------------------------------------
def _inproc_request(engine: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    last = None
    for last in engine.generate_stream(input_ids=prompt, sampling_params=params):
        if first is None and (last.delta or last.finish_reason is not None):
            first = time.perf_counter()
    end = time.perf_counter()
    assert last is not None and first is not None
    return {"ttft_s": first - start, "e2e_s": end - start, "tokens": last.completion_tokens,
            "finish": last.finish_reason}


def run_inproc_phase(engine: Any, phase: dict[str, Any]) -> dict[str, Any]:
    """``concurrency`` threads, each taking the next prompt until none is left."""
    prompts, max_tokens = phase["prompts"], phase["max_tokens"]
    records: list[dict[str, Any]] = [{} for _ in prompts]
    todo = iter(range(len(prompts)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                records[i] = _inproc_request(engine, prompts[i], max_tokens)
            except BaseException as err:
                errors.append(err)
                return

    threads = [threading.Thread(target=worker) for _ in range(phase["concurrency"])]
    start, cpu_start = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if errors:
        raise errors[0]
    result = summarize(phase["name"], wall, records, phase["concurrency"], max_tokens)
    result["cpu_s"] = {"process": cpu}  # engine thread + client threads
    return result


def decode_step_us(engine: Any, first_step: int, last_step: int) -> dict[str, Any]:
    """Median scheduler + model time of the decode steps in [first_step, last_step)."""
    stats = engine.scheduler.stats
    steps = [(stats.sched_seconds[i] + stats.model_seconds[i]) * 1e6
             for i in range(first_step, last_step) if stats.decode_step[i]]
    return {"decode_steps": len(steps),
            "decode_step_p50_us": percentile(steps, 50) if steps else 0.0,
            "decode_step_p90_us": percentile(steps, 90) if steps else 0.0}


def run_inproc(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for phase in spec["phases"]:
        first = len(engine.scheduler.stats.sched_seconds)
        phases[phase["name"]] = run_inproc_phase(engine, phase)
        if phase["name"] == "batch":
            last = len(engine.scheduler.stats.sched_seconds)
            phases["batch"].update(decode_step_us(engine, first, last))
    return phases


# -- over HTTP (the client runs in its own process) --------------------------------------
async def _http_request(client: Any, url: str, prompt: list[int],
                        max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = None
    finish = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            for choice in obj.get("choices") or ():
                if first is None and (choice["text"] or choice["finish_reason"]):
                    first = time.perf_counter()
                finish = choice["finish_reason"] or finish
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or tokens is None:
        raise RuntimeError("stream ended without text, finish or usage")
    return {"ttft_s": first - start, "e2e_s": end - start, "tokens": tokens, "finish": finish}


async def _http_phase(client: Any, url: str, phase: dict[str, Any]) -> dict[str, Any]:
    prompts, max_tokens = phase["prompts"], phase["max_tokens"]
    records: list[dict[str, Any]] = [{} for _ in prompts]
    todo = iter(range(len(prompts)))

    async def worker() -> None:
        for i in todo:  # one shared iterator: each worker takes the next request
            records[i] = await _http_request(client, url, prompts[i], max_tokens)

    server_pid = phase.get("server_pid")
    server_start = process_tree_cpu_s(server_pid) if server_pid else None
    start, cpu_start = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(phase["concurrency"])))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    result = summarize(phase["name"], wall, records, phase["concurrency"], max_tokens)
    result["cpu_s"] = {"client": cpu}
    if server_pid and server_start is not None:
        server_end = process_tree_cpu_s(server_pid)
        result["cpu_s"]["http_process"] = server_end["root"] - server_start["root"]
        result["cpu_s"]["engine_process"] = server_end["children"] - server_start["children"]
    return result


async def _http_client(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    import httpx

    most = max(p["concurrency"] for p in spec["phases"])
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        return {p["name"]: await _http_phase(client, url, p) for p in spec["phases"]}


def client_main(url: str, spec_path: str) -> int:
    """``--client URL --spec FILE``: run the phases over HTTP, print JSON on stdout."""
    spec = json.loads(Path(spec_path).read_text())
    print(json.dumps(asyncio.run(_http_client(url, spec))))
    return 0


def run_http(url: str, spec: dict[str, Any], workdir: Path, server_pid: int) -> dict[str, Any]:
    spec_path = workdir / "spec.json"
    phases_with_pid = [{**phase, "server_pid": server_pid} for phase in spec["phases"]]
    spec_path.write_text(json.dumps({**spec, "phases": phases_with_pid}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", url,
           "--spec", str(spec_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client failed ({done.returncode}):\n{done.stderr}")
    phases: dict[str, Any] = json.loads(done.stdout)
    return phases


# -- the benchmark -----------------------------------------------------------------------
def compare(inproc: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """The wire's cost in one round, from the two sides' phase summaries."""
    a, b = inproc["batch"], http["batch"]
    tokens = a["completion_tokens"]
    wire_s = b["wall_s"] - a["wall_s"]
    step_us = a["decode_step_p50_us"]
    wire_us_per_token = wire_s / tokens * 1e6 if tokens else 0.0
    http_cpu = sum(b["cpu_s"].values())

    def cpu_us_per_token(seconds: float) -> float:
        return seconds / tokens * 1e6 if tokens else 0.0
    return {
        "wire_us_per_token": wire_us_per_token,
        "wire_us_per_request": wire_s / a["requests"] * 1e6 if a["requests"] else 0.0,
        "inproc_us_per_token": a["wall_s"] / tokens * 1e6 if tokens else 0.0,
        "http_over_inproc_wall": b["wall_s"] / a["wall_s"] if a["wall_s"] else 0.0,
        "added_ttft_p50_ms_batch": b["ttft_p50_ms"] - a["ttft_p50_ms"],
        "added_ttft_p50_ms_low_load": (http["low_load"]["ttft_p50_ms"]
                                       - inproc["low_load"]["ttft_p50_ms"]),
        "decode_step_p50_us": step_us,
        "wire_per_token_over_decode_step": wire_us_per_token / step_us if step_us else 0.0,
        # CPU time is steadier than wall time on a shared machine: what the HTTP path
        # spends in all three processes beyond what the in-process run spends.
        "wire_cpu_us_per_token": cpu_us_per_token(http_cpu - a["cpu_s"]["process"]),
        "inproc_cpu_us_per_token": cpu_us_per_token(a["cpu_s"]["process"]),
        "http_engine_cpu_us_per_token": cpu_us_per_token(b["cpu_s"].get("engine_process", 0.0)),
        "http_server_cpu_us_per_token": cpu_us_per_token(b["cpu_s"].get("http_process", 0.0)),
        "http_client_cpu_us_per_token": cpu_us_per_token(b["cpu_s"]["client"]),
    }


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"page_size": 16, "max_total_tokens": args.max_total_tokens,
            "max_running_requests": args.max_running_requests,
            "chunked_prefill_size": args.chunked_prefill_size,
            "context_len": args.context_length, "device": "cpu",
            "disable_radix_cache": False}


def server_flags(model: Path, settings: dict[str, Any]) -> list[str]:
    return ["--model", str(model), "--device", settings["device"],
            "--page-size", str(settings["page_size"]),
            "--max-total-tokens", str(settings["max_total_tokens"]),
            "--max-running-requests", str(settings["max_running_requests"]),
            "--chunked-prefill-size", str(settings["chunked_prefill_size"]),
            "--context-length", str(settings["context_len"])]


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def print_table(report: dict[str, Any]) -> None:
    print("round | path    | wall s | tokens | tok/s  | TTFT p50/p90 ms (batch) "
          "| low-load TTFT p50 ms")
    for i, rnd in enumerate(report["rounds"]):
        for side in ("inproc", "http"):
            b, low = rnd[side]["batch"], rnd[side]["low_load"]
            print(f"{i:5d} | {side:7s} | {b['wall_s']:6.2f} | {b['completion_tokens']:6d} | "
                  f"{b['completion_tokens'] / max(b['wall_s'], 1e-9):6.0f} | "
                  f"{b['ttft_p50_ms']:8.1f} / {b['ttft_p90_ms']:8.1f}      | "
                  f"{low['ttft_p50_ms']:8.2f}")
    print("round | wire us/token | wire us/request | added TTFT ms batch / low load "
          "| decode step us | wire/step")
    for i, rnd in enumerate(report["rounds"]):
        c = rnd["compare"]
        print(f"{i:5d} | {c['wire_us_per_token']:13.1f} | {c['wire_us_per_request']:15.0f} | "
              f"{c['added_ttft_p50_ms_batch']:9.2f} / {c['added_ttft_p50_ms_low_load']:8.2f}"
              f"          | {c['decode_step_p50_us']:14.0f} | "
              f"{c['wire_per_token_over_decode_step']:9.3f}")
    print("round | CPU us/token: in process | over HTTP: engine + server + client "
          "| wire CPU us/token")
    for i, rnd in enumerate(report["rounds"]):
        c = rnd["compare"]
        print(f"{i:5d} | {c['inproc_cpu_us_per_token']:24.0f} | "
              f"{c['http_engine_cpu_us_per_token']:6.0f} + "
              f"{c['http_server_cpu_us_per_token']:6.0f} + "
              f"{c['http_client_cpu_us_per_token']:6.0f}        | "
              f"{c['wire_cpu_us_per_token']:17.0f}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import torch

    from kvserve.engine import Engine
    from kvserve.model.init import default_model_dir
    from kvserve.server.process import ServerProcess

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model = Path(args.model) if args.model else default_model_dir()
    vocab_size = int(json.loads((model / "config.json").read_text())["vocab_size"])
    settings = engine_settings(args)
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-wire-") as tmp:
        workdir = Path(tmp)
        # torch_threads: the engine process inherits it; torch reads it at import
        threads = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}
        server = ServerProcess(
            ["--served-model-name", MODEL_NAME, "--enable-debug-endpoints",
             *server_flags(model, settings)], workdir / "server.log",
            env={"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT),
                                                           os.environ.get("PYTHONPATH")) if p),
                 **threads})
        server.launch()
        engine = None
        try:
            engine = Engine(model_path=model, page_size=settings["page_size"],
                            max_total_tokens=settings["max_total_tokens"],
                            max_running_requests=settings["max_running_requests"],
                            chunked_prefill_size=settings["chunked_prefill_size"],
                            context_len=settings["context_len"], device=settings["device"])
            server.wait_healthy(180)
            for r in range(args.rounds):
                spec = make_spec(args, vocab_size, r)
                inproc = run_inproc(engine, spec)
                assert server.proc is not None
                http = run_http(server.url, spec, workdir, server.proc.pid)
                rounds.append({"inproc": inproc, "http": http,
                               "compare": compare(inproc, http)})
            server_check = httpx.get(server.url + "/debug/check", timeout=60).json()
            inproc_violations = engine.scheduler.stats.violations
        finally:
            if engine is not None:
                engine.shutdown()
            server_code = server.stop(60)
    summary = {key: statistics.median(rnd["compare"][key] for rnd in rounds)
               for key in rounds[0]["compare"]}
    return {
        "benchmark": "wire_overhead", "date": date.today().isoformat(), "commit": _commit(),
        "dry_run": args.dry_run, "model": str(model),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "engine": settings,
        "workload": {"requests": args.requests, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "prompt_tokens": [64, 128],
                     "low_load_requests": args.low_load_requests,
                     "low_load_tokens": args.low_load_tokens, "rounds": args.rounds,
                     "seed": args.seed, "torch_threads": args.torch_threads},
        "rounds": rounds, "summary": summary,
        "checks": {"server_ok": bool(server_check.get("ok")),
                   "server_idle": bool(server_check.get("idle")),
                   "server_exit_code": server_code, "inproc_violations": inproc_violations},
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", help="checkpoint folder (default: the tiny default model)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "wire_overhead.json"))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--low-load-requests", type=int, default=32)
    p.add_argument("--low-load-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads on both sides; 0: torch's default (see the "
                   "module docstring)")
    p.add_argument("--dry-run", action="store_true",
                   help="8 requests, 4 concurrent, 4 tokens, one round (smoke test)")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.requests, args.concurrency, args.max_tokens = 8, 4, 4
        args.low_load_requests, args.low_load_tokens, args.rounds = 2, 2, 1
        args.max_total_tokens, args.max_running_requests = 8192, 8
    if args.max_running_requests < args.concurrency:
        p.error("--max-running-requests must be at least --concurrency")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args.client, args.spec)
    report = run(args)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
