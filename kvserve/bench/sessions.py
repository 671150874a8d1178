"""Streaming sessions against the radix cache alone, over HTTP (``kvserve bench chat
--mode`` and ``kvserve bench trace-sessions``).

Shared pieces: the per-run figures both benchmarks report (``run_metrics``: TTFT p50/p99
over all turns and over later turns, prefill tokens computed, output tokens/s, hit
ratio, later turns that reused their whole previous context), the side-by-side lines
(``comparison_lines``) and the session endpoints (``open_session``, ``close_session``:
SGLang's ``/open_session`` and ``/close_session``).

The Mooncake conversation trace's chained turns (``trace_chains``, ``run_chains``)::

    chain         rows whose hash_ids start with the previous row's (all of them, or all
                  but its last, partial block), at least 2 blocks: a later turn of the
                  same conversation (``chain_rows``)
    tokens        hash id h -> ``block`` tokens to_vocab(h * block + i) (deterministic, as
                  ``bench replay``); a row keeps ceil(input_length * block / 512) of them
    output        max(1, ceil(output_length * block / 512)) tokens, ignore_eos (exact)
    turn 0        context = the first row's tokens
    turn k        context = context of turn k-1 + its output + the new tokens, which are
                  row k's tokens past row k-1's full blocks (the trace's next prompt
                  restates row k-1's partial last block and holds the answer; here the
                  model's own output stands for the answer)
    sessions      /generate with session_params {"id", "rid" of turn k-1}: the request
                  sends only the new tokens, the session holds the rest
    radix         /generate with the whole context, no session: the radix tree matches it

Both modes run the same turns on the same server, cache flushed before each run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from kvserve.bench.stats import percentile
from kvserve.bench.workloads import MOONCAKE_BLOCK_TOKENS

MODES = ("radix", "sessions")


# -- what every run reports -----------------------------------------------------------------

@dataclass(slots=True)
class TurnStat:
    """One turn as the reports count it (tokens exact, seconds wall-clock).

    ``held_tokens``: the previous turn's context whose KV a session keeps (its prompt +
    completion - 1: the last sampled token has no KV yet); 0 for a first turn. A later
    turn "reused its whole previous context" when ``cached_tokens >= held_tokens``.
    """

    turn: int  # 0-based
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    held_tokens: int = 0
    ok: bool = True


def held_tokens(prompt_tokens: int, completion_tokens: int) -> int:
    """KV tokens a completed turn leaves in its session's slot (prompt + output - 1)."""
    return max(0, prompt_tokens + completion_tokens - 1)


def _pcts(values: list[float]) -> dict[str, float | None]:
    """p50/p99 of ``values`` (seconds) in milliseconds; None for no values."""
    return {f"p{p}": round(percentile(values, p) * 1000, 2) if values else None
            for p in (50, 99)}


