"""W2: the whole scheduler on a trace or in steady decode, behind the scripted model or a
real checkpoint.

``replay_trace``: a Mooncake trace turned into requests (prompts as W1 with
``block`` tokens per hash id; output ``max(1, ceil(output_length / 8))``
tokens, ``ignore_eos`` so lengths are exact), one scheduler step per second of
trace time, requests arriving at the step their timestamp falls in; the checker
runs strict after every step and its time is reported apart from the scheduler's.
One loop serves both models:

- ``w2_engine``: the scripted model, engine as ``shared/bench/README.md`` fixes it
  (page 16, 131,072-token pool, 512 running requests, chunked prefill 4096, 16,384
  prefill tokens per step, radix cache, ``lpm``).
- ``model_engine``: a real checkpoint through ``EngineCore`` (``ModelRunner``
  forward, greedy) with the same settings except the KV pool and the context,
  which come from the model (``EngineArgs`` defaults unless given). Trace token ids
  are mapped into the model's vocabulary by ``to_vocab``, and a prompt whose output
  would not fit the context is cut at its end (``fit_to_model``; the count is
  reported as ``prompts_cut``), so shared prefixes stay shared.

``decode_steady``: ``batch`` requests with 512-token prompts held in decode;
scheduler time per decode step without the model call and the checker, with an
empty tree or with extra tokens cached.

The scripted runs use torch single-threaded: the scripted model's small tensor ops
gain nothing from intra-op threads on a 2-core machine and lose a lot to contention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.bench.stats import percentile
from kvserve.bench.workloads import read_mooncake
from kvserve.sched.batch import ScheduleBatch
from kvserve.sched.invariants import InvariantViolation
from kvserve.sched.req import SamplingParams
from kvserve.sched.scheduler import Scheduler
from kvserve.testing.scripted import ScriptedEngine

if TYPE_CHECKING:
    from kvserve.engine import EngineCore

_MASK64 = (1 << 64) - 1


@dataclass
class TraceRequest:
    arrival_step: int
    prompt_ids: list[int]
    max_new_tokens: int


def load_trace_requests(path: str | Path, block: int = 16, limit: int = 0) -> list[TraceRequest]:
    """W2 requests of a Mooncake trace: arrival step = timestamp in whole seconds, output
    ``max(1, ceil(output_length / 8))``. ValueError naming the line for a malformed row."""
    return [
        TraceRequest(r.timestamp_ms // 1000, r.prompt_ids, max(1, -(-r.output_length // 8)))
        for r in read_mooncake(path, block, limit)
    ]


def w2_engine(strict: bool = True, num_tokens: int = 131_072, context_len: int = 8192,
              max_running: int = 512) -> ScriptedEngine:
    return ScriptedEngine(
        page_size=16, num_tokens=num_tokens, num_rows=max_running, context_len=context_len,
        max_running_requests=max_running, chunked_prefill_size=4096, max_prefill_tokens=16_384,
        schedule_policy="lpm", strict_checks=strict,
    )


def model_engine(model_path: str | Path | None, max_total_tokens: int | None = None,
                 device: str | None = None, max_running: int = 512) -> EngineCore:
    """``EngineCore`` over a checkpoint (None: the default model, see ``resolve_model``)
    with W2's scheduler settings and the checker strict every step. Pool
    (``max_total_tokens``, tokens) and context default to the engine's sizing for the
    model and device. Raises ModelLoadError for a folder that holds no loadable checkpoint."""
    from kvserve.engine import EngineArgs, EngineCore

    return EngineCore(EngineArgs(
        model_path=model_path, page_size=16, chunked_prefill_size=4096,
        max_total_tokens=max_total_tokens, max_running_requests=max_running,
        schedule_policy="lpm", strict_checks=True, device=device,
    ))


def to_vocab(token_id: int, vocab_size: int) -> int:
    """A trace token id (``h * block + i``) as an id in ``[0, vocab_size)``: splitmix64 of
    the id, modulo ``vocab_size``.

    Equal ids map to equal ids, so prefixes shared in the trace stay shared, and two
    different ``block``-token blocks practically never coincide, so no sharing is
    invented. ``token_id % vocab_size`` would alias hash ids ``h`` and
    ``h + vocab_size / block`` (with 512 tokens and block 16, only 32 distinct blocks);
    a linear hash keeps consecutive ids in a fixed pattern and aliases blocks too.
    """
    z = (token_id + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % vocab_size


def fit_to_model(requests: list[TraceRequest], vocab_size: int,
                 context_len: int) -> tuple[list[TraceRequest], int]:
    """Requests a model of ``vocab_size`` tokens and ``context_len`` positions can run
    exactly: ids through ``to_vocab``; a prompt whose output would not fit the context
    keeps its first ``context_len - max_new_tokens`` tokens (its shared prefix). Returns
    the requests and how many prompts were cut."""
    fitted, cut = [], 0
    for r in requests:
        keep = max(1, context_len - r.max_new_tokens)
        cut += len(r.prompt_ids) > keep
        fitted.append(TraceRequest(r.arrival_step,
                                   [to_vocab(t, vocab_size) for t in r.prompt_ids[:keep]],
                                   r.max_new_tokens))
    return fitted, cut


@dataclass
class ReplayResult:
    requests: int
    steps: int
    hit_ratio: float
    retractions: int
    aborts: int
    checker_runs: int
    violations: int
    sched_us_p50: float
    sched_us_p99: float
    checker_us_p50: float
    peak_running: int
    forward_tokens: int  # tokens through the model: prefill (recompute included) + decode
    model_seconds: float
    prompts_cut: int | None = None  # set by a real-model replay (``replay_model``)

    def line(self) -> str:
        line = (
            f"requests={self.requests} steps={self.steps} hit_ratio={self.hit_ratio:.4f} "
            f"retractions={self.retractions} aborts={self.aborts} "
            f"checker_runs={self.checker_runs} violations={self.violations} "
            f"sched_us_per_step_p50={self.sched_us_p50:.1f} "
            f"sched_us_per_step_p99={self.sched_us_p99:.1f} "
            f"checker_us_per_step_p50={self.checker_us_p50:.1f} peak_running={self.peak_running}"
        )
        if self.prompts_cut is None:
            return line
        return (f"{line} prompts_cut={self.prompts_cut} forward_tokens={self.forward_tokens} "
                f"model_s={self.model_seconds:.1f} "
                f"forward_tokens_per_s={self.forward_tokens / max(self.model_seconds, 1e-9):.0f}")


def replay_trace(requests: list[TraceRequest], progress: bool = True,
                 max_drain_steps: int = 1_000_000,
                 scheduler: Scheduler | None = None) -> ReplayResult:
    """Run W2 on ``scheduler`` (None: the scripted ``w2_engine``'s). Its checker must be
    strict, so a violation stops the replay with its report (InvariantViolation)."""
    from tqdm import tqdm

    if scheduler is None:
        torch.set_num_threads(1)
        scheduler = w2_engine(strict=True).scheduler
    sched = scheduler
    forward_tokens = 0

    def count_tokens(batch: ScheduleBatch) -> None:
        nonlocal forward_tokens
        forward_tokens += batch.forward_batch.input_ids.numel()

    previous_hook, sched.on_launch = sched.on_launch, count_tokens
    pending = sorted(requests, key=lambda r: r.arrival_step)
    bar = tqdm(total=len(pending), unit="req", disable=not progress, mininterval=1.0)
    step = violations = 0
    peak = 0
    index = 0
    try:
        while index < len(pending) or not sched.is_idle:
            while index < len(pending) and pending[index].arrival_step <= step:
                r = pending[index]
                sched.add_request(r.prompt_ids, SamplingParams(
                    max_new_tokens=r.max_new_tokens, ignore_eos=True, temperature=0.0))
                index += 1
            finished_before = sched.stats.finished
            sched.step()
            bar.update(sched.stats.finished - finished_before)
            peak = max(peak, len(sched.running))
            step += 1
            if step > pending[-1].arrival_step + max_drain_steps:
                break
    except InvariantViolation as err:
        violations = len(err.report.violations)
        raise
    finally:
        bar.close()
        sched.on_launch = previous_hook
    stats = sched.stats
    sched_us = [s * 1e6 for s in stats.sched_seconds]
    checker_us = [s * 1e6 for s in stats.checker_seconds]
    return ReplayResult(
        requests=len(pending), steps=stats.steps,
        hit_ratio=stats.cached_tokens / max(stats.prompt_tokens, 1),
        retractions=stats.retractions, aborts=stats.aborts, checker_runs=sched.checker.runs,
        violations=violations + sched.checker.total_violations,
        sched_us_p50=percentile(sched_us, 50), sched_us_p99=percentile(sched_us, 99),
        checker_us_p50=percentile(checker_us, 50), peak_running=peak,
        forward_tokens=forward_tokens, model_seconds=sum(stats.model_seconds),
    )


def replay_model(requests: list[TraceRequest], core: EngineCore,
                 progress: bool = True) -> ReplayResult:
    """W2 through a real model (``model_engine``): the requests fitted to it
    (``fit_to_model``), then the same loop as the scripted replay; greedy decoding."""
    config = core.runner.config
    fitted, cut = fit_to_model(requests, config.vocab_size, core.context_len)
    result = replay_trace(fitted, progress, scheduler=core.scheduler)
    result.prompts_cut = cut
    return result


@dataclass
class SteadyResult:
    batch: int
    cached_tokens: int
    p50_us: float
    p99_us: float

    def line(self) -> str:
        return (f"batch={self.batch} cached_tokens={self.cached_tokens} "
                f"sched_us_per_decode_step_p50={self.p50_us:.1f} "
                f"sched_us_per_decode_step_p99={self.p99_us:.1f}")


def decode_steady(batch: int = 256, prompt_len: int = 512, cached_tokens: int = 0,
                  warmup_steps: int = 20, steps: int = 200, seed: int = 0) -> SteadyResult:
    """Scheduler microseconds per decode step (model call and checker excluded)."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    page = 16
    pool = batch * (prompt_len + warmup_steps + steps + 2 * page) + cached_tokens + 64 * page
    engine = ScriptedEngine(page_size=page, num_tokens=pool, num_rows=batch,
                            context_len=prompt_len + warmup_steps + steps + 64,
                            max_running_requests=batch, chunked_prefill_size=4096,
                            max_prefill_tokens=16_384, strict_checks=False)
    cache, alloc = engine.tree_cache, engine.pools.allocator
    filled = 0
    while filled < cached_tokens:  # unrelated cached sequences of 1,024 tokens
        n = min(1024, cached_tokens - filled)
        n -= n % page
        if n <= 0:
            break
        pages = alloc.alloc(n)
        assert pages is not None
        cache.insert([rng.randrange(40_000, 90_000) for _ in range(n)], pages)
        filled += n
    for _ in range(batch):
        engine.add([rng.randrange(1000, 30_000) for _ in range(prompt_len)],
                   max_new_tokens=warmup_steps + steps + 16, ignore_eos=True)
    sched = engine.scheduler
    while sched.waiting or sched.chunked_req is not None:
        sched.step()
    for _ in range(warmup_steps):
        sched.step()
    start = len(sched.stats.sched_seconds)
    for _ in range(steps):
        sched.step()
    assert len(sched.running) == batch and all(sched.stats.decode_step[start:])
    us = [s * 1e6 for s in sched.stats.sched_seconds[start:]]
    sched.check()
    return SteadyResult(batch, cache.evictable_size(), percentile(us, 50),
                        percentile(us, 99))
