"""The main job (``kvserve bench chat``, ``bash scripts/main.sh``): real multi-turn chats
under shared system prompts, sent through the official ``openai`` client to a
``kvserve serve``, started here on its default model (or ``--model``) unless ``--url``
names a running server.

    start the server (subprocess, --enable-debug-endpoints), wait for /health; read
      /v1/models and /get_server_info (model, random weights, pool, page, context...)
    C workers, each running whole conversations: turn t sends system + history + user_t,
      streams the reply (TTFT and ITL measured here), appends the model's own reply, then
      sends turn t + 1, so later turns extend earlier prompts and conversations share
      system prompts (chat_data.py: 4 system prompts, 24 scripts of 6 user turns)
    meanwhile GET /metrics every 0.25 s: running/waiting requests, KV used/cached/total
      tokens, cumulative prefix hit ratio
    GET /debug/check (the strict checker once idle); summary and sample replies on
      stdout; report folder (summary.json, summary.md, timeline.png, timeline.csv,
      requests.jsonl with every request's text and reply, server.log)
    SIGTERM the server, always (errors and Ctrl-C too)

``--mode`` (``ChatJobOptions.mode``): "radix" (the default, above: the history matched in
the radix cache), "sessions" (each conversation opens a streaming session, every turn
sends the whole conversation with ``session_params {"id"}`` and the session is closed
after the last turn) or "both" (one short warm-up request, then radix and sessions on
the same server, ``/flush_cache`` before each, side by side in the summary:
``bench.sessions.comparison_lines``). A session reuses its held KV only when the
re-rendered history extends the tokens it holds: the chat template re-tokenizes the
assistant's reply from its text, and a reply whose text re-encodes to other ids falls
back to the tree (counted: "turns >= 2 reusing all held KV", and the server's slot hits
and mismatches).

Requests are greedy (temperature 0: a run is reproducible) and end at the model's end of
turn ("stop") or at ``max_tokens`` ("length"); the summary counts both. TTFT runs from
sending the request to the first non-empty content chunk; ITL is the gap between
content chunks.

Default size, for SmolLM2-135M-Instruct (float32, one torch thread in the engine) on
this project's 2-core CPU: 24 conversations (each of the 24 scripts once, 6 per system
prompt) x 4 turns = 96 requests, 12 at once, replies up to 64 tokens (most reach it:
the model is wordy). Decode throughput there grows with the batch (about 13 output
tokens/s for one stream, 26 for 8, 41 for 16 on a quiet machine) and so does ITL; 12
at once keeps ITL p50 near 0.3 s. On the idle machine the workload takes about 160-190 s
(5,764 output tokens), the whole command 195-225 s (``benchmarks/RESULTS.md``). The
longest prompt (turn 4) is about 350 tokens, far inside SmolLM2's 8192-token context.

Exit status: 0 when every request succeeded and the checker was clean (or unavailable:
a ``--url`` server without debug endpoints); 1 otherwise; 2 when the server could not be
started or reached; 130 on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from kvserve.bench.chat_data import EXTRA_TURNS, SCRIPTS, SYSTEM_PROMPTS
from kvserve.bench.sessions import (
    TurnStat,
    comparison,
    comparison_lines,
    counters_change,
    run_metrics,
    session_counters,
    turn_stats_by,
)
from kvserve.bench.stats import percentile
from kvserve.server.process import ServerProcess, ServerStartError

METRICS_PERIOD_S = 0.25
STARTUP_TIMEOUT_S = 300.0  # first start on a fresh machine also writes the default model
REQUEST_TIMEOUT_S = 600.0
SAMPLE_REPLIES = 3  # conversations whose last turn is printed at the end
SAMPLE_CHARS = 240  # each sample reply cut to this many characters

# Sized for SmolLM2-135M on 2 CPU cores: about 3 minutes of workload (module docstring).
DEFAULT_CONVERSATIONS = 24
DEFAULT_TURNS = 4
DEFAULT_CONCURRENCY = 12
DEFAULT_MAX_TOKENS = 64


class JobSetupError(RuntimeError):
    """The server could not be started or reached (exit status 2)."""


# -- workload -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Conversation:
    system_index: int  # into chat_data.SYSTEM_PROMPTS
    user_turns: tuple[str, ...]

    @property
    def system(self) -> str:
        return SYSTEM_PROMPTS[self.system_index]


def chat_conversations(num_conversations: int = DEFAULT_CONVERSATIONS,
                       turns: int = DEFAULT_TURNS) -> list[Conversation]:
    """The built-in chats of ``chat_data``: conversation k is script ``k % 24`` with
    ``turns`` user turns (its six, then generic follow-ups), under the script's system
    prompt shifted by ``k // 24``: the first 96 conversations differ (4 system prompts x
    24 scripts), later ones repeat them. Deterministic; no randomness."""
    convs = []
    for k in range(num_conversations):
        system, script = SCRIPTS[k % len(SCRIPTS)]
        extra = EXTRA_TURNS * (turns // len(EXTRA_TURNS) + 1)
        convs.append(Conversation((system + k // len(SCRIPTS)) % len(SYSTEM_PROMPTS),
                                  (*script, *extra)[:turns]))
    return convs


# -- measurements ---------------------------------------------------------------------------

@dataclass(slots=True)
class TurnResult:
    """One request; times in seconds since the workload started."""

    conversation: int
    turn: int
    start_s: float
    max_tokens: int
    system: str = ""  # the conversation's system prompt
    user: str = ""  # this turn's user message (the history before it is the earlier turns)
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort"
    text: str = ""  # the assistant's reply
    error: str | None = None
    mode: str = "radix"  # "radix": history matched in the tree; "sessions": a session's turn


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One scrape of GET /metrics; counters are cumulative since the server started."""

    t_s: float
    running: float
    waiting: float
    kv_used_tokens: float
    kv_cached_tokens: float
    kv_total_tokens: float
    prompt_tokens: float
    hit_tokens: float
    retractions: float


