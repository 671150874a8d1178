"""Second breaker round: request bookkeeping that must return to zero, metrics that must
equal what clients saw, chat prompts that must extend each other, and the in-process
``Engine`` under concurrent use.

- ``Engine``: a stream abandoned mid-way had its outbox dropped at once, so a request
  reusing its rid right after received the old request's abort as its own answer (and
  itself ran on unread, refusing the next reuse of the rid); fixed like the HTTP side:
  the rid stays taken (an orphan, outputs dropped) until the engine's last output.
- The HTTP side: after hang-ups while queued, aborts, 429s and plain requests, no
  request channel or in-flight reply is left (``/get_server_info`` ``http_channels``,
  ``http_inflight``), every rid is reusable, and ``/metrics`` counts exactly.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvserve import Engine
from kvserve.engine import GenerateOutput
from kvserve.sched.req import RequestRejected
from tests.server.conftest import MODEL_NAME, LiveServer, start_server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
PAGE = 16


# -- the in-process Engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(model_path=model_dir, page_size=4, chunked_prefill_size=8,
                strict_checks=True, max_running_requests=8) as e:
        yield e


def _settled(e: Engine) -> bool:
    s, alloc = e.scheduler, e.scheduler.pools.allocator
    return (s.is_idle and not e.router
            and alloc.available_size() + s.tree_cache.evictable_size() == alloc.size)


def _wait_settled(e: Engine) -> None:
    deadline = time.monotonic() + 20
    while not _settled(e):
        assert time.monotonic() < deadline, (e.router.rids(), e.router.orphans())
        time.sleep(0.01)


def test_engine_rid_reused_after_an_abandoned_stream_never_gets_the_old_abort(
        engine: Engine) -> None:
    answered = refused = 0
    for i in range(12):
        _wait_settled(engine)  # the rid is free once the engine let go of the old request
        stream = engine.generate_stream(prompt="x", rid="again", sampling_params={
            "max_new_tokens": 300, "ignore_eos": True})
        next(stream)
        stream.close()  # the reader walked away: the request is aborted
        time.sleep(0.002 * (i % 6))  # the reuse lands before, during or after the abort
        try:
            out = engine.generate(prompt="hello there", rid="again", sampling_params={
                "max_new_tokens": 3, "ignore_eos": True})
        except RequestRejected as err:  # the old request was still finishing: fine
            assert "duplicate request id" in str(err)
            refused += 1
            continue
        # an answer can only be the new request's own
        assert isinstance(out, GenerateOutput)
        assert (out.finish_reason, out.completion_tokens) == ("length", 3), out
        answered += 1
    _wait_settled(engine)
    print(f"\nreuse after abandoned stream: {answered} answered, {refused} refused")


def test_engine_batch_with_random_aborts_and_abandoned_streams_from_threads(
        engine: Engine) -> None:
    stop = threading.Event()

    def aborter() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            with engine._lock:
                live = engine.router.rids()
            if live:
                engine.abort(rng.choice(live))
            time.sleep(0.005)

    def abandon(i: int) -> None:
        stream = engine.generate_stream(prompt=f"s {i}", sampling_params={
            "max_new_tokens": 40, "ignore_eos": True})
        for k, _ in enumerate(stream):
            if k == i % 4:
                break
        stream.close()

    threads = [threading.Thread(target=aborter)] + \
        [threading.Thread(target=abandon, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    outs = engine.generate(prompt=[f"prompt {i}" for i in range(40)],
                           sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    stop.set()
    for t in threads:
        t.join(30)
    assert isinstance(outs, list) and len(outs) == 40
    for out in outs:
        assert out.finish_reason in ("length", "abort"), out
        assert out.completion_tokens == len(out.output_ids)
        assert out.finish_reason == "abort" or out.completion_tokens == 6
    _wait_settled(engine)


def test_engine_shutdown_from_another_thread_ends_a_running_generate(model_dir: Path) -> None:
    e = Engine(model_path=model_dir, page_size=4, max_running_requests=4)
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(e.generate(prompt=[f"z {i}" for i in range(8)], sampling_params={
                "max_new_tokens": 2000, "ignore_eos": True}))
        except RuntimeError as err:  # a request still in the inbox at the stop
            result.append(err)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not e.scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    e.shutdown()
    t.join(30)
    assert not t.is_alive() and result, "generate hung after shutdown"
    if isinstance(result[0], list):
        assert {o.finish_reason for o in result[0]} <= {"abort", "length"}
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(prompt="x")


# -- the HTTP server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def queued(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One request runs at a time, two may wait: a long one holds the others queued."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--strict-checks",
                       "--max-running-requests", "1", "--max-queued-requests", "2",
                       "--context-length", "8192", "--max-total-tokens", "16384")
    yield srv
    assert srv.stop() == 0, srv.logs()


def _wait_metric(server: LiveServer, name: str, value: float) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while (m := server.metrics())[name] != value:
        assert time.monotonic() < deadline, (name, value, m)
        time.sleep(0.02)
    return m


def _hang_up_after_headers(server: LiveServer, body: dict[str, Any]) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _http_side(server: LiveServer) -> tuple[int, int]:
    info = server.get("/get_server_info").json()
    return info["http_channels"], info["http_inflight"]


def test_counters_equal_what_clients_saw_and_nothing_is_left_on_the_http_side(
        queued: LiveServer) -> None:
    server = queued
    before = server.metrics()
    replies: dict[str, httpx.Response] = {}

    def post(rid: str, body: dict[str, Any]) -> None:
        replies[rid] = server.post("/generate", json={**body, "rid": rid})

    threads = [threading.Thread(target=post, args=("blk", {"input_ids": [1, 2, 3],
                                "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}))]
    threads[0].start()
    _wait_metric(server, "kvserve:num_running_reqs", 1)
    hang_ups = [f"h{i}" for i in range(3)]
    for rid in hang_ups:  # queued streams whose clients hang up: aborted while waiting
        _hang_up_after_headers(server, {"input_ids": [4, 5, 6], "rid": rid, "stream": True,
                                        "sampling_params": {"max_new_tokens": 5}})
        _wait_metric(server, "kvserve:num_queue_reqs", 0)
    for rid in ("q0", "q1"):  # fill the waiting queue
        threads.append(threading.Thread(target=post, args=(rid, {
            "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 5}})))
        threads[-1].start()
    _wait_metric(server, "kvserve:num_queue_reqs", 2)
    refused = [server.post(CMPL, json={"model": MODEL_NAME, "prompt": "x y", "max_tokens": 2})
               for _ in range(3)]
    assert [r.status_code for r in refused] == [429] * 3
    for rid in ("q0", "q1", "blk"):
        assert server.post("/abort_request", json={"rid": rid}).status_code == 200
    for t in threads:
        t.join(60)
    for rid in ("q0", "q1", "blk"):
        meta = replies[rid].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", (rid, meta)
        assert (meta["completion_tokens"] > 0) == (rid == "blk"), (rid, meta)
    usages = [server.post(CMPL, json={"model": MODEL_NAME, "prompt": "shared prefix " * 12
                                      + f"number {i}", "max_tokens": 3}).json()["usage"]
              for i in range(3)]
    after = server.metrics()  # the engine's stats come with each final output: exact now

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert after["kvserve:num_running_reqs"] == after["kvserve:num_queue_reqs"] == 0
    assert delta("kvserve:queue_full_rejections_total") == 3
    assert delta('kvserve:http_errors_total{status="429"}') == 3
    assert delta("kvserve:aborts_total") == 3 + 3  # hang-ups + /abort_request
    assert delta("kvserve:finished_reqs_total") == 6 + 3  # aborts count as finished
    # prompt tokens and cache hits of admitted requests: blk and the three completions
    assert delta("kvserve:prompt_tokens_total") == 3 + sum(u["prompt_tokens"] for u in usages)
    assert delta("kvserve:prefix_cache_hit_tokens_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    # latency: a first token for blk and the completions; an end for every reply read
    # to its end (the hang-ups' readers left first)
    assert delta("kvserve:time_to_first_token_seconds_count") == 1 + 3
    assert delta("kvserve:e2e_request_latency_seconds_count") == 3 + 3
    assert _http_side(server) == (0, 0)
    for rid in [*hang_ups, "q0", "q1", "blk"]:  # every rid is free again
        r = server.post("/generate", json={"input_ids": [1, 2], "rid": rid,
                                           "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, (rid, r.text)
    assert _http_side(server) == (0, 0)
    server.assert_clean()


def _chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0,
            **fields}


def test_chat_roles_parts_and_limits(queued: LiveServer) -> None:
    ok: list[list[dict[str, Any]]] = [
        [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "content": "42", "tool_call_id": "1"}],
        [{"role": "user", "content": [{"type": "text", "text": "a"},
                                      {"type": "text", "text": "b"}]}],
        [{"role": "user", "content": ""}],
    ]
    for messages in ok:
        r = queued.post(CHAT, json=_chat(messages))
        assert r.status_code == 200, (messages, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    long = queued.post(CHAT, json=_chat([{"role": "system", "content": "word " * 9000},
                                         {"role": "user", "content": "x"}]))
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]
    image = queued.post(CHAT, json=_chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]))
    assert image.status_code == 400
    queued.assert_clean()


def test_each_chat_turn_extends_the_previous_prompt_and_hits_the_cache(
        queued: LiveServer, model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def ids(messages: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(str(text), add_special_tokens=False))

    messages = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
    previous: list[int] = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: what about item {turn}?"})
        prompt = ids(messages)
        assert prompt[:len(previous)] == previous  # the template renders history the same
        r = queued.post(CHAT, json=_chat(messages, max_tokens=12, seed=turn, temperature=1.0))
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # at least the previous turn's whole prompt (page aligned) comes from the cache
        assert len(previous) // PAGE * PAGE <= cached <= len(prompt) - 1, (turn, usage)
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})
        previous = prompt
    queued.assert_clean()
