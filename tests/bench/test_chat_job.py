"""The main job, ``kvserve bench chat``, end to end: it starts its own ``kvserve serve`` on
a tiny checkpoint, runs multi-turn chats through the official openai client, asks the
checker, writes the report and stops the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.bench.chat import chat_conversations
from kvserve.cli import main
from kvserve.model.init import init_model
from kvserve.server.process import free_port

PAGE = 16  # kvserve serve's default page size


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("chat-ckpt") / "tiny-llama", "tiny-llama", seed=0)


def test_workload_is_deterministic_and_shares_system_prompts():
    convs = chat_conversations(12, 3, num_system_prompts=4, max_tokens=8, seed=0)
    assert convs == chat_conversations(12, 3, num_system_prompts=4, max_tokens=8, seed=0)
    assert all(len(c.user_turns) == len(c.reply_tokens) == 3 for c in convs)
    assert {n for c in convs for n in c.reply_tokens} <= set(range(4, 9))
    assert len({c.system for c in convs}) <= 4 < len(convs)
    assert min(len(c.system) for c in convs) > 300  # many pages of shared prefix


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
    # ignore_eos: every reply is as long as its turn's max_tokens, drawn in [4, 8]
    assert summary["output_tokens"] == summary["requested_output_tokens"] == sum(
        sum(c.reply_tokens) for c in chat_conversations(6, 2, max_tokens=8))
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
    for conv in range(6):
        first, second = by_key[conv, 0], by_key[conv, 1]
        assert first["completion_tokens"] == first["max_tokens"] in range(4, 9)
        # turn 2 re-sends turn 1's prompt (and reply): all its full pages are cached
        assert second["cached_tokens"] >= (first["prompt_tokens"] - 1) // PAGE * PAGE > 0

    assert (report / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    verdict = "checker verdict   clean: 0 violations, pools full"
    assert verdict in out and verdict in (report / "summary.md").read_text()
    assert "requests          12" in out


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
