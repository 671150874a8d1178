"""Streaming sessions over HTTP (SGLang's ``/open_session``, ``/close_session`` and
``session_params``): turns on ``/generate`` (streamed and not), ``/v1/completions`` and
``/v1/chat/completions`` reuse the KV their session held, every bad input is a 4xx
JSON error and the engine keeps serving, and a client that hangs up mid-turn rolls the
session back without blocking its next turn. One live server, checker strict."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, start_server
from tests.server.test_disconnect import open_request, read_until_events, wait_metrics

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
PAGE = 16  # the server's default page size


@pytest.fixture(scope="module")
def sserver(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Strict checks every step; a long context so a turn can decode for seconds."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--strict-checks",
                       "--max-total-tokens", "4096", "--context-length", "2048",
                       "--chunked-prefill-size", "64", "--session-timeout", "600")
    yield srv
    assert srv.stop() == 0, srv.logs()


def ids(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def open_session(server: LiveServer, **body: Any) -> str:
    r = server.post("/open_session", json=body)
    assert r.status_code == 200, r.text
    sid = r.json()
    assert isinstance(sid, str) and sid
    return str(sid)


def close_session(server: LiveServer, sid: str) -> None:
    r = server.post("/close_session", json={"session_id": sid})
    assert r.status_code == 200 and r.content == b"", r.text


def generate(server: LiveServer, input_ids: list[int], n: int,
             **extra: Any) -> dict[str, Any]:
    r = server.post("/generate", json={"input_ids": input_ids, "sampling_params": greedy(n),
                                       **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def assert_error(r: Any, status: int, message: str, kind: str = "invalid_request_error"
                 ) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] == kind and error["code"] == status
    return error


def sse_events(body: bytes) -> list[dict[str, Any]]:
    lines = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def server_stats(server: LiveServer) -> dict[str, Any]:
    stats: dict[str, Any] = server.get("/get_server_info").json()["stats"]
    return stats


def test_open_and_close_session(sserver: LiveServer) -> None:
    sid = open_session(sserver)
    assert len(sid) == 32 and int(sid, 16) >= 0
    assert open_session(sserver, session_id="fixed", capacity_of_str_len=100) == "fixed"
    assert_error(sserver.post("/open_session", json={"session_id": "fixed"}), 400,
                 "session 'fixed' is already open")
    for body, message in [({"capacity_of_str_len": 0}, "capacity_of_str_len must be a "
                           "positive integer, got 0"),
                          ({"capacity_of_str_len": "8"}, "capacity_of_str_len"),
                          ({"session_id": 5}, "session_id"), ([], "must be a JSON object")]:
        assert_error(sserver.post("/open_session", json=body), 400, message)
    info = sserver.get("/get_server_info").json()
    assert info["session_timeout"] == 600 and info["stats"]["open_sessions"] == 2
    close_session(sserver, "fixed")
    error = assert_error(sserver.post("/close_session", json={"session_id": "fixed"}), 404,
                         "no open session 'fixed'", "not_found_error")
    assert error["param"] == "session_id"
    assert_error(sserver.post("/close_session", json={}), 400, "session_id")
    close_session(sserver, sid)
    assert server_stats(sserver)["open_sessions"] == 0
    sserver.assert_clean()


def test_generate_turns_reuse_the_held_kv_streamed_and_not(sserver: LiveServer) -> None:
    before = server_stats(sserver)
    sid = open_session(sserver)
    t1 = generate(sserver, ids(20), 4, session_params={"id": sid})
    meta = t1["meta_info"]
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == \
        (20, 0, 4)
    r = sserver.post("/generate", json={
        "input_ids": ids(5, 60), "sampling_params": greedy(3), "stream": True,
        "session_params": {"id": sid, "rid": meta["id"]}})
    assert r.status_code == 200, r.text
    last = sse_events(r.content)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert (last["meta_info"]["prompt_tokens"], last["meta_info"]["cached_tokens"]) == \
        (20 + 4 + 5, 20 + 4 - 1)  # all but turn 1's last token came from the session
    plain = generate(sserver, ids(20) + t1["output_ids"] + ids(5, 60), 3)
    assert last["output_ids"] == plain["output_ids"]
    stats = server_stats(sserver)
    assert stats["session_slot_hits"] == before["session_slot_hits"] + 1
    assert sserver.metrics()["kvserve:num_sessions"] == 1
    close_session(sserver, sid)
    sserver.assert_clean()


def test_completions_turn_continues_a_rid_given_by_the_client(sserver: LiveServer) -> None:
    sid = open_session(sserver)
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    one = sserver.post(CMPL, json={**body, "prompt": ids(10), "rid": "cmpl-turn-1",
                                   "session_params": {"id": sid}})
    assert one.status_code == 200, one.text
    two = sserver.post(CMPL, json={**body, "prompt": ids(2, 90),
                                   "session_params": {"id": sid, "rid": "cmpl-turn-1"}})
    assert two.status_code == 200, two.text
    usage = two.json()["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == \
        (10 + 3 + 2, 10 + 3 - 1)
    close_session(sserver, sid)
    sserver.assert_clean()


def test_chat_turns_send_the_whole_conversation_and_reuse_the_held_kv(
        sserver: LiveServer) -> None:
    sid = open_session(sserver)
    messages = [{"role": "user", "content": "Hi there!"}]
    body = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True,
            "session_params": {"id": sid}}
    one = sserver.post(CHAT, json={**body, "messages": messages, "max_tokens": 1})
    assert one.status_code == 200, one.text
    reply = one.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "Tell me more."}]
    two = sserver.post(CHAT, json={**body, "messages": messages, "max_tokens": 2,
                                   "session_params": {"id": sid, "replace": True}})
    assert two.status_code == 200, two.text
    first, second = one.json()["usage"], two.json()["usage"]
    held = first["prompt_tokens"] + first["completion_tokens"] - 1  # turn 1's prompt
    assert second["prompt_tokens_details"]["cached_tokens"] == held
    assert second["prompt_tokens"] > held
    close_session(sserver, sid)
    sserver.assert_clean()


def test_every_bad_session_input_is_a_4xx_json_error(sserver: LiveServer) -> None:
    sid = open_session(sserver)
    small = open_session(sserver, capacity_of_str_len=4)
    rid = generate(sserver, ids(6), 2, session_params={"id": sid})["meta_info"]["id"]
    bad_generate = [
        ("not an object", "session_params"),
        ({"rid": rid}, "session_params needs the session 'id'"),
        ({"id": sid, "bogus": 1}, "unknown session_params field(s): bogus"),
        ({"id": "nope"}, "no open session 'nope'"),
        ({"id": sid, "rid": "nope"}, f"session '{sid}' has no completed turn 'nope'"),
        ({"id": sid, "rid": rid, "offset": 99}, "offset 99 is outside turn"),
        ({"id": sid, "offset": 2}, "give the rid"),
        ({"id": sid, "replace": 1}, "replace must be true or false"),
        ({"id": small}, "exceeds session"),
    ]
    for params, message in bad_generate:
        r = sserver.post("/generate", json={"input_ids": ids(5), "sampling_params": greedy(2),
                                            "session_params": params})
        assert_error(r, 400, message)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    for params in ({"id": sid, "rid": rid}, {"id": sid, "offset": 1, "rid": rid}):
        error = assert_error(sserver.post(CHAT, json={**chat, "session_params": params}),
                             400, "whole conversation: session_params takes only 'id'")
        assert error["param"] == "session_params"
    assert_error(sserver.post(CHAT, json={**chat, "session_params": {"id": "nope"}}), 400,
                 "no open session 'nope'")
    assert_error(sserver.post(CMPL, json={"model": MODEL_NAME, "prompt": "hi",
                                          "session_params": {"id": sid, "rid": "x"}}),
                 400, "has no completed turn 'x'")
    # nothing changed: the session continues its one completed turn
    turn = generate(sserver, ids(2, 70), 1, session_params={"id": sid, "rid": rid})
    assert turn["meta_info"]["cached_tokens"] == 6 + 2 - 1
    for session in (sid, small):
        close_session(sserver, session)
    sserver.assert_clean()


def test_a_second_turn_while_one_streams_is_refused_until_it_is_aborted(
        sserver: LiveServer) -> None:
    sid = open_session(sserver)
    sock = open_request(sserver, "/generate", {
        "input_ids": ids(8), "sampling_params": greedy(1500), "stream": True,
        "rid": "session-long-turn", "session_params": {"id": sid}})
    try:
        read_until_events(sock, 2)  # decoding
        assert_error(sserver.post("/generate", json={"input_ids": ids(3),
                                                     "session_params": {"id": sid}}),
                     400, f"session '{sid}' has a turn in flight ('session-long-turn')")
        assert sserver.post("/abort_request", json={"rid": "session-long-turn"}).json() == {}
        received = b""
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            assert chunk, received[-200:]
            received += chunk
    finally:
        sock.close()
    last = sse_events(received)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    turn = generate(sserver, ids(3), 1, session_params={"id": sid})
    assert turn["meta_info"]["finish_reason"]["type"] == "length"
    close_session(sserver, sid)
    sserver.assert_clean()


def test_disconnect_mid_turn_rolls_back_and_the_next_turn_proceeds(
        sserver: LiveServer) -> None:
    before = server_stats(sserver)
    sid = open_session(sserver)
    t1 = generate(sserver, ids(20), 4, session_params={"id": sid})
    rid = t1["meta_info"]["id"]
    aborts = sserver.metrics()
    sock = open_request(sserver, "/generate", {
        "input_ids": ids(6, 80), "sampling_params": greedy(1500), "stream": True,
        "session_params": {"id": sid, "rid": rid}})
    read_until_events(sock, 3)  # turn 2 decodes on the KV turn 1 left
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a TCP reset: the watcher aborts the turn
    wait_metrics(sserver, lambda m: m["kvserve:aborts_total"] > aborts["kvserve:aborts_total"])
    t3 = generate(sserver, ids(5, 60), 3, session_params={"id": sid, "rid": rid})
    meta = t3["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 3
    assert meta["prompt_tokens"] == 20 + 4 + 5
    # the held KV went with the aborted turn; turn 3 matches the tree (whole pages)
    assert meta["cached_tokens"] == (20 + 4) // PAGE * PAGE
    plain = generate(sserver, ids(20) + t1["output_ids"] + ids(5, 60), 3)
    assert t3["output_ids"] == plain["output_ids"]
    stats = server_stats(sserver)
    assert stats["session_rollbacks"] == before["session_rollbacks"] + 1
    close_session(sserver, sid)
    sserver.assert_clean()


def test_a_turn_sent_right_after_a_hang_up_is_not_refused(sserver: LiveServer) -> None:
    """A client that resets its streaming turn and sends its next turn at once (before the
    50 ms disconnect watcher runs) is not refused as 'a turn in flight': the session's
    gone turn is aborted first, then the next turn continues the last completed one."""
    sid = open_session(sserver)
    t1 = generate(sserver, ids(20), 4, session_params={"id": sid})
    rid = t1["meta_info"]["id"]
    for attempt in range(4):  # without the check the watcher loses this race most times
        sock = open_request(sserver, "/generate", {
            "input_ids": ids(6, 80), "sampling_params": greedy(1500), "stream": True,
            "session_params": {"id": sid, "rid": rid}})
        read_until_events(sock, 2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        # the next turn on a fresh socket at once (an HTTP client's pool is slower)
        nxt = open_request(sserver, "/generate", {
            "input_ids": ids(5, 60), "sampling_params": greedy(2),
            "session_params": {"id": sid, "rid": rid}})
        try:
            received = b""
            while b"\r\n\r\n{" not in received or not received.endswith(b"}"):
                chunk = nxt.recv(65536)
                assert chunk, received
                received += chunk
        finally:
            nxt.close()
        assert received.startswith(b"HTTP/1.1 200"), (attempt, received[-300:])
        body = json.loads(received.split(b"\r\n\r\n", 1)[1])
        assert body["meta_info"]["prompt_tokens"] == 20 + 4 + 5
    close_session(sserver, sid)
    sserver.assert_clean()
