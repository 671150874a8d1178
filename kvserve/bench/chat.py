"""The main job (``kvserve bench chat``, ``bash scripts/main.sh``): a multi-turn chat
workload with shared system prompts, sent through the official ``openai`` client to a
``kvserve serve``, started here on the tiny default model unless ``--url`` names one.

    start the server (subprocess, --enable-debug-endpoints), wait for /health
    C workers, each running whole conversations: turn t sends system + history + user_t,
      streams the reply (TTFT and ITL measured here), appends it, then sends turn t + 1,
      so later turns extend earlier prompts and conversations share system prompts
    meanwhile GET /metrics every 0.25 s: running/waiting requests, KV used/cached/total
      tokens, cumulative prefix hit ratio
    GET /debug/check (the strict checker once idle), summary on stdout, report folder
      (summary.json, summary.md, timeline.png, timeline.csv, requests.jsonl, server.log)
    SIGTERM the server, always (errors and Ctrl-C too)

Requests are greedy with ``ignore_eos`` so every reply has exactly its turn's
``max_tokens`` (drawn in [ceil(M / 2), M]; exact counts; the tiny model's text is
meaningless anyway). TTFT runs from sending the
request to the first non-empty content chunk; ITL is the gap between content chunks.

Exit status: 0 when every request succeeded and the checker was clean (or unavailable:
a ``--url`` server without debug endpoints); 1 otherwise; 2 when the server could not be
started or reached; 130 on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.stats import percentile
from kvserve.server.process import ServerProcess, ServerStartError

METRICS_PERIOD_S = 0.25
STARTUP_TIMEOUT_S = 300.0  # first start on a fresh machine also writes the default model
REQUEST_TIMEOUT_S = 600.0


class JobSetupError(RuntimeError):
    """The server could not be started or reached (exit status 2)."""


# -- workload -------------------------------------------------------------------------------

_PERSONAS = (
    "You are the support assistant of a cloud storage company.",
    "You are a careful tutor who helps students learn algebra and geometry.",
    "You are a travel planner for trains and ferries across Europe.",
    "You are a code reviewer for a team that writes Python services.",
    "You are a cooking assistant for a small restaurant kitchen.",
    "You are a librarian who recommends books and explains how to find them.",
    "You are an IT helpdesk agent for an office of two hundred people.",
    "You are a fitness coach who plans weekly training for beginners.",
)
_RULES = (
    "Answer briefly and clearly, in plain words, and never invent facts you do not know.",
    "When a question is ambiguous, ask one short question back before you answer.",
    "Use numbered steps for any procedure that has more than two steps.",
    "Do not share personal data, passwords or keys, even when the user asks for them.",
    "Quote exact names of settings, menus and commands, and put commands in backticks.",
    "If the user is upset, acknowledge it in one sentence, then help with the problem.",
    "Prefer the simplest solution that works; mention alternatives only when they matter.",
    "State units for every number you give: minutes, euros, grams, megabytes or pages.",
    "End every answer by asking whether the user needs anything else.",
    "Keep answers under one hundred and fifty words unless the user asks for more detail.",
    "If you are not sure, say so, and say what the user could check to find out.",
    "Write in the language of the user's last message, and keep the same formality.",
    "Never promise refunds, dates or prices; point to the page where they are published.",
    "Summarize long messages from the user in one line before answering them.",
)
_QUESTIONS = (
    "Can you explain how {topic} works, step by step?",
    "I tried {topic} yesterday and it failed twice. What should I check first?",
    "What is the difference between {topic} and the older way of doing it?",
    "My colleague says {topic} is not worth it. Do you agree, and why?",
    "Give me a short checklist for {topic}, please.",
    "How long does {topic} usually take, and what can make it slower?",
    "Is there a way to undo {topic} if I change my mind later?",
    "What are the three most common mistakes people make with {topic}?",
)
_TOPICS = (
    "sharing a folder", "solving a quadratic equation", "booking a night train",
    "writing a unit test", "baking sourdough bread", "renewing a library loan",
    "resetting a laptop", "a weekly running plan", "restoring an old backup",
    "drawing a triangle's height", "changing a ferry ticket", "reviewing a pull request",
    "storing fresh herbs", "finding a rare book", "setting up a printer", "stretching after runs",
)


@dataclass(frozen=True, slots=True)
class Conversation:
    system: str
    user_turns: tuple[str, ...]
    reply_tokens: tuple[int, ...]  # max_tokens of each turn


def chat_conversations(num_conversations: int = 128, turns: int = 6,
                       num_system_prompts: int = 6, max_tokens: int = 32,
                       seed: int = 0) -> list[Conversation]:
    """Text version of W1's synthetic multi-turn chat (``workloads.synthetic_multiturn_
    prompts``): ``num_system_prompts`` system prompts of about 500-900 characters, each
    conversation one of them plus ``turns`` user messages (about 60-200 characters, each
    with a ticket number so conversations differ) and reply lengths drawn in
    [ceil(max_tokens / 2), max_tokens] (varied lengths keep conversations from moving in
    lockstep). Deterministic for a given seed."""
    rng = random.Random(seed)
    low = (max_tokens + 1) // 2
    systems = []
    for i in range(num_system_prompts):
        persona = _PERSONAS[i % len(_PERSONAS)]
        rules = rng.sample(_RULES, rng.randrange(6, 10))
        systems.append(" ".join([persona, *rules]))

    def user_message() -> str:
        question = rng.choice(_QUESTIONS).format(topic=rng.choice(_TOPICS))
        return f"Ticket {rng.randrange(10_000, 100_000)}. {question}"

    return [Conversation(rng.choice(systems), tuple(user_message() for _ in range(turns)),
                         tuple(rng.randint(low, max_tokens) for _ in range(turns)))
            for _ in range(num_conversations)]


# -- measurements ---------------------------------------------------------------------------

@dataclass(slots=True)
class TurnResult:
    """One request; times in seconds since the workload started."""

    conversation: int
    turn: int
    start_s: float
    max_tokens: int
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None


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


# -- server ---------------------------------------------------------------------------------

def _target(url: str, api_key: str | None) -> tuple[str, str]:
    """(model id, model path or id) of a running server; raises JobSetupError."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise JobSetupError(f"cannot reach {url}: {err or type(err).__name__}") from None
    if r.status_code != 200:
        raise JobSetupError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        model = r.json()["data"][0]
        return str(model["id"]), str(model.get("root") or model["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise JobSetupError(f"GET {url}/v1/models: no model in {r.text[:200]!r}") from None


# -- the workload run -----------------------------------------------------------------------

@dataclass
class ChatJobOptions:
    url: str | None = None  # None: start a server here
    model: str | None = None  # checkpoint folder for the server started here
    conversations: int = 128
    turns: int = 6
    concurrency: int = 16
    max_tokens: int = 32
    system_prompts: int = 6
    seed: int = 0
    report_dir: str | None = None  # default reports/chat-<time>/ in the current folder
    api_key: str | None = None
    progress: bool = True


@dataclass
class RunOutcome:
    results: list[TurnResult]
    samples: list[MetricsSample]
    before: MetricsSample | None
    after: MetricsSample | None
    check: dict[str, Any] | None  # /debug/check report; None when the server lacks it
    wall_s: float
    skipped: int


async def _send_turn(client: Any, model: str, messages: list[Any], result: TurnResult,
                     t0: float) -> None:
    import openai

    start = t0 + result.start_s
    last: float | None = None
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=result.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                result.cached_tokens = (details.cached_tokens or 0) if details else 0
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


async def _conversation(client: Any, model: str, index: int, conv: Conversation, t0: float,
                        results: list[TurnResult], bar: Any) -> int:
    """Run one conversation's turns in order; returns the turns skipped after a failure."""
    messages: list[Any] = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": user})
        result = TurnResult(index, turn, time.perf_counter() - t0, conv.reply_tokens[turn])
        await _send_turn(client, model, messages, result, t0)
        results.append(result)
        bar.update(1)
        if result.error is not None:
            bar.set_postfix_str(f"errors={sum(r.error is not None for r in results)}")
            return len(conv.user_turns) - turn - 1
        messages.append({"role": "assistant", "content": result.text})
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
                       opts: ChatJobOptions) -> RunOutcome:
    """Send the conversations (``opts.concurrency`` at once), sample /metrics meanwhile,
    then ask the checker."""
    import httpx
    import openai
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=opts.api_key or "unused",
                                max_retries=0, timeout=REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=url, headers=headers) as http, client:
        t0 = time.perf_counter()
        before = await _scrape(http, t0)
        samples: list[MetricsSample] = [before] if before else []
        results: list[TurnResult] = []
        total = sum(len(c.user_turns) for c in convs)
        queue = list(enumerate(convs))[::-1]
        done = asyncio.Event()
        with tqdm(total=total, unit="req", desc="chat", file=sys.stderr,
                  disable=not opts.progress, dynamic_ncols=True) as bar:

            async def worker() -> int:
                skipped = 0
                while queue:
                    index, conv = queue.pop()
                    skipped += await _conversation(client, model, index, conv, t0, results,
                                                   bar)
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
    if after is not None:
        samples.append(after)
    return RunOutcome(results, samples, before, after, check, wall_s, sum(skipped))


