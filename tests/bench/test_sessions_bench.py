"""The sessions benchmarks' logic (``kvserve.bench.sessions``, ``bench chat --mode``):
run figures, the side-by-side lines, the Mooncake chain selection and turn mapping, and
the clients' requests against fakes of the session API (exact values, no clocks)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.bench.chat import (
    ChatJobOptions,
    RunOutcome,
    TurnResult,
    _conversation,
    chat_conversations,
    summarize,
    summary_lines,
    turn_stats,
)
from kvserve.bench.sessions import (
    Chain,
    ChainTurn,
    TraceRow,
    TurnStat,
    chain_rows,
    chain_turn_stats,
    comparison,
    comparison_lines,
    read_trace_rows,
    run_chains,
    run_metrics,
    trace_chains,
)
from kvserve.cli import build_parser

TRACE = (Path(__file__).resolve().parents[3]
         / "shared/data/traces/mooncake_conversation_trace.jsonl")


def _turns(cached_later: int) -> list[TurnStat]:
    """Two conversations of two turns; the later turns had 100 tokens of KV held."""
    return [TurnStat(0, 0.5, 80, 0, 20), TurnStat(1, 0.2, 130, cached_later, 20, 99),
            TurnStat(0, 0.7, 90, 64, 20), TurnStat(1, 0.4, 140, cached_later, 20, 109),
            TurnStat(2, None, 0, 0, 0, 0, ok=False)]


def test_run_metrics_counts_prefill_as_prompt_minus_cached():
    m = run_metrics(_turns(96), wall_s=4.0)
    assert m == {
        "requests": 5, "errors": 1,
        "ttft_ms": {"p50": 450.0, "p99": 694.0},
        "ttft_ms_later_turns": {"p50": 300.0, "p99": 398.0},
        "prompt_tokens": 440, "cached_tokens": 256, "prefill_tokens": 184,
        "prefill_tokens_later_turns": 78, "hit_ratio": 0.5818,
        "output_tokens": 80, "output_tokens_per_s": 20.0, "wall_s": 4.0,
        "later_turns": 2, "later_turns_whole_context_reused": 0,
    }
    # a slot hit covers the whole held context (prompt + completion - 1 of the turn before)
    assert run_metrics(_turns(100), 4.0)["later_turns_whole_context_reused"] == 1
    assert run_metrics(_turns(109), 4.0)["later_turns_whole_context_reused"] == 2
    assert run_metrics([], 0.0)["ttft_ms"] == {"p50": None, "p99": None}


def test_comparison_is_the_sessions_change_in_percent():
    radix, sessions = run_metrics(_turns(96), 4.0), run_metrics(_turns(109), 3.2)
    assert comparison(radix, sessions) == {
        "prefill_tokens_pct": -14.1, "prefill_tokens_later_turns_pct": -33.3,
        "ttft_p50_later_turns_pct": 0.0, "ttft_p99_later_turns_pct": 0.0,
        "output_tokens_per_s_pct": 25.0}
    lines = comparison_lines({"radix": radix, "sessions": sessions})
    assert lines[0].split() == ["radix", "sessions"]
    assert lines[3] == f"{'prefill tokens computed':<34}{'184':<26}158 (-14.1%)"
    assert lines[4] == f"{'  of them turns >= 2':<34}{'78':<26}52 (-33.3%)"
    assert lines[-2] == f"{'turns >= 2 reusing all held KV':<34}{'0 of 2':<26}2 of 2"
    only = comparison_lines({"sessions": sessions})
    assert only[0].split() == ["sessions"] and "%" not in "".join(only)


def _row(line: int, *ids: int, length: int = 0, out: int = 512) -> TraceRow:
    return TraceRow(line, ids, length or 512 * len(ids), out)


def test_chains_follow_rows_that_restate_the_previous_rows_full_blocks():
    rows = [_row(1, 0, 1, 2, 3),
            _row(2, 0, 7, 8),
            _row(3, 0, 1, 2, 9, 10),  # 1's full blocks (0 1 2), then new ones: after 1
            _row(4, 0, 1, 2, 9, 11),  # 3's full blocks: after 3
            _row(5, 0, 1, 2, 5),  # 1's full blocks, but 1 already went on to 3: a branch
            _row(6, 0, 7, 13),  # 2's two full blocks: after 2
            _row(7, 0, 1, 2, 9, 11, 14),  # all of 4's blocks, the longest share: after 4
            _row(8, 0, 20, 21)]  # only the first block (a system prompt) shared: a start
    assert chain_rows(rows) == [[0, 2, 3, 6], [1, 5], [4], [7]]


def test_trace_chain_turns_are_new_tokens_past_the_previous_full_blocks():
    rows = [_row(1, 5, 6, length=700, out=100), _row(2, 5, 6, 7, length=1300, out=3),
            _row(3, 9, length=10), _row(4, 5, 6, 7, 8, length=2000, out=2000)]
    chains = trace_chains(rows, block=4, vocab_size=50, num_chains=5, max_turns=3,
                          min_turns=2, max_context=1000)
    assert len(chains) == 1 and chains[0].rows == (1, 2, 4)
    turns = chains[0].turns
    # 700 tokens at 4 per 512-token block: ceil(5.47) = 6 of blocks 5, 6
    assert [len(t.new_ids) for t in turns] == [6, 11 - 4, 16 - 8]
    assert [t.max_new_tokens for t in turns] == [1, 1, 16]  # ceil(out * 4 / 512)
    from kvserve.bench.replay import to_vocab
    assert turns[1].new_ids == tuple(to_vocab(t, 50) for t in (*range(24, 28), 28, 29, 30))
    assert chains[0].context_tokens() == 6 + 7 + 8 + 1 + 1 + 16
    # a context limit cuts the chain at the turn that would pass it
    short = trace_chains(rows, 4, 50, 5, 3, 2, max_context=16)
    assert [len(c.turns) for c in short] == [2]
    assert trace_chains(rows, 4, 50, 5, 3, 3, max_context=16) == []


@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} absent")
def test_conversation_trace_chains():
    rows = read_trace_rows(TRACE)
    assert len(rows) == 12_031 and len(chain_rows(rows)) == 8101
    chains = trace_chains(rows, 16, 49152, 3, 4, 3, 2048)
    assert [c.rows for c in chains] == [(4, 1586, 1901, 2200), (21, 309, 1584, 2410),
                                        (22, 219, 458)]
    assert [[(len(t.new_ids), t.max_new_tokens) for t in c.turns] for c in chains] == [
        [(72, 10), (18, 15), (17, 8), (1, 9)], [(824, 12), (20, 12), (26, 11), (79, 14)],
        [(190, 15), (29, 14), (27, 16)]]


class FakeSessionServer:
    """/open_session, /close_session and streaming /generate with SGLang's session
    semantics over token counts: a session turn's context is turn rid's context + its
    output + the new tokens, and the held KV (context + output - 1) is reused; without
    a session, full 16-token pages of the previous context are "cached"."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, list[int]]] = {}
        self.contexts: dict[str, list[int]] = {}  # rid -> its context + output
        self.bodies: list[dict[str, Any]] = []
        self.closed: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/open_session":
            sid = f"s{len(self.sessions)}"
            self.sessions[sid] = {}
            return httpx.Response(200, json=sid)
        if request.url.path == "/close_session":
            self.closed.append(body["session_id"])
            return httpx.Response(200, json={})
        self.bodies.append(body)
        params = body.get("session_params")
        new = body["input_ids"]
        if params is None:
            context, cached = new, 0
            for prev in self.contexts.values():
                if context[:len(prev) - 1] == prev[:-1]:
                    cached = max(cached, (len(prev) - 1) // 16 * 16)
        else:
            base = self.contexts[params["rid"]] if params.get("rid") else []
            context, cached = base + new, max(0, len(base) - 1)
        n = body["sampling_params"]["max_new_tokens"]
        out = list(range(1000, 1000 + n))
        self.contexts[body["rid"]] = context + out
        meta = {"prompt_tokens": len(context), "cached_tokens": cached,
                "completion_tokens": n, "finish_reason": {"type": "length"}}
        events = [{"output_ids": out[:1], "meta_info": {**meta, "finish_reason": None}},
                  {"output_ids": out, "meta_info": meta}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(),
                              headers={"content-type": "text/event-stream"})


def test_chains_run_through_sessions_send_only_new_tokens():
    chain = Chain((1, 2, 3), (ChainTurn(tuple(range(40)), 8), ChainTurn((7, 7, 7), 4),
                              ChainTurn((9,) * 20, 2)))
    runs = {}
    for mode in ("radix", "sessions"):
        fake = FakeSessionServer()
        results, _ = asyncio.run(run_chains("http://fake", [chain], mode, 1, "t",
                                            httpx.MockTransport(fake.handler)))
        assert [r.error for r in results] == [None] * 3
        runs[mode] = (fake, chain_turn_stats(results))
    radix, sessions = runs["radix"][0], runs["sessions"][0]
    # radix: the whole context each turn; sessions: the new tokens and the previous rid
    assert [len(b["input_ids"]) for b in radix.bodies] == [40, 40 + 8 + 3, 51 + 4 + 20]
    assert [len(b["input_ids"]) for b in sessions.bodies] == [40, 3, 20]
    assert [b["session_params"] for b in sessions.bodies] == [
        {"id": "s0", "rid": None}, {"id": "s0", "rid": "t-sessions-c0-t0"},
        {"id": "s0", "rid": "t-sessions-c0-t1"}]
    assert "session_params" not in radix.bodies[1] and sessions.closed == ["s0"]
    assert [b["input_ids"] for b in radix.bodies[1:]] == [
        [*range(40), *range(1000, 1008), 7, 7, 7],
        [*range(40), *range(1000, 1008), 7, 7, 7, 1000, 1001, 1002, 1003, *(9,) * 20]]
    radix_stats, session_stats = runs["radix"][1], runs["sessions"][1]
    assert [(s.prompt_tokens, s.cached_tokens, s.held_tokens) for s in radix_stats] == [
        (40, 0, 0), (51, 32, 47), (75, 48, 54)]
    assert [(s.prompt_tokens, s.cached_tokens, s.held_tokens) for s in session_stats] == [
        (40, 0, 0), (51, 47, 47), (75, 54, 54)]
    assert all(s.ttft_s is not None for s in session_stats)


class FakeChatClient:
    """``openai.AsyncOpenAI``'s chat.completions.create, recording each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.chat = self
        self.completions = self

    async def create(self, **kw: Any) -> Any:
        self.calls.append({**kw, "messages": list(kw["messages"])})
        n = len(self.calls)

        async def stream() -> Any:
            from openai.types.chat import ChatCompletionChunk

            yield ChatCompletionChunk.model_validate({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": {"content": f"reply {n}"},
                             "finish_reason": "length"}]})
            yield ChatCompletionChunk.model_validate({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [], "usage": {"prompt_tokens": 10 * n, "completion_tokens": 4,
                                         "total_tokens": 10 * n + 4,
                                         "prompt_tokens_details": {"cached_tokens": n}}})
        return stream()


class _Bar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


def test_chat_conversation_through_a_session_names_it_every_turn_and_closes_it():
    fake = FakeSessionServer()
    client = FakeChatClient()
    conv = chat_conversations(1, 3)[0]
    results: list[TurnResult] = []

    async def run() -> int:
        async with httpx.AsyncClient(base_url="http://fake",
                                     transport=httpx.MockTransport(fake.handler)) as http:
            return await _conversation(client, http, "m", 0, conv, 16, 0.0, results, _Bar(),
                                       "sessions")

    assert asyncio.run(run()) == 0
    assert [c["extra_body"] for c in client.calls] == [{"session_params": {"id": "s0"}}] * 3
    assert fake.closed == ["s0"]
    # every turn sends the whole conversation, the model's replies included
    assert [[m["role"] for m in c["messages"]] for c in client.calls][-1] == [
        "system", "user", "assistant", "user", "assistant", "user"]
    assert client.calls[2]["messages"][4] == {"role": "assistant", "content": "reply 2"}
    assert [(r.mode, r.prompt_tokens, r.cached_tokens, r.text) for r in results] == [
        ("sessions", 10, 1, "reply 1"), ("sessions", 20, 2, "reply 2"),
        ("sessions", 30, 3, "reply 3")]
    assert [(s.turn, s.held_tokens) for s in turn_stats(results)] == [(0, 0), (1, 13), (2, 23)]
    # radix mode: no session, no extra field
    client = FakeChatClient()
    asyncio.run(_conversation(client, None, "m", 0, conv, 16, 0.0, [], _Bar()))
    assert [c["extra_body"] for c in client.calls] == [None] * 3


def _outcome(mode: str, cached: int) -> RunOutcome:
    results = [TurnResult(c, t, 0.0, 8, "sys", "u", end_s=2.0, ttft_s=0.1 * (t + 1),
                          prompt_tokens=50 * (t + 1), cached_tokens=0 if t == 0 else cached,
                          completion_tokens=8, finish_reason="length", text="r", mode=mode)
               for c in range(2) for t in range(2)]
    check = {"ok": True, "idle": True, "violations": [],
             "pools": {"kv_tokens": {"available": 96, "evictable": 32, "total": 128},
                       "rows": {"free": 4, "size": 4}}}
    return RunOutcome(results, [], None, None, check, 2.0, 0)


def test_both_modes_summary_has_each_run_and_the_comparison():
    runs = {"radix": _outcome("radix", 48), "sessions": _outcome("sessions", 57)}
    opts = ChatJobOptions(conversations=2, turns=2, mode="both")
    facts = {k: None for k in ("kv_pool_tokens", "page_size", "context_len",
                               "max_running_requests", "chunked_prefill_size",
                               "schedule_policy", "radix_cache", "device", "dtype",
                               "torch_version", "torch_threads", "random_weights")}
    facts.update(model="m", model_path="m")
    s = summarize(runs["radix"], opts, "http://x", facts, 0, {"cpu": "c", "cores": 2},
                  "abc", runs)
    assert s["mode"] == "both" and s["ok"] and list(s["runs"]) == ["radix", "sessions"]
    assert s["prefix_cache"]["client"]["cached_tokens"] == 96  # the top level: radix's
    assert (s["runs"]["radix"]["prefill_tokens"], s["runs"]["sessions"]["prefill_tokens"]) == (
        300 - 96, 300 - 114)
    assert s["runs"]["sessions"]["later_turns_whole_context_reused"] == 2
    assert s["runs"]["radix"]["later_turns_whole_context_reused"] == 0
    assert s["runs"]["sessions"]["checker_verdict"] == "clean: 0 violations, pools full"
    assert s["comparison"]["prefill_tokens_later_turns_pct"] == -17.3  # 2 x 43 vs 2 x 52
    lines = summary_lines(s)
    assert "runs              radix then sessions, same server, the cache flushed before each" \
        in lines
    assert "  checker after sessions: clean: 0 violations, pools full" in lines
    # a radix-only report keeps exactly its former lines
    s = summarize(runs["radix"], ChatJobOptions(conversations=2, turns=2), "http://x", facts,
                  0, {"cpu": "c", "cores": 2}, "abc")
    assert s["mode"] == "radix" and list(s["runs"]) == ["radix"] and "comparison" not in s
    assert not any(line.startswith("runs") for line in summary_lines(s))


def test_cli_modes():
    args = build_parser().parse_args(["bench", "chat", "--mode", "both"])
    assert args.mode == "both"
    assert build_parser().parse_args(["bench", "chat"]).mode == "radix"
    args = build_parser().parse_args(["bench", "trace-sessions", "t.jsonl"])
    assert (args.mode, args.block, args.chains, args.turns, args.min_turns, args.max_context,
            args.concurrency, args.vocab_size) == ("both", 16, 16, 4, 3, 2048, 4, None)


def test_server_session_counters_of_a_run():
    from kvserve.bench.sessions import counters_change

    before = {"session_slot_hits": 3, "session_mismatches": 1, "session_rollbacks": 0,
              "session_reclaimed": 2}
    after = {"session_slot_hits": 10, "session_mismatches": 1, "session_rollbacks": 2,
             "session_reclaimed": 7}
    change = counters_change(before, after)
    assert change == {"slot_hits": 7, "mismatches": 0, "rollbacks": 2, "reclaimed": 5}
    assert counters_change(None, after) is None
    radix = {**run_metrics(_turns(96), 4.0), "server_sessions": counters_change(after, after)}
    sessions = {**run_metrics(_turns(109), 4.0), "server_sessions": change}
    lines = comparison_lines({"radix": radix, "sessions": sessions})
    assert lines[-3] == f"{'server: slot hits / mismatches':<34}{'0 / 0':<26}7 / 0"
    assert lines[-2] == f"{'server: rollbacks / reclaimed':<34}{'0 / 0':<26}2 / 5"
