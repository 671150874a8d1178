"""The main job, ``kvserve bench chat``, end to end: it starts its own ``kvserve serve`` on
a tiny random-weight checkpoint (for speed; the job's default is the server's default
model), runs the built-in multi-turn chats through the official openai client, asks the
checker, writes the report and stops the server."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.bench.chat import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONVERSATIONS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_TURNS,
    chat_conversations,
)
from kvserve.bench.chat_data import EXTRA_TURNS, SCRIPTS, SYSTEM_PROMPTS
from kvserve.cli import build_parser, main
from kvserve.model.init import init_model
from kvserve.server.process import free_port

PAGE = 16  # kvserve serve's default page size


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("chat-ckpt") / "tiny-llama", "tiny-llama", seed=0)


def test_workload_is_real_chats_under_shared_system_prompts():
    convs = chat_conversations(24, 6)
    assert convs == chat_conversations(24, 6)
    assert [c.user_turns for c in convs] == [script for _, script in SCRIPTS]
    assert [c.system for c in convs] == [SYSTEM_PROMPTS[i] for i, _ in SCRIPTS]
    assert len(set(convs)) == 24 and len({c.system for c in convs}) == 4
    # conversation k + 24 repeats script k under the next system prompt: 96 differ
    assert len(set(chat_conversations(96, 2))) == 96
    later = chat_conversations(25, 2)[24]
    assert later.user_turns == SCRIPTS[0][1][:2]
    assert later.system_index == (SCRIPTS[0][0] + 1) % 4
    # turns beyond a script's six are generic follow-ups; fewer turns cut the script
    assert chat_conversations(1, 8)[0].user_turns == (*SCRIPTS[0][1], *EXTRA_TURNS[:2])
    assert chat_conversations(1, 1)[0].user_turns == ("Why is the sky blue?",)


def test_cli_defaults_are_the_job_defaults():
    args = build_parser().parse_args(["bench", "chat"])
    assert (args.conversations, args.turns, args.concurrency, args.max_tokens) == (
        DEFAULT_CONVERSATIONS, DEFAULT_TURNS, DEFAULT_CONCURRENCY, DEFAULT_MAX_TOKENS) == (
        24, 4, 12, 64)


def test_chat_job_counts_every_request_and_ends_with_a_clean_checker(tiny_llama, tmp_path,
                                                                      capsys):
    report = tmp_path / "report"
    code = main(["bench", "chat", "--model", str(tiny_llama), "--conversations", "6",
                 "--turns", "2", "--concurrency", "3", "--max-tokens", "8",
                 "--report-dir", str(report), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out + (report / "server.log").read_text()

    summary = json.loads((report / "summary.json").read_text())
    assert (summary["requests"], summary["errors"], summary["skipped_turns"]) == (12, 0, 0)
    assert summary["workload"] == {"conversations": 6, "turns": 2, "concurrency": 3,
                                   "max_tokens": 8, "system_prompts": 4,
                                   "temperature": 0.0, "stream": True}
    assert summary["checker"] == {"available": True, "clean": True, "violations": [],
                                  "verdict": "clean: 0 violations, pools full"}
    assert summary["server"]["started_here"] and summary["server"]["exit_status"] == 0
    assert summary["retractions"] == 0 and summary["ok"]
    server, client = summary["prefix_cache"]["server"], summary["prefix_cache"]["client"]
    assert server["hit_tokens"] > 0
    assert (server["prompt_tokens"], server["hit_tokens"]) == (client["prompt_tokens"],
                                                             client["cached_tokens"])
    assert all(summary["ttft_ms"][p] is not None for p in ("p50", "p90", "p99"))

    rows = [json.loads(line) for line in (report / "requests.jsonl").read_text().splitlines()]
    assert sorted((r["conversation"], r["turn"]) for r in rows) == [
        (c, t) for c in range(6) for t in range(2)]
    by_key = {(r["conversation"], r["turn"]): r for r in rows}
    convs = chat_conversations(6, 2)
    for conv in range(6):
        first, second = by_key[conv, 0], by_key[conv, 1]
        for turn, row in enumerate((first, second)):
            assert (row["system"], row["user"]) == (convs[conv].system,
                                                    convs[conv].user_turns[turn])
            # no ignore_eos: a reply ends at EOS ("stop") or at max_tokens ("length")
            assert row["finish_reason"] in ("stop", "length")
            assert row["completion_tokens"] <= 8 and row["max_tokens"] == 8
            if row["finish_reason"] == "length":
                assert row["completion_tokens"] == 8
        # turn 2 re-sends turn 1's prompt (and reply): all its full pages are cached
        assert second["cached_tokens"] >= (first["prompt_tokens"] - 1) // PAGE * PAGE > 0
    ended = summary["finish_reasons"]
    assert ended == {"stop": sum(r["finish_reason"] == "stop" for r in rows),
                     "length": sum(r["finish_reason"] == "length" for r in rows)}
    assert ended["stop"] + ended["length"] == 12
    assert summary["output_tokens"] == sum(r["completion_tokens"] for r in rows)

    # the report's engine facts are the server's own (/get_server_info, /v1/models)
    with (report / "timeline.csv").open() as f:
        pool = {int(row["kv_total_tokens"]) for row in csv.DictReader(f)}
    srv = summary["server"]
    assert {srv["kv_pool_tokens"]} == pool  # what /metrics said all along
    assert (srv["model"], srv["model_path"], srv["random_weights"]) == (
        "tiny-llama", str(tiny_llama), True)
    assert (srv["page_size"], srv["context_len"], srv["max_running_requests"],
            srv["chunked_prefill_size"], srv["schedule_policy"], srv["radix_cache"],
            srv["device"], srv["dtype"], srv["torch_version"]) == (
        PAGE, 4096, 64, 2048, "fcfs", True, "cpu", "float32", torch.__version__)
    assert isinstance(srv["torch_threads"], int) and srv["torch_threads"] >= 1
    assert summary["machine"]["cores"] == len(os.sched_getaffinity(0))
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent)
    assert summary["commit"].removesuffix("+dirty") == (
        head.stdout.strip() if head.returncode == 0 else "unknown")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S*", summary["date"])

    # sample replies: the last turn of the first 3 conversations, printed and in the report
    samples = summary["sample_replies"]
    assert [(s["conversation"], s["turn"], s["user"]) for s in samples] == [
        (c, 1, convs[c].user_turns[1]) for c in range(3)]
    assert "sample replies (last turn of 3 conversations" in out
    for c in range(3):
        assert f"[conversation {c}, turn 2] user: {convs[c].user_turns[1]}" in out

    assert (report / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (report / "summary.md").read_text()
    for line in ("checker verdict   clean: 0 violations, pools full", "requests          12",
                 f"replies ended     stop {ended['stop']}, length {ended['length']}",
                 f"engine            KV pool {srv['kv_pool_tokens']} tokens, page 16, "
                 "context 4096, max running 64, chunked prefill 2048, policy fcfs, "
                 "radix cache on, cpu float32",
                 "RANDOM weights: the text is noise"):
        assert line in out and line in md


def test_unreachable_url_is_a_clear_error_without_traceback(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "bench", "chat", "--url", url,
         "--report-dir", str(tmp_path / "report"), "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"kvserve: cannot reach {url}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_server_that_cannot_start_shows_its_log_tail(tmp_path, capsys):
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    code = main(["bench", "chat", "--model", str(empty), "--report-dir",
                 str(tmp_path / "report"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "kvserve: the server exited with status" in err
    assert str(empty) in err  # the server's own message, from the log's tail
