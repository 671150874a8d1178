"""Regressions found by trying to break the server: each test replays one scenario that
once gave a wrong answer.

- a stop string longer than the engine's 16-token tail decode never matched: the
  output ran on past it (text after the stop leaked) until max_tokens;
- streamed completions with logprobs repeated the whole list in every event, so the
  events did not add up to the non-streamed logprobs;
- a client hanging up in the middle of its body was counted as an HTTP 500;
- a request reusing the rid of a stream the client had just hung up on received that
  old request's abort as its own answer (and itself ran on in the engine unread).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, start_server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _raw_post(server: LiveServer, path: str, body: bytes, declared_len: int) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared_len}\r\n\r\n".encode() + body)
    return sock


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_stop_string_longer_than_the_16_token_tail_ends_the_output(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0}
    reference = server.post(CMPL, json=body).json()["choices"][0]["text"]
    start, length = 10, 100  # about 40 tokens of this tokenizer: far beyond 16
    stop = reference[start:start + length]
    assert len(stop) == length and reference.find(stop) == start
    plain = server.post(CMPL, json={**body, "stop": [stop]}).json()
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["text"] == reference[:start]
    assert plain["usage"]["completion_tokens"] < 120
    events = _events(server.post(CMPL, json={**body, "stop": [stop], "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == reference[:start]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # the whole output as the stop string: nothing is shown
    whole = server.post(CMPL, json={**body, "stop": [reference]}).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == ("", "stop")
    server.assert_clean()


@pytest.mark.parametrize("stop", [None, ["\u2603"]])  # a stop disables decode's fast path
def test_streamed_logprobs_add_up_to_the_non_streamed_ones(server: LiveServer,
                                                           stop: list[str] | None) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stop": stop}
    whole = server.post(CMPL, json=body).json()["choices"][0]["logprobs"]
    assert len(whole["token_logprobs"]) == 12
    events = _events(server.post(CMPL, json={**body, "stream": True}))
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    streamed = [lp for p in parts for lp in p["token_logprobs"]]
    assert streamed == pytest.approx(whole["token_logprobs"], abs=1e-4)

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "stop": stop}
    content = server.post(CHAT, json=chat).json()["choices"][0]["logprobs"]["content"]
    events = _events(server.post(CHAT, json={**chat, "stream": True}))
    streamed_content = [item for e in events for c in e["choices"]
                        if c.get("logprobs") for item in c["logprobs"]["content"]]
    assert [i["token"] for i in streamed_content] == [i["token"] for i in content]
    assert len(content) == 12
    server.assert_clean()


def test_client_hanging_up_mid_body_is_counted_as_499_not_500(server: LiveServer) -> None:
    before = server.metrics()
    sock = _raw_post(server, "/generate", b'{"text": "hel', declared_len=100)
    time.sleep(0.2)  # the server is reading the body
    _reset(sock)
    key = 'kvserve:http_errors_total{status="499"}'
    deadline = time.monotonic() + 10
    while server.metrics().get(key, 0) <= before.get(key, 0):
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.05)
    after = server.metrics()
    assert after.get('kvserve:http_errors_total{status="500"}', 0) == \
        before.get('kvserve:http_errors_total{status="500"}', 0)
    assert server.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200


@pytest.fixture(scope="module")
def one_at_a_time(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[LiveServer]:
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--max-running-requests",
                       "1", "--context-length", "4096", "--max-total-tokens", "8192")
    yield srv
    assert srv.stop() == 0, srv.logs()


def test_rid_reused_right_after_a_stream_hang_up_never_gets_the_old_abort(
        one_at_a_time: LiveServer) -> None:
    server = one_at_a_time
    blocker = threading.Thread(target=server.post, args=("/generate",), kwargs={"json": {
        "input_ids": [1, 2, 3], "rid": "blocker",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}})
    blocker.start()
    deadline = time.monotonic() + 30
    while server.metrics()["kvserve:num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rids = [f"reused-{i}" for i in range(15)]
    outcomes = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for rid in rids:
            # a stream queued behind the blocker; its client hangs up after the headers
            old = {"input_ids": [4, 5, 6], "rid": rid, "stream": True,
                   "sampling_params": {"max_new_tokens": 5}}
            sock = _raw_post(server, "/generate", json.dumps(old).encode(),
                             len(json.dumps(old).encode()))
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            _reset(sock)
            new = {"input_ids": [7, 8, 9], "rid": rid, "sampling_params": {"max_new_tokens": 5}}
            try:
                r = client.post("/generate", json=new, timeout=1.0)
            except httpx.ReadTimeout:  # accepted and queued behind the blocker: fine
                client.post("/abort_request", json={"rid": rid})
                outcomes.append("queued")
                continue
            if r.status_code == 400:
                assert "duplicate request id" in r.json()["error"]["message"]
                outcomes.append("duplicate")
                continue
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]  # an answer now can only be the old request's
            pytest.fail(f"{rid}: answered while queued behind the blocker: {meta}")
        client.post("/abort_request", json={"rid": "blocker"})
    blocker.join(30)
    server.assert_clean()
    # every rid is free again once the engine let go of the old requests
    for rid in rids:
        r = server.post("/generate", json={"input_ids": [7, 8, 9], "rid": rid,
                                           "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, (rid, r.text)
    print(f"\nrid reuse after hang-up: {outcomes}")