_SAMPLE_NAMES = {
    "running": "kvserve:num_running_reqs", "waiting": "kvserve:num_queue_reqs",
    "kv_used_tokens": "kvserve:kv_used_tokens", "kv_cached_tokens": "kvserve:kv_cached_tokens",
    "kv_total_tokens": "kvserve:kv_total_tokens",
    "prompt_tokens": "kvserve:prompt_tokens_total",
    "hit_tokens": "kvserve:prefix_cache_hit_tokens_total",
    "retractions": "kvserve:retractions_total",
}


def parse_metrics(text: str, t_s: float) -> MetricsSample | None:
    """The kvserve gauges and counters of a /metrics body; None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for family in text_string_to_metric_families(text)
              for s in family.samples}
    if _SAMPLE_NAMES["kv_total_tokens"] not in values:
        return None
    return MetricsSample(t_s, **{f: float(values.get(n, 0.0)) for f, n in _SAMPLE_NAMES.items()})


# -- server and machine ---------------------------------------------------------------------

def _get_json(url: str, path: str, api_key: str | None) -> Any:
    """GET ``url + path`` as JSON; raises JobSetupError when unreachable or not 200."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url + path, headers=headers, timeout=10)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise JobSetupError(f"cannot reach {url}: {err or type(err).__name__}") from None
    if r.status_code != 200:
        raise JobSetupError(f"GET {url}{path} answered {r.status_code}: {r.text[:200]}")
    try:
        return r.json()
    except ValueError:
        raise JobSetupError(f"GET {url}{path}: not JSON: {r.text[:200]!r}") from None


def server_facts(url: str, api_key: str | None) -> dict[str, Any]:
    """What the report says about the server: /v1/models (id, path, random_weights)
    and the engine settings of /get_server_info (kvserve's ``EngineCore.rpc("info")``,
    SGLang's names); a setting the server does not report is None. Raises JobSetupError."""
    models = _get_json(url, "/v1/models", api_key)
    try:
        model = models["data"][0]
        facts: dict[str, Any] = {"model": str(model["id"]),
                                 "model_path": str(model.get("root") or model["id"]),
                                 "random_weights": model.get("random_weights")}
    except (KeyError, IndexError, TypeError):
        raise JobSetupError(f"GET {url}/v1/models: no model in {str(models)[:200]!r}") from None
    try:
        info = _get_json(url, "/get_server_info", api_key)
    except JobSetupError:  # not every OpenAI server has it
        info = {}
    radix = info.get("disable_radix_cache")
    facts.update({
        "kv_pool_tokens": info.get("max_total_num_tokens"),
        "page_size": info.get("page_size"),
        "context_len": info.get("context_len", model.get("max_model_len")),
        "max_running_requests": info.get("max_running_requests"),
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "schedule_policy": info.get("schedule_policy"),
        "radix_cache": None if radix is None else not radix,
        "device": info.get("device"), "dtype": info.get("dtype"),
        "torch_version": info.get("torch_version"),
        "torch_threads": info.get("torch_num_threads"),
    })
    return facts