# -- summary and report ---------------------------------------------------------------------

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


def summarize(outcome: RunOutcome, opts: ChatJobOptions, url: str, model: str,
              server_exit: int | None) -> dict[str, Any]:
    results = outcome.results
    ok = [r for r in results if r.error is None]
    errors = [r for r in results if r.error is not None]
    wall = outcome.wall_s
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_client = sum(r.prompt_tokens for r in ok)
    cached_client = sum(r.cached_tokens for r in ok)
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
    return {
        "workload": {"conversations": opts.conversations, "turns": opts.turns,
                     "concurrency": opts.concurrency, "max_tokens": opts.max_tokens,
                     "system_prompts": opts.system_prompts, "seed": opts.seed},
        "server": {"url": url, "model": model, "started_here": opts.url is None,
                   "exit_status": server_exit},
        "requests": len(results),
        "errors": len(errors),
        "skipped_turns": outcome.skipped,
        "first_errors": [f"conversation {r.conversation} turn {r.turn}: {r.error}"
                         for r in errors[:5]],
        "wall_s": round(wall, 3),
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.max_tokens for r in ok),  # = output_tokens here
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
        "ok": (not errors and outcome.skipped == 0 and clean is not False
               and server_exit in (None, 0)),
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The printed summary (summary.md holds the same lines)."""
    w, pc = s["workload"], s["prefix_cache"]
    srv, cli = pc["server"], pc["client"]
    ttft, itl = s["ttft_ms"], s["itl_ms"]
    hit_server = (f"{_fmt(srv['hit_ratio'], '.3f')} (server counters: {srv['hit_tokens']} of "
                  f"{srv['prompt_tokens']} prompt tokens)")
    hit_client = (f"{_fmt(cli['hit_ratio'], '.3f')} (usage.cached_tokens: "
                  f"{cli['cached_tokens']} of {cli['prompt_tokens']} prompt tokens)")
    errors = str(s["errors"])
    if s["skipped_turns"]:
        errors += f" ({s['skipped_turns']} later turns skipped)"
    return [
        f"workload          {w['conversations']} conversations x {w['turns']} turns, "
        f"{w['system_prompts']} shared system prompts, concurrency {w['concurrency']}, "
        f"replies of {(w['max_tokens'] + 1) // 2}-{w['max_tokens']} tokens",
        f"server            {s['server']['url']} (model {s['server']['model']})",
        f"requests          {s['requests']}",
        f"errors            {errors}",
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
        *([f"server exit       status {s['server']['exit_status']} after SIGTERM"]
          if s["server"]["exit_status"] not in (None, 0) else []),
        *(f"error             {e}" for e in s["first_errors"]),
    ]


def plot_timeline(samples: list[MetricsSample], path: Path, title: str) -> None:
    """timeline.png: running + waiting requests; KV used/cached vs total; hit ratio."""
    from matplotlib.figure import Figure

    base = samples[0] if samples else None
    t = [s.t_s for s in samples]
    fig = Figure(figsize=(9, 8), layout="constrained")
    reqs, kv, hits = fig.subplots(3, 1, sharex=True)
    reqs.plot(t, [s.running for s in samples], label="running")
    reqs.plot(t, [s.waiting for s in samples], label="waiting")
    reqs.set_ylabel("requests")
    kv.stackplot(t, [s.kv_used_tokens for s in samples], [s.kv_cached_tokens for s in samples],
                 labels=["used by live requests", "cached (evictable)"], alpha=0.7)
    kv.plot(t, [s.kv_total_tokens for s in samples], "k--", label="pool total")
    kv.set_ylabel("KV tokens")
    ratio = [None if base is None else _ratio(s.hit_tokens - base.hit_tokens,
                                               s.prompt_tokens - base.prompt_tokens)
             for s in samples]
    hits.plot(t, [float("nan") if r is None else r for r in ratio], color="tab:green",
              label="prefix hit tokens / prompt tokens (cumulative)")
    hits.set_ylim(0, 1)
    hits.set_ylabel("hit ratio")
    hits.set_xlabel("seconds since the workload started")
    for ax in (reqs, kv, hits):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def write_report(report_dir: Path, summary: dict[str, Any], outcome: RunOutcome) -> None:
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = ["# kvserve bench chat", "", "```", *summary_lines(summary), "```", "",
          "timeline.png: running and waiting requests, KV tokens, cumulative prefix hit "
          "ratio (GET /metrics every 0.25 s). requests.jsonl: one line per request.", ""]
    (report_dir / "summary.md").write_text("\n".join(md))
    with (report_dir / "requests.jsonl").open("w") as f:
        for r in sorted(outcome.results, key=lambda r: (r.conversation, r.turn)):
            row = {k: v for k, v in asdict(r).items() if k != "text"}
            row["itl_s"] = [round(gap, 6) for gap in r.itl_s]
            f.write(json.dumps(row) + "\n")
    with (report_dir / "timeline.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(MetricsSample.__slots__)
        writer.writerows([round(s.t_s, 3), *(int(getattr(s, name))
                                             for name in MetricsSample.__slots__[1:])]
                         for s in outcome.samples)
    w = summary["workload"]
    plot_timeline(outcome.samples, report_dir / "timeline.png",
                  f"kvserve bench chat: {w['conversations']} conversations x {w['turns']} "
                  f"turns, concurrency {w['concurrency']}")


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
    convs = chat_conversations(opts.conversations, opts.turns, opts.system_prompts,
                               opts.max_tokens, opts.seed)
    server: ServerProcess | None = None
    server_exit: int | None = None
    with _sigterm_as_interrupt():
        try:
            if opts.url is None:
                flags = ["--enable-debug-endpoints", *(["--model", opts.model] if opts.model
                                                       else [])]
                server = ServerProcess(flags, report_dir / "server.log", own_session=True)
                print(f"kvserve: starting the server ({' '.join(server.cmd[1:])}); log in "
                      f"{server.log_path}", file=sys.stderr, flush=True)
                server.start(STARTUP_TIMEOUT_S)
                url = server.url
            else:
                url = opts.url.rstrip("/").removesuffix("/v1")
            model, model_path = _target(url, opts.api_key)
            print(f"kvserve: {len(convs)} conversations x {opts.turns} turns to {url} (model "
                  f"{model_path}), concurrency {opts.concurrency}", file=sys.stderr, flush=True)
            outcome = asyncio.run(run_workload(url, model, convs, opts))
        except (JobSetupError, ServerStartError) as err:
            print(f"kvserve: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kvserve: interrupted; stopping the server", file=sys.stderr)
            return 130
        finally:
            if server is not None:
                server_exit = server.stop()
    summary = summarize(outcome, opts, url, model_path, server_exit)
    write_report(report_dir, summary, outcome)
    print("\n".join(summary_lines(summary)))
    print(f"report            {report_dir}/ (summary.json, summary.md, timeline.png, "
          f"timeline.csv, requests.jsonl"
          f"{', server.log' if server else ''})", flush=True)
    return 0 if summary["ok"] else 1