def run_metrics(turns: Sequence[TurnStat], wall_s: float) -> dict[str, Any]:
    """One run's figures: TTFT ms p50/p99 (all turns, and turns >= 2), prompt, cached and
    prefill tokens (prefill = prompt - cached, what the model computed; summed over
    succeeded turns, and over later turns), output tokens and tokens/s over ``wall_s``,
    hit ratio, and how many later turns reused their whole previous context."""
    ok = [t for t in turns if t.ok]
    later = [t for t in ok if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    output = sum(t.completion_tokens for t in ok)
    return {
        "requests": len(turns), "errors": len(turns) - len(ok),
        "ttft_ms": _pcts([t.ttft_s for t in ok if t.ttft_s is not None]),
        "ttft_ms_later_turns": _pcts([t.ttft_s for t in later if t.ttft_s is not None]),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "prefill_tokens_later_turns": sum(t.prompt_tokens - t.cached_tokens for t in later),
        "hit_ratio": round(cached / prompt, 4) if prompt else None,
        "output_tokens": output,
        "output_tokens_per_s": round(output / wall_s, 2) if wall_s > 0 else None,
        "wall_s": round(wall_s, 3),
        "later_turns": len(later),
        "later_turns_whole_context_reused": sum(t.cached_tokens >= t.held_tokens > 0
                                                for t in later),
    }


def _change(new: float | None, old: float | None) -> float | None:
    """Relative change from ``old`` to ``new`` in percent (-25.0: a quarter less)."""
    if new is None or old is None or old == 0:
        return None
    return round((new - old) / old * 100, 1)


def comparison(radix: dict[str, Any], sessions: dict[str, Any]) -> dict[str, float | None]:
    """Sessions against radix in percent (negative: less): prefill tokens (all turns and
    later turns), TTFT p50/p99 of later turns, output tokens/s."""
    return {
        "prefill_tokens_pct": _change(sessions["prefill_tokens"], radix["prefill_tokens"]),
        "prefill_tokens_later_turns_pct": _change(sessions["prefill_tokens_later_turns"],
                                                  radix["prefill_tokens_later_turns"]),
        "ttft_p50_later_turns_pct": _change(sessions["ttft_ms_later_turns"]["p50"],
                                            radix["ttft_ms_later_turns"]["p50"]),
        "ttft_p99_later_turns_pct": _change(sessions["ttft_ms_later_turns"]["p99"],
                                            radix["ttft_ms_later_turns"]["p99"]),
        "output_tokens_per_s_pct": _change(sessions["output_tokens_per_s"],
                                           radix["output_tokens_per_s"]),
    }


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "" if value is None else f" ({value:+.1f}%)"


def comparison_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The runs side by side, one figure a line; with both modes, the sessions column
    also gives its change against radix."""
    names = [m for m in MODES if m in runs]
    diff = comparison(runs["radix"], runs["sessions"]) if len(names) == 2 else {}

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<34}" + "".join(f"{c:<26}" for c in cells).rstrip()

    def ms(m: dict[str, Any], key: str) -> str:
        return f"{_num(m[key]['p50'], '.1f')} / {_num(m[key]['p99'], '.1f')}"

    lines = [row("", names)]
    for label, key, pct in (("TTFT ms p50 / p99, all turns", "ttft_ms", None),
                            ("TTFT ms p50 / p99, turns >= 2", "ttft_ms_later_turns",
                             "ttft_p50_later_turns_pct")):
        cells = [ms(runs[n], key) for n in names]
        if diff and pct:
            cells[-1] += (f" ({_num(diff[pct], '+.1f')}% / "
                          f"{_num(diff['ttft_p99_later_turns_pct'], '+.1f')}%)")
        lines.append(row(label, cells))
    for label, key, pct in (
            ("prefill tokens computed", "prefill_tokens", "prefill_tokens_pct"),
            ("  of them turns >= 2", "prefill_tokens_later_turns",
             "prefill_tokens_later_turns_pct")):
        cells = [str(runs[n][key]) for n in names]
        if diff:
            cells[-1] += _pct(diff[pct])
        lines.append(row(label, cells))
    cells = [f"{_num(runs[n]['output_tokens_per_s'], '.1f')} ({runs[n]['output_tokens']} "
             "tokens)" for n in names]
    if diff:
        cells[-1] += _pct(diff["output_tokens_per_s_pct"])
    lines.append(row("output tokens/s", cells))
    lines.append(row("hit ratio (cached / prompt)",
                     [f"{_num(runs[n]['hit_ratio'], '.3f')} ({runs[n]['cached_tokens']} of "
                      f"{runs[n]['prompt_tokens']})" for n in names]))
    lines.append(row("turns >= 2 reusing all held KV",
                     [f"{runs[n]['later_turns_whole_context_reused']} of "
                      f"{runs[n]['later_turns']}" for n in names]))
    if any(runs[n].get("server_sessions") for n in names):
        lines.append(row("server: slot hits / mismatches", [
            "n/a" if not (c := runs[n].get("server_sessions")) else
            f"{c['slot_hits']} / {c['mismatches']}" for n in names]))
        lines.append(row("server: rollbacks / reclaimed", [
            "n/a" if not (c := runs[n].get("server_sessions")) else
            f"{c['rollbacks']} / {c['reclaimed']}" for n in names]))
    lines.append(row("errors", [str(runs[n]["errors"]) for n in names]))
    return lines


# -- session endpoints ------------------------------------------------------------------------

# EngineStats counters of /get_server_info's "stats" (``sched.session.SessionStats``)
SESSION_COUNTERS = ("session_slot_hits", "session_mismatches", "session_rollbacks",
                    "session_reclaimed")


async def session_counters(http: Any) -> dict[str, int] | None:
    """The server's session counters (cumulative); None when it reports none."""
    import httpx

    try:
        r = await http.get("/get_server_info", timeout=10)
        stats = r.json().get("stats") or {} if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not all(k in stats for k in SESSION_COUNTERS):
        return None
    return {k: int(stats[k]) for k in SESSION_COUNTERS}


def counters_change(before: dict[str, int] | None,
                    after: dict[str, int] | None) -> dict[str, int] | None:
    """What a run added to the session counters (names without ``session_``)."""
    if before is None or after is None:
        return None
    return {k.removeprefix("session_"): after[k] - before[k] for k in SESSION_COUNTERS}


class SessionApiError(RuntimeError):
    """The server refused a session command (or has no session API)."""


async def open_session(http: Any) -> str:
    """``POST /open_session``; returns the session id. Raises SessionApiError."""
    r = await http.post("/open_session", json={}, timeout=60)
    if r.status_code != 200:
        raise SessionApiError(f"POST /open_session answered {r.status_code}: {r.text[:200]}")
    sid = r.json()
    if not isinstance(sid, str) or not sid:
        raise SessionApiError(f"POST /open_session returned {sid!r}, not a session id")
    return sid


async def close_session(http: Any, sid: str) -> None:
    """``POST /close_session``. Raises SessionApiError."""
    r = await http.post("/close_session", json={"session_id": sid}, timeout=60)
    if r.status_code != 200:
        raise SessionApiError(f"POST /close_session {sid!r} answered {r.status_code}: "
                              f"{r.text[:200]}")


async def flush_cache(http: Any, tries: int = 20) -> None:
    """``POST /flush_cache`` (refused while requests are in flight: retried)."""
    for _ in range(tries):
        r = await http.post("/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        await asyncio.sleep(0.5)
    raise SessionApiError(f"POST /flush_cache answered {r.status_code}: {r.text[:200]}")


# -- Mooncake chained turns -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # 1-based line of the trace
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int


@dataclass(frozen=True, slots=True)
class ChainTurn:
    new_ids: tuple[int, ...]  # turn 0: the whole prompt; later: the tokens past the history
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Chain:
    rows: tuple[int, ...]  # trace lines of its turns
    turns: tuple[ChainTurn, ...]

    def context_tokens(self) -> int:
        """Tokens of the last turn's context plus its output."""
        return sum(len(t.new_ids) + t.max_new_tokens for t in self.turns)


def read_trace_rows(path: str | Path) -> list[TraceRow]:
    """The rows of a Mooncake trace. Raises OSError, or ValueError naming the line."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(TraceRow(line_no, tuple(int(h) for h in row["hash_ids"]),
                                     int(row["input_length"]), int(row.get("output_length", 1))))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({err})") from err
    return rows


MIN_SHARED_BLOCKS = 2  # a parent shares more than the system prompt's first block


def chain_rows(rows: Sequence[TraceRow]) -> list[list[int]]:
    """Rows (indices) grouped into conversation chains, in order of their first row.

    Row i's parent is the earlier row j sharing the most leading blocks with it, at
    least ``MIN_SHARED_BLOCKS``, where row i starts with all of j's hash_ids or with all
    but j's last (which covers a partial block: the next turn restates it whole, under
    another id); the latest such row on a tie. Ids are prefix-chained, so a prefix is
    known by its last id. Row i continues j's chain when that chain ends at j;
    otherwise (no parent, or j already has a next turn: a branch) it starts a chain."""
    by_last: dict[int, int] = {}  # last id -> latest row whose hash_ids end with it
    by_full: dict[int, int] = {}  # id -> latest row whose full blocks end with it
    chain_of: dict[int, int] = {}  # row -> its chain, for rows that end their chain
    chains: list[list[int]] = []
    for i, row in enumerate(rows):
        ids = row.hash_ids
        parent = None
        for k in range(len(ids), MIN_SHARED_BLOCKS - 1, -1):
            whole = by_last.get(ids[k - 1]) if k < len(ids) else None
            if whole is not None and rows[whole].hash_ids == ids[:k]:
                parent = whole
                break
            full = by_full.get(ids[k - 1])
            if full is not None and rows[full].hash_ids[:-1] == ids[:k]:
                parent = full
                break
        if parent is not None and parent in chain_of:
            c = chain_of.pop(parent)
            chains[c].append(i)
        else:
            c = len(chains)
            chains.append([i])
        chain_of[i] = c
        if ids:
            by_last[ids[-1]] = i
        if len(ids) > MIN_SHARED_BLOCKS:
            by_full[ids[-2]] = i
    return chains


def _row_tokens(row: TraceRow, block: int, vocab_size: int) -> list[int]:
    from kvserve.bench.replay import to_vocab  # lazily: replay imports torch

    length = -(-row.input_length * block // MOONCAKE_BLOCK_TOKENS)
    ids = [to_vocab(h * block + i, vocab_size) for h in row.hash_ids for i in range(block)]
    return ids[:max(1, length)]


def trace_chains(rows: Sequence[TraceRow], block: int, vocab_size: int, num_chains: int,
                 max_turns: int, min_turns: int = 2, max_context: int = 2048) -> list[Chain]:
    """The first ``num_chains`` chains (``chain_rows``) with at least ``min_turns`` turns
    that fit ``max_context`` tokens (context + output of every turn), each cut to
    ``max_turns`` turns and to the turns that fit. See the module docstring for the
    mapping of rows to turns."""
    out: list[Chain] = []
    for indices in chain_rows(rows):
        if len(out) >= num_chains:
            break
        turns: list[ChainTurn] = []
        used = 0
        prev: TraceRow | None = None
        for i in indices[:max_turns]:
            row = rows[i]
            ids = _row_tokens(row, block, vocab_size)
            new = ids if prev is None else ids[(len(prev.hash_ids) - 1) * block:]
            out_len = max(1, -(-row.output_length * block // MOONCAKE_BLOCK_TOKENS))
            if not new or used + len(new) + out_len > max_context:
                break
            turns.append(ChainTurn(tuple(new), out_len))
            used += len(new) + out_len
            prev = row
        if len(turns) >= min_turns:
            out.append(Chain(tuple(rows[i].line for i in indices[:len(turns)]), tuple(turns)))
    return out


@dataclass(slots=True)
class ChainTurnResult:
    chain: int
    turn: int
    mode: str
    start_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


async def generate_stream(http: Any, body: dict[str, Any], result: ChainTurnResult,
                          t0: float) -> None:
    """POST /generate (stream) and fill ``result``: TTFT at the first event with output
    tokens, the final meta_info counts and output ids. An error lands in ``result.error``."""
    import httpx

    start = t0 + result.start_s
    try:
        async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return
                if event.get("output_ids") and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                meta = event["meta_info"]
                result.output_ids = list(event.get("output_ids") or [])
                result.prompt_tokens = meta["prompt_tokens"]
                result.cached_tokens = meta["cached_tokens"]
                result.completion_tokens = meta["completion_tokens"]
                if meta.get("finish_reason"):
                    result.finish = meta["finish_reason"]["type"]
    except (httpx.HTTPError, ValueError, KeyError) as err:
        result.error = f"{type(err).__name__}: {err}"
    finally:
        result.end_s = time.perf_counter() - t0


async def _run_chain(http: Any, index: int, chain: Chain, mode: str, tag: str, t0: float,
                     results: list[ChainTurnResult]) -> None:
    sid = await open_session(http) if mode == "sessions" else None
    context: list[int] = []
    prev_rid: str | None = None
    try:
        for k, turn in enumerate(chain.turns):
            rid = f"{tag}-{mode}-c{index}-t{k}"
            body: dict[str, Any] = {
                "rid": rid, "sampling_params": {"max_new_tokens": turn.max_new_tokens,
                                                "temperature": 0.0, "ignore_eos": True}}
            if sid is None:
                body["input_ids"] = context + list(turn.new_ids)
            else:
                body["input_ids"] = list(turn.new_ids)
                body["session_params"] = {"id": sid, "rid": prev_rid}
            result = ChainTurnResult(index, k, mode, time.perf_counter() - t0)
            await generate_stream(http, body, result, t0)
            results.append(result)
            if result.error is not None:
                return
            context += [*turn.new_ids, *result.output_ids]
            prev_rid = rid
    finally:
        if sid is not None:
            await close_session(http, sid)


async def run_chains(url: str, chains: Sequence[Chain], mode: str, concurrency: int,
                     tag: str, transport: Any = None) -> tuple[list[ChainTurnResult], float]:
    """Every chain's turns in order, ``concurrency`` chains at once; returns the turns
    and the wall time in seconds. ``tag`` makes the request ids unique per run;
    ``transport``: an ``httpx`` transport instead of the network (tests)."""
    import httpx

    results: list[ChainTurnResult] = []
    queue = list(enumerate(chains))[::-1]
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as http:
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                index, chain = queue.pop()
                await _run_chain(http, index, chain, mode, tag, t0, results)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, max((r.end_s for r in results), default=0.0)


def turn_stats_by(results: Iterable[Any], thread: Callable[[Any], int]) -> list[TurnStat]:
    """``TurnStat`` of each turn result (``turn``, ``ttft_s``, token counts, ``error``),
    ``held_tokens`` from the previous turn of the same ``thread(result)`` (a chain, a
    conversation), in (thread, turn) order."""
    by_key = {(thread(r), r.turn): r for r in results}
    stats = []
    for (key, turn), r in sorted(by_key.items()):
        prev = by_key.get((key, turn - 1))
        held = held_tokens(prev.prompt_tokens, prev.completion_tokens) if prev else 0
        stats.append(TurnStat(turn, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                              r.completion_tokens, held, r.error is None))
    return stats


def chain_turn_stats(results: Iterable[ChainTurnResult]) -> list[TurnStat]:
    """``TurnStat`` of each turn, ``held_tokens`` from the chain's previous turn."""
    return turn_stats_by(results, attrgetter("chain"))


# -- kvserve bench trace-sessions ---------------------------------------------------------------

STARTUP_TIMEOUT_S = 300.0


@dataclass
class TraceSessionsOptions:
    trace: str
    url: str | None = None  # None: start kvserve serve here
    model: str | None = None  # the server started here; None: its default
    mode: str = "both"  # "radix", "sessions" or "both"
    block: int = 16  # tokens per trace block (Mooncake's are 512)
    chains: int = 16
    turns: int = 4  # most turns per chain
    min_turns: int = 3
    max_context: int = 2048  # tokens: a chain's turns stop before this
    concurrency: int = 4
    vocab_size: int | None = None  # None: the served model's config.json
    report_dir: str | None = None


def model_vocab_size(url: str) -> int:
    """``vocab_size`` of the served model's config.json (``/get_model_info``'s
    model_path, read on this machine). Raises SessionApiError when unreadable."""
    import httpx

    try:
        path = httpx.get(url + "/get_model_info", timeout=10).json()["model_path"]
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as err:
        raise SessionApiError(f"cannot read the model's vocab_size ({err}); give "
                              "--vocab-size") from None


async def _check(url: str) -> dict[str, Any] | None:
    import httpx

    from kvserve.bench.chat import _debug_check

    async with httpx.AsyncClient(base_url=url) as http:
        return await _debug_check(http)


async def _counters(url: str) -> dict[str, int] | None:
    import httpx

    async with httpx.AsyncClient(base_url=url) as http:
        return await session_counters(http)


def trace_report(opts: TraceSessionsOptions, chains: Sequence[Chain],
                 runs: dict[str, dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """summary.json of ``bench trace-sessions``: the workload, each run's figures
    (``run_metrics`` with its checker verdict) and, with both modes, the comparison."""
    return {
        "trace": str(opts.trace), "server": facts,
        "workload": {"block": opts.block, "chains": len(chains),
                     "turns": sum(len(c.turns) for c in chains),
                     "max_turns": opts.turns,
                     "min_turns": opts.min_turns, "max_context": opts.max_context,
                     "concurrency": opts.concurrency,
                     "new_tokens": sum(len(t.new_ids) for c in chains for t in c.turns),
                     "output_tokens": sum(t.max_new_tokens for c in chains for t in c.turns),
                     "trace_lines": [list(c.rows) for c in chains]},
        "runs": runs,
        **({"comparison": comparison(runs["radix"], runs["sessions"])}
           if len(runs) == 2 else {}),
        "ok": all(r["errors"] == 0 and r["checker_clean"] is not False
                  for r in runs.values()),
    }


def trace_lines(s: dict[str, Any]) -> list[str]:
    w, srv = s["workload"], s["server"]
    return [
        f"trace             {s['trace']}: {w['chains']} chains, {w['turns']} turns "
        f"(at most {w['max_turns']} a chain, at least {w['min_turns']}), {w['block']} tokens "
        f"a block, contexts up to {w['max_context']} tokens; {w['new_tokens']} new prompt "
        f"tokens, {w['output_tokens']} output tokens (ignore_eos)",
        f"server            {srv['url']}, model {srv['model']}, KV pool "
        f"{srv['kv_pool_tokens']} tokens, page {srv['page_size']}, concurrency "
        f"{w['concurrency']} chains",
        *comparison_lines(s["runs"]),
        *(f"checker after {name}: {r['checker_verdict']}" for name, r in s["runs"].items()),
    ]


def run_trace_sessions(opts: TraceSessionsOptions) -> int:
    """``kvserve bench trace-sessions``: exit 0 when every turn succeeded and the checker
    was clean after each run, 1 otherwise, 2 for a setup failure."""
    import sys

    from kvserve.bench.chat import MODES as CHAT_MODES
    from kvserve.bench.chat import JobSetupError, checker_verdict, prepare_run, server_facts
    from kvserve.server.process import ServerProcess, ServerStartError

    report_dir = Path(opts.report_dir or
                      f"reports/trace-sessions-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        rows = read_trace_rows(opts.trace)
        report_dir.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as err:
        print(f"kvserve: {err}", file=sys.stderr)
        return 2
    server: ServerProcess | None = None
    runs: dict[str, dict[str, Any]] = {}
    turns_out: list[ChainTurnResult] = []
    try:
        if opts.url is None:
            server = ServerProcess(["--enable-debug-endpoints",
                                    *(["--model", opts.model] if opts.model else [])],
                                   report_dir / "server.log", own_session=True)
            print(f"kvserve: starting the server; log in {server.log_path}", file=sys.stderr,
                  flush=True)
            server.start(STARTUP_TIMEOUT_S)
            url = server.url
        else:
            url = opts.url.rstrip("/")
        facts = {"url": url, **server_facts(url, None)}
        vocab = opts.vocab_size or model_vocab_size(url)
        chains = trace_chains(rows, opts.block, vocab, opts.chains, opts.turns,
                              opts.min_turns, opts.max_context)
        if not chains:
            print("kvserve: no chain of the trace fits these limits", file=sys.stderr)
            return 2
        tag = time.strftime("%H%M%S")
        for i, mode in enumerate(CHAT_MODES[opts.mode]):
            asyncio.run(prepare_run(url, facts["model"], None, warm_up=i == 0))
            before = asyncio.run(_counters(url))
            results, wall = asyncio.run(run_chains(url, chains, mode, opts.concurrency, tag))
            clean, verdict = checker_verdict(asyncio.run(_check(url)))
            runs[mode] = {**run_metrics(chain_turn_stats(results), wall),
                          "server_sessions": counters_change(before,
                                                             asyncio.run(_counters(url))),
                          "checker_clean": clean, "checker_verdict": verdict}
            turns_out += results
    except (JobSetupError, ServerStartError, SessionApiError) as err:
        print(f"kvserve: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvserve: interrupted; stopping the server", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
    summary = trace_report(opts, chains, runs, facts)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = trace_lines(summary)
    (report_dir / "summary.md").write_text("\n".join(
        ["# kvserve bench trace-sessions", "", "```", *lines, "```", ""]))
    with (report_dir / "turns.jsonl").open("w") as f:
        for r in turns_out:
            row = {k: getattr(r, k) for k in ChainTurnResult.__slots__ if k != "output_ids"}
            f.write(json.dumps(row) + "\n")
    print("\n".join(lines))
    print(f"report            {report_dir}/ (summary.json, summary.md, turns.jsonl"
          f"{', server.log' if server else ''})", flush=True)
    return 0 if summary["ok"] else 1