def machine_facts() -> dict[str, Any]:
    """This machine (where the client runs, and the server when started here)."""
    cpu = platform.processor() or platform.machine()
    with suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return {"cpu": cpu, "cores": cores, "os": platform.platform(),
            "python": platform.python_version()}


def git_commit() -> str:
    """The commit of the kvserve checkout being run (``+dirty`` with uncommitted changes),
    or "unknown" outside a git checkout."""
    source = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# -- the workload run -----------------------------------------------------------------------

@dataclass
class ChatJobOptions:
    url: str | None = None  # None: start a server here
    model: str | None = None  # checkpoint for the server started here; None: its default
    conversations: int = DEFAULT_CONVERSATIONS
    turns: int = DEFAULT_TURNS
    concurrency: int = DEFAULT_CONCURRENCY
    max_tokens: int = DEFAULT_MAX_TOKENS
    report_dir: str | None = None  # default reports/chat-<time>/ in the current folder
    api_key: str | None = None
    progress: bool = True
    mode: str = "radix"  # "radix", "sessions" or "both" (radix, then sessions: MODES)


MODES = {"radix": ("radix",), "sessions": ("sessions",), "both": ("radix", "sessions")}


@dataclass
class RunOutcome:
    results: list[TurnResult]
    samples: list[MetricsSample]
    before: MetricsSample | None
    after: MetricsSample | None
    check: dict[str, Any] | None  # /debug/check report; None when the server lacks it
    wall_s: float
    skipped: int
    sessions: dict[str, int] | None = None  # the server's session counters' change


async def _send_turn(client: Any, model: str, messages: list[Any], result: TurnResult,
                     t0: float, session_id: str | None = None) -> None:
    import openai

    start = t0 + result.start_s
    last: float | None = None
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=result.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body=None if session_id is None else {"session_params": {"id": session_id}})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                result.cached_tokens = (details.cached_tokens or 0) if details else 0
            for choice in chunk.choices:
                result.finish_reason = choice.finish_reason or result.finish_reason
            text = "".join(c.delta.content or "" for c in chunk.choices)
            if text:
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                parts.append(text)
    except openai.OpenAIError as err:
        result.error = f"{type(err).__name__}: {err}"
    result.end_s = time.perf_counter() - t0
    result.text = "".join(parts)


async def _conversation(client: Any, http: Any, model: str, index: int, conv: Conversation,
                        max_tokens: int, t0: float, results: list[TurnResult],
                        bar: Any, mode: str = "radix") -> int:
    """Run one conversation's turns in order, each re-sending the history with the
    model's own replies; returns the turns skipped after a failure. With mode
    "sessions" the conversation opens a session, every turn names it
    (``session_params``) and the session is closed at the end."""
    from kvserve.bench.sessions import SessionApiError, close_session, open_session

    session_id = None
    if mode == "sessions":
        try:
            session_id = await open_session(http)
        except SessionApiError as err:
            failed = TurnResult(index, 0, time.perf_counter() - t0, max_tokens, conv.system,
                                conv.user_turns[0], error=str(err), mode=mode)
            results.append(failed)
            bar.update(1)
            return len(conv.user_turns) - 1
    messages: list[Any] = [{"role": "system", "content": conv.system}]
    try:
        for turn, user in enumerate(conv.user_turns):
            messages.append({"role": "user", "content": user})
            result = TurnResult(index, turn, time.perf_counter() - t0, max_tokens,
                                conv.system, user, mode=mode)
            await _send_turn(client, model, messages, result, t0, session_id)
            results.append(result)
            bar.update(1)
            if result.error is not None:
                bar.set_postfix_str(f"errors={sum(r.error is not None for r in results)}")
                return len(conv.user_turns) - turn - 1
            messages.append({"role": "assistant", "content": result.text})
    finally:
        if session_id is not None:
            with suppress(SessionApiError):  # the checker reports a session left open
                await close_session(http, session_id)
    return 0


async def _scrape(http: Any, t0: float) -> MetricsSample | None:
    import httpx

    try:
        r = await http.get("/metrics", timeout=5)
        return parse_metrics(r.text, time.perf_counter() - t0) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _sample_metrics(http: Any, t0: float, samples: list[MetricsSample],
                          done: asyncio.Event) -> None:
    while not done.is_set():
        sample = await _scrape(http, t0)
        if sample is not None:
            samples.append(sample)
        with suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), METRICS_PERIOD_S)


