"""A client that hangs up aborts its request at every stage: decoding while streaming,
waiting for a non-streamed reply, queued behind another request, mid chunked prefill.

Each test opens the request on a raw socket, closes it with a TCP reset, and asserts
that ``kvserve:aborts_total`` moves by exactly one and ``/debug/check`` is clean (idle,
pools full, no violation) long before the request could have finished on its own: every
request asks for thousands of tokens with ``ignore_eos``. Only an abort moves the
counter, so a natural finish cannot pass these tests. The time from the reset to the
counter moving is printed (``-s``); /metrics engine stats refresh at most every 100 ms
while busy, so it includes up to that much staleness.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, start_server

CONTEXT_LEN = 4096
MAX_TOKENS = 4000  # with ignore_eos: seconds of decoding, far beyond the abort time
ABORT_TIMEOUT_S = 5.0  # generous: the watcher polls every 50 ms, the engine aborts in a step
ABORTS = "kvserve:aborts_total"
FINISHED = "kvserve:finished_reqs_total"
FIRST_TOKENS = "kvserve:time_to_first_token_seconds_count"  # +1 when a first token reaches HTTP


@pytest.fixture(scope="module")
def dserver(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One request at a time (so a second one queues), long context, 16-token prefill
    chunks (a 4,000-token prompt takes 250 prefill steps), strict checks every step."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--strict-checks",
                       "--max-running-requests", "1", "--context-length", str(CONTEXT_LEN),
                       "--max-total-tokens", "8192", "--chunked-prefill-size", "16")
    yield srv
    assert srv.stop() == 0, srv.logs()


def wait_metrics(server: LiveServer, ready: Callable[[dict[str, float]], bool],
                 timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = server.metrics()
        if ready(sample):
            return sample
        time.sleep(0.01)
    raise AssertionError(f"metrics condition not met in {timeout_s} s: {server.metrics()}")


def open_request(server: LiveServer, path: str, body: dict) -> socket.socket:
    """Send a POST on a fresh socket and return the socket unread."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until_events(sock: socket.socket, count: int) -> bytes:
    """Read the response until ``count`` SSE data lines have arrived."""
    received = b""
    while received.count(b"\ndata: ") < count:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    return received


def hang_up_and_time_abort(server: LiveServer, sock: socket.socket,
                           before: dict[str, float]) -> float:
    """Reset the connection; returns the seconds until the engine counted one more abort."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    closed_at = time.monotonic()
    sock.close()
    wait_metrics(server, lambda m: m[ABORTS] > before[ABORTS], ABORT_TIMEOUT_S)
    return time.monotonic() - closed_at


def assert_aborted_once_and_clean(server: LiveServer, before: dict[str, float],
                                  aborts: int = 1) -> None:
    server.assert_clean()
    after = server.metrics()  # refreshed when the engine became idle
    assert after[ABORTS] == before[ABORTS] + aborts
    assert after[FINISHED] == before[FINISHED] + aborts  # nothing finished on its own
    assert after["kvserve:checker_violations_total"] == 0


def long_completion(**extra: object) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, **extra}


def test_disconnect_while_streaming_decode_aborts(dserver: LiveServer) -> None:
    before = dserver.metrics()
    sock = open_request(dserver, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True})
    read_until_events(sock, 4)  # the role chunk, then text: decoding
    seconds = hang_up_and_time_abort(dserver, sock, before)
    print(f"\nstreaming decode: abort counted {seconds * 1000:.0f} ms after the reset")
    assert_aborted_once_and_clean(dserver, before)


def test_disconnect_while_waiting_for_non_streamed_reply_aborts(dserver: LiveServer) -> None:
    before = dserver.metrics()
    sock = open_request(dserver, "/v1/completions", long_completion())
    wait_metrics(dserver, lambda m: m[FIRST_TOKENS] > before[FIRST_TOKENS])  # decoding
    seconds = hang_up_and_time_abort(dserver, sock, before)
    print(f"\nnon-streamed: abort counted {seconds * 1000:.0f} ms after the reset")
    assert_aborted_once_and_clean(dserver, before)


def test_disconnect_while_queued_aborts_only_the_queued_request(dserver: LiveServer) -> None:
    before = dserver.metrics()
    running = open_request(dserver, "/v1/completions", long_completion(stream=True))
    read_until_events(running, 2)  # the only running slot is taken
    queued = open_request(dserver, "/generate", {
        "text": "a second request", "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "ignore_eos": True}})
    wait_metrics(dserver, lambda m: m["kvserve:num_queue_reqs"] == 1)
    seconds = hang_up_and_time_abort(dserver, queued, before)
    print(f"\nqueued: abort counted {seconds * 1000:.0f} ms after the reset")
    after = wait_metrics(dserver, lambda m: m["kvserve:num_queue_reqs"] == 0)
    assert after[ABORTS] == before[ABORTS] + 1
    assert after["kvserve:num_running_reqs"] == 1  # the running request goes on
    assert after[FIRST_TOKENS] == before[FIRST_TOKENS] + 1  # the queued one never started
    running.recv(65536)  # still streaming
    hang_up_and_time_abort(dserver, running, after)
    assert_aborted_once_and_clean(dserver, before, aborts=2)


def test_disconnect_during_chunked_prefill_aborts_before_the_first_token(
        dserver: LiveServer) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 512) for _ in range(CONTEXT_LEN - 96)]  # 250 prefill chunks
    before = dserver.metrics()
    sock = open_request(dserver, "/v1/completions", long_completion(prompt=prompt))
    started = wait_metrics(dserver, lambda m: m["kvserve:kv_used_tokens"] > 0)
    assert started["kvserve:kv_used_tokens"] < len(prompt)  # mid prefill
    seconds = hang_up_and_time_abort(dserver, sock, before)
    print(f"\nchunked prefill: abort counted {seconds * 1000:.0f} ms after the reset")
    assert_aborted_once_and_clean(dserver, before)
    # A non-streamed reply observes every token it gets: none came, so the abort landed
    # before the last prefill chunk.
    assert dserver.metrics()[FIRST_TOKENS] == before[FIRST_TOKENS]