async def _debug_check(http: Any) -> dict[str, Any] | None:
    r = await http.get("/debug/check", timeout=60)
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        return {"ok": False, "idle": False, "violations": [f"/debug/check answered "
                                                          f"{r.status_code}: {r.text[:300]}"]}
    report: dict[str, Any] = r.json()
    return report


async def run_workload(url: str, model: str, convs: list[Conversation],
                       opts: ChatJobOptions, mode: str = "radix") -> RunOutcome:
    """Send the conversations (``opts.concurrency`` at once), sample /metrics meanwhile,
    then ask the checker. ``mode`` "sessions": each conversation through a session."""
    import httpx
    import openai
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=opts.api_key or "unused",
                                max_retries=0, timeout=REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=url, headers=headers) as http, client:
        if mode == "sessions":
            await _probe_sessions(http)
        counters = await session_counters(http)
        t0 = time.perf_counter()
        before = await _scrape(http, t0)
        samples: list[MetricsSample] = [before] if before else []
        results: list[TurnResult] = []
        total = sum(len(c.user_turns) for c in convs)
        queue = list(enumerate(convs))[::-1]
        done = asyncio.Event()
        with tqdm(total=total, unit="req", desc=f"chat {mode}", file=sys.stderr,
                  disable=not opts.progress, dynamic_ncols=True) as bar:

            async def worker() -> int:
                skipped = 0
                while queue:
                    index, conv = queue.pop()
                    skipped += await _conversation(client, http, model, index, conv,
                                                   opts.max_tokens, t0, results, bar, mode)
                return skipped

            sampler = asyncio.create_task(_sample_metrics(http, t0, samples, done))
            try:
                skipped = await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
            finally:
                done.set()
                await sampler
        wall_s = max((r.end_s for r in results), default=0.0)
        check = await _debug_check(http)
        after = await _scrape(http, t0)
        counted = counters_change(counters, await session_counters(http))
    if after is not None:
        samples.append(after)
    return RunOutcome(results, samples, before, after, check, wall_s, sum(skipped), counted)


async def _probe_sessions(http: Any) -> None:
    """Open and close one session; JobSetupError when the server has no session API."""
    from kvserve.bench.sessions import SessionApiError, close_session, open_session

    try:
        await close_session(http, await open_session(http))
    except SessionApiError as err:
        raise JobSetupError(f"{err} (--mode sessions needs kvserve's session API)") from None


async def prepare_run(url: str, model: str, api_key: str | None, warm_up: bool) -> None:
    """Before each run of a comparison: one short request first (``warm_up``: the first
    run pays no one-time costs the second does not), then ``/flush_cache``, so no run
    starts with the other's prefixes cached. Raises JobSetupError."""
    import httpx
    import openai

    from kvserve.bench.sessions import SessionApiError, flush_cache

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        if warm_up:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused",
                                          max_retries=0, timeout=REQUEST_TIMEOUT_S) as client:
                try:
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "Hello!"}],
                        max_tokens=8, temperature=0)
                except openai.OpenAIError as err:
                    raise JobSetupError(f"warm-up request failed: {err}") from None
        try:
            await flush_cache(http)
        except (SessionApiError, httpx.HTTPError) as err:
            raise JobSetupError(f"cannot flush the cache between runs: {err}") from None


# -- summary and report ---------------------------------------------------------------------

def turn_stats(results: list[TurnResult]) -> list[TurnStat]:
    """The results as ``bench.sessions.TurnStat`` (held tokens: the conversation's
    previous turn's prompt + completion - 1)."""
    return turn_stats_by(results, attrgetter("conversation"))


def run_summary(outcome: RunOutcome) -> dict[str, Any]:
    """One run's figures (``bench.sessions.run_metrics``) with its checker verdict."""
    clean, verdict = checker_verdict(outcome.check)
    return {**run_metrics(turn_stats(outcome.results), outcome.wall_s),
            "skipped_turns": outcome.skipped, "server_sessions": outcome.sessions,
            "checker_clean": clean,
            "checker_verdict": verdict}

def checker_verdict(check: dict[str, Any] | None) -> tuple[bool | None, str]:
    """(clean, one line); clean is None when the server has no /debug/check."""
    if check is None:
        return None, "unavailable (server lacks --enable-debug-endpoints)"
    violations = list(check.get("violations") or [])
    pools = check.get("pools") or {}
    kv, rows = pools.get("kv_tokens") or {}, pools.get("rows") or {}
    full = (bool(kv) and kv.get("available", 0) + kv.get("evictable", 0) == kv.get("total")
            and rows.get("free") == rows.get("size"))
    if check.get("ok") and not violations and check.get("idle") and full:
        return True, "clean: 0 violations, pools full"
    problems = [*map(str, violations)]
    if not check.get("idle"):
        problems.append("engine not idle after the workload")
    elif not full:
        problems.append(f"pools not full at idle: kv_tokens={kv} rows={rows}")
    return False, f"{len(violations)} violation(s): " + "; ".join(problems)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (seconds) in milliseconds; None for no values."""
    return {f"p{p}": round(percentile(values, p) * 1000, 2) if values else None
            for p in (50, 90, 99)}


def _one_line(text: str, limit: int = SAMPLE_CHARS) -> str:
    """``text`` on one line (whitespace runs become one space, other unprintable
    characters escapes such as ``\\x1b``: a random model's noise must not drive the
    terminal), cut to ``limit`` chars."""
    flat = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[:limit - 3].rstrip() + "..."


def summarize(outcome: RunOutcome, opts: ChatJobOptions, url: str, facts: dict[str, Any],
              server_exit: int | None, machine: dict[str, Any] | None = None,
              commit: str | None = None,
              runs: dict[str, RunOutcome] | None = None) -> dict[str, Any]:
    """summary.json's content (times in ms or s as named, token counts exact). The
    top-level figures are ``outcome``'s (the first run); ``runs`` (mode name -> outcome,
    ``outcome`` among them) adds "runs" (``run_summary`` of each) and, with both modes,
    "comparison" (``bench.sessions.comparison``)."""
    runs = runs or {opts.mode: outcome}
    per_run = {name: run_summary(o) for name, o in runs.items()}
    results = outcome.results
    ok = [r for r in results if r.error is None]
    errors = [r for r in results if r.error is not None]
    wall = outcome.wall_s
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_client = sum(r.prompt_tokens for r in ok)
    cached_client = sum(r.cached_tokens for r in ok)
    finish: dict[str, int] = {"stop": 0, "length": 0}
    for r in ok:
        finish[r.finish_reason or "none"] = finish.get(r.finish_reason or "none", 0) + 1
    before, after = outcome.before, outcome.after
    server_counts: dict[str, Any] = {"prompt_tokens": None, "hit_tokens": None,
                                     "hit_ratio": None, "retractions": None}
    if before is not None and after is not None:
        prompt = after.prompt_tokens - before.prompt_tokens
        hit = after.hit_tokens - before.hit_tokens
        server_counts = {"prompt_tokens": int(prompt), "hit_tokens": int(hit),
                         "hit_ratio": _ratio(hit, prompt),
                         "retractions": int(after.retractions - before.retractions)}
    clean, verdict = checker_verdict(outcome.check)
    last_turns = {r.conversation: r for r in sorted(ok, key=lambda r: r.turn)}
    samples = [{"conversation": r.conversation, "turn": r.turn, "user": r.user,
                "reply": _one_line(r.text), "finish_reason": r.finish_reason}
               for _, r in sorted(last_turns.items())[:SAMPLE_REPLIES]]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit or git_commit(),
        "machine": machine or machine_facts(),
        "workload": {"conversations": opts.conversations, "turns": opts.turns,
                     "concurrency": opts.concurrency, "max_tokens": opts.max_tokens,
                     "system_prompts": len({c.system_index for c in chat_conversations(
                         opts.conversations, 1)}),
                     "temperature": 0.0, "stream": True},
        "server": {"url": url, "started_here": opts.url is None, "exit_status": server_exit,
                   **facts},
        "requests": len(results),
        "errors": len(errors),
        "skipped_turns": outcome.skipped,
        "first_errors": [f"conversation {r.conversation} turn {r.turn}: {r.error}"
                         for r in errors[:5]],
        "finish_reasons": finish,
        "wall_s": round(wall, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _ms([gap for r in ok for gap in r.itl_s]),
        "prefix_cache": {
            "server": server_counts,
            "client": {"prompt_tokens": prompt_client, "cached_tokens": cached_client,
                       "hit_ratio": _ratio(cached_client, prompt_client)},
        },
        "retractions": server_counts["retractions"],
        "checker": {"available": clean is not None, "clean": clean, "verdict": verdict,
                    "violations": list((outcome.check or {}).get("violations") or [])},
        "sample_replies": samples,
        "mode": opts.mode,
        "runs": per_run,
        **({"comparison": comparison(per_run["radix"], per_run["sessions"])}
           if len(per_run) == 2 else {}),
        "ok": (all(r["errors"] == 0 and r["skipped_turns"] == 0
                   and r["checker_clean"] is not False for r in per_run.values())
               and server_exit in (None, 0)),
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _weights(random_weights: bool | None) -> str:
    if random_weights is None:
        return "weights unknown"
    return "RANDOM weights: the text is noise" if random_weights else "real weights"


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The printed summary (summary.md holds the same lines)."""
    w, pc, srv, m = s["workload"], s["prefix_cache"], s["server"], s["machine"]
    hits, cli = pc["server"], pc["client"]
    ttft, itl = s["ttft_ms"], s["itl_ms"]
    radix = {True: "on", False: "off"}.get(srv["radix_cache"], "n/a")
    threads = srv["torch_threads"]
    hit_server = (f"{_fmt(hits['hit_ratio'], '.3f')} (server counters: {hits['hit_tokens']} "
                  f"of {hits['prompt_tokens']} prompt tokens)")
    hit_client = (f"{_fmt(cli['hit_ratio'], '.3f')} (usage.cached_tokens: "
                  f"{cli['cached_tokens']} of {cli['prompt_tokens']} prompt tokens)")
    errors = str(s["errors"])
    if s["skipped_turns"]:
        errors += f" ({s['skipped_turns']} later turns skipped)"
    ended = ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items())
    return [
        f"date              {s['date']}, commit {s['commit']}",
        f"machine           {m['cpu']}, {m['cores']} cores; torch {srv['torch_version'] or 'n/a'}"
        f" with {_fmt(threads, 'd')} thread(s) in the server",
        f"server            {srv['url']}, model {srv['model']} ({srv['model_path']}), "
        f"{_weights(srv['random_weights'])}",
        f"engine            KV pool {_fmt(srv['kv_pool_tokens'], 'd')} tokens, page "
        f"{_fmt(srv['page_size'], 'd')}, context {_fmt(srv['context_len'], 'd')}, max running "
        f"{_fmt(srv['max_running_requests'], 'd')}, chunked prefill "
        f"{_fmt(srv['chunked_prefill_size'], 'd')}, policy {srv['schedule_policy'] or 'n/a'}, "
        f"radix cache {radix}, {srv['device'] or 'n/a'} {srv['dtype'] or ''}".rstrip(),
        f"workload          {w['conversations']} conversations x {w['turns']} turns, "
        f"{w['system_prompts']} shared system prompts, concurrency {w['concurrency']}, "
        f"max_tokens {w['max_tokens']}, greedy, streaming",
        f"requests          {s['requests']}",
        f"errors            {errors}",
        f"replies ended     {ended} (stop: end of turn; length: max_tokens reached)",
        f"wall time         {s['wall_s']:.1f} s",
        f"output tokens/s   {_fmt(s['output_tokens_per_s'])} ({s['output_tokens']} tokens)",
        f"requests/s        {_fmt(s['requests_per_s'], '.2f')}",
        f"TTFT ms           p50 {_fmt(ttft['p50'])}  p90 {_fmt(ttft['p90'])}  "
        f"p99 {_fmt(ttft['p99'])}",
        f"ITL ms            p50 {_fmt(itl['p50'])}  p90 {_fmt(itl['p90'])}  "
        f"p99 {_fmt(itl['p99'])}",
        f"prefix hit ratio  {hit_server}",
        f"                  {hit_client}",
        f"retractions       {_fmt(s['retractions'], 'd')}",
        f"checker verdict   {s['checker']['verdict']}",
        *([f"server exit       status {srv['exit_status']} after SIGTERM"]
          if srv["exit_status"] not in (None, 0) else []),
        *(f"error             {e}" for e in s["first_errors"]),
        *_mode_lines(s),
    ]


def _mode_lines(s: dict[str, Any]) -> list[str]:
    """The runs side by side (not for a radix-only run: the lines above are all of it)."""
    if s["mode"] == "radix":
        return []
    runs = s["runs"]
    head = (f"runs              {' then '.join(runs)}, same server, the cache flushed before "
            "each" if len(runs) > 1 else "run               every conversation through a "
            "session (opened before turn 1, closed after the last)")
    lines = ["", head, *("  " + line for line in comparison_lines(runs))]
    lines += [f"  checker after {name}: {r['checker_verdict']}" for name, r in runs.items()]
    return lines


def sample_lines(s: dict[str, Any]) -> list[str]:
    """A few conversations' last user turn and reply (one line each, cut)."""
    if not s["sample_replies"]:
        return []
    lines = [f"sample replies (last turn of {len(s['sample_replies'])} conversations; every "
             "request and reply is in requests.jsonl)"]
    for sample in s["sample_replies"]:
        lines += [f"  [conversation {sample['conversation']}, turn {sample['turn'] + 1}] user: "
                  f"{sample['user']}",
                  f"    assistant ({sample['finish_reason']}): {sample['reply']}"]
    return lines


def _throughput(results: list[TurnResult], bin_s: float) -> tuple[list[float], list[float]]:
    """(bin starts in s, output tokens/s per bin) from each reply's chunk times; a reply's
    tokens are spread evenly over its content chunks."""
    bins: dict[int, float] = {}
    for r in results:
        if r.ttft_s is None or r.error is not None:
            continue
        t = r.start_s + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        for at in times:
            key = int(at // bin_s)
            bins[key] = bins.get(key, 0.0) + r.completion_tokens / len(times)
    if not bins:
        return [], []
    keys = range(max(bins) + 1)
    return [k * bin_s for k in keys], [bins.get(k, 0.0) / bin_s for k in keys]


def plot_timeline(samples: list[MetricsSample], results: list[TurnResult], path: Path,
                  title: str, concurrency: int) -> None:
    """timeline.png, five panels over the same time axis: running + waiting requests
    (the client's concurrency limit dashed); output tokens/s; TTFT and median ITL per
    request; KV used/cached vs total; cumulative prefix hit ratio."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    base = samples[0] if samples else None
    t = [s.t_s for s in samples]
    fig = Figure(figsize=(12, 13), layout="constrained")
    reqs, tput, lat, kv, hits = fig.subplots(5, 1, sharex=True)
    reqs.plot(t, [s.running for s in samples], label="running")
    reqs.plot(t, [s.waiting for s in samples], label="waiting")
    reqs.axhline(concurrency, color="tab:red", linestyle="--",
                 label=f"client concurrency ({concurrency})")
    reqs.set_ylim(0, max([concurrency, *(s.running + s.waiting for s in samples)]) * 1.15)
    reqs.yaxis.set_major_locator(MaxNLocator(integer=True))
    reqs.set_ylabel("requests")
    wall = max((r.end_s for r in results), default=0.0)
    bin_s = max(2.0, round(wall / 40))  # a 400 ms ITL makes 1 s bins jumpy
    starts, rates = _throughput(results, bin_s)
    tput.step(starts, rates, where="post", color="tab:purple",
              label=f"output tokens/s ({bin_s:.0f} s bins)")
    tput.set_ylim(bottom=0)
    tput.set_ylabel("tokens/s")
    done = [r for r in results if r.error is None and r.ttft_s is not None]
    lat.scatter([r.start_s + (r.ttft_s or 0.0) for r in done],
                [(r.ttft_s or 0.0) * 1000 for r in done], s=10, label="TTFT (at first token)")
    with_itl = [r for r in done if r.itl_s]
    lat.scatter([r.end_s for r in with_itl],
                [percentile(r.itl_s, 50) * 1000 for r in with_itl], s=10, marker="x",
                label="median ITL of the reply (at its end)")
    if done:
        lat.set_yscale("log")
    lat.set_ylabel("ms per request")
    kv.stackplot(t, [s.kv_used_tokens for s in samples], [s.kv_cached_tokens for s in samples],
                 labels=["used by live requests", "cached (evictable)"], alpha=0.7)
    total = int(samples[-1].kv_total_tokens) if samples else 0
    kv.plot(t, [s.kv_total_tokens for s in samples], "k--", label=f"pool total ({total})")
    kv.yaxis.set_major_locator(MaxNLocator(integer=True))
    kv.set_ylabel("KV tokens")
    ratio = [None if base is None else _ratio(s.hit_tokens - base.hit_tokens,
                                               s.prompt_tokens - base.prompt_tokens)
             for s in samples]
    hits.plot(t, [float("nan") if r is None else r for r in ratio], color="tab:green",
              label="prefix hit tokens / prompt tokens (cumulative)")
    hits.set_ylim(0, 1)
    hits.set_ylabel("hit ratio")
    hits.set_xlabel("seconds since the workload started")
    for ax in (reqs, tput, lat, kv, hits):
        ax.grid(alpha=0.3)
        # outside the axes: the first seconds (TTFT of the first wave) stay visible
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def write_report(report_dir: Path, summary: dict[str, Any], outcome: RunOutcome,
                 runs: dict[str, RunOutcome] | None = None) -> None:
    """summary.json, summary.md, requests.jsonl (every run's requests, each with its
    mode), timeline.csv and timeline.png of ``outcome`` (the first run), and
    timeline-<mode>.png of each further run."""
    runs = runs or {summary["mode"]: outcome}
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = ["# kvserve bench chat", "", "```", *summary_lines(summary), "```", "",
          "```", *sample_lines(summary), "```", "",
          "timeline.png: running and waiting requests, output tokens/s, TTFT and ITL per "
          "request, KV tokens, cumulative prefix hit ratio (GET /metrics every "
          f"{METRICS_PERIOD_S} s). requests.jsonl: one line per request, with its system "
          "prompt, user message and reply.", ""]
    (report_dir / "summary.md").write_text("\n".join(md))
    with (report_dir / "requests.jsonl").open("w") as f:
        every = [r for o in runs.values() for r in o.results]
        for r in sorted(every, key=lambda r: (r.mode != "radix", r.conversation, r.turn)):
            row = {"conversation": r.conversation, "turn": r.turn, "system": r.system,
                   "user": r.user, "reply": r.text, "finish_reason": r.finish_reason,
                   **{k: v for k, v in asdict(r).items() if k not in (
                       "conversation", "turn", "system", "user", "text", "finish_reason")}}
            row["itl_s"] = [round(gap, 6) for gap in r.itl_s]
            f.write(json.dumps(row) + "\n")
    with (report_dir / "timeline.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(MetricsSample.__slots__)
        writer.writerows([round(s.t_s, 3), *(int(getattr(s, name))
                                             for name in MetricsSample.__slots__[1:])]
                         for s in outcome.samples)
    w, srv = summary["workload"], summary["server"]
    for name, run in runs.items():
        plot_timeline(run.samples, run.results, report_dir / (
            "timeline.png" if run is outcome else f"timeline-{name}.png"),
            f"kvserve bench chat ({name}): {srv['model']}, {w['conversations']} "
            f"conversations x {w['turns']} turns, concurrency {w['concurrency']}",
            w["concurrency"])


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so the server is stopped on every exit."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_chat_job(opts: ChatJobOptions) -> int:
    """The whole job; returns the exit status (see the module docstring)."""
    report_dir = Path(opts.report_dir or f"reports/chat-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"kvserve: cannot create the report folder {report_dir}: {err}", file=sys.stderr)
        return 2
    convs = chat_conversations(opts.conversations, opts.turns)
    server: ServerProcess | None = None
    server_exit: int | None = None
    with _sigterm_as_interrupt():
        try:
            if opts.url is None:
                flags = ["--enable-debug-endpoints", *(["--model", opts.model] if opts.model
                                                       else [])]
                server = ServerProcess(flags, report_dir / "server.log", own_session=True)
                print(f"kvserve: starting the server ({' '.join(server.cmd[1:])}); log in "
                      f"{server.log_path} (a .gguf model, the default included, is "
                      "converted once on its first start: about 30 s)", file=sys.stderr,
                      flush=True)
                server.start(STARTUP_TIMEOUT_S)
                url = server.url
            else:
                url = opts.url.rstrip("/").removesuffix("/v1")
            facts = server_facts(url, opts.api_key)
            print(f"kvserve: {len(convs)} conversations x {opts.turns} turns to {url} (model "
                  f"{facts['model']}, {_weights(facts['random_weights'])}), concurrency "
                  f"{opts.concurrency}, max_tokens {opts.max_tokens}", file=sys.stderr,
                  flush=True)
            runs: dict[str, RunOutcome] = {}
            modes = MODES[opts.mode]
            for i, mode in enumerate(modes):
                if len(modes) > 1:
                    asyncio.run(prepare_run(url, facts["model"], opts.api_key, warm_up=i == 0))
                runs[mode] = asyncio.run(run_workload(url, facts["model"], convs, opts, mode))
            outcome = runs[modes[0]]
        except (JobSetupError, ServerStartError) as err:
            print(f"kvserve: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kvserve: interrupted; stopping the server", file=sys.stderr)
            return 130
        finally:
            if server is not None:
                server_exit = server.stop()
    summary = summarize(outcome, opts, url, facts, server_exit, runs=runs)
    write_report(report_dir, summary, outcome, runs)
    print("\n".join([*summary_lines(summary), *sample_lines(summary)]))
    print(f"report            {report_dir}/ (summary.json, summary.md, timeline.png, "
          f"timeline.csv, requests.jsonl"
          f"{''.join(f', timeline-{m}.png' for m in list(runs)[1:])}"
          f"{', server.log' if server else ''})", flush=True)
    return 0 if summary["ok"] else 1
