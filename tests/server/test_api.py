"""The HTTP API's behaviour on a live server: API key, request ids, 429 under a full
queue, /flush_cache, SGLang's /generate, /abort_request, stop strings, stream
encoding, info endpoints and logprobs. Outputs of greedy and seeded requests are
compared exactly across modes (streaming vs not, /generate vs OpenAI)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, LiveServer, start_server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
KEY = "sekret"
# 20 prompt tokens + 490 = the whole context: long enough that an abort, a flush or a
# second request sent right after the first event finds the request still running
LONG = {"max_tokens": 490, "ignore_eos": True, "temperature": 0}


def _cmpl(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, **fields}


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **fields}


def _data_lines(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body; the body must be valid UTF-8."""
    text = raw.decode("utf-8")  # strict: a split multi-byte sequence fails here
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: "):] for line in lines]


def _sse_json(raw: bytes) -> list[dict[str, Any]]:
    """Every event but the final ``[DONE]``, each parsed with json.loads."""
    payloads = _data_lines(raw)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def _stream(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = server.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return _sse_json(r.content)


@contextmanager
def _open_stream(server: LiveServer, path: str, body: dict[str, Any]
                 ) -> Iterator[Iterator[dict[str, Any]]]:
    """A streaming request kept open: yields an iterator of its parsed events (after
    the first one has arrived, so the request is running in the engine)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line)

        def events() -> Iterator[dict[str, Any]]:
            for line in lines:
                assert line.startswith("data: ")
                if line == "data: [DONE]":
                    return
                yield json.loads(line[len("data: "):])

        it = events()
        first = next(it)
        yield _chain(first, it)


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def _error(r: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == kind and error["code"] == status
    return error


def _metrics(server: LiveServer) -> dict[str, Any]:
    """family name -> family; counters are named without ``_total``."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _sample(family: Any, suffix: str = "") -> float:
    return next(s.value for s in family.samples if s.name == family.name + suffix)


# -- a server with an API key and a tiny queue (one start for both) ----------------------
@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--strict-checks",
                       "--max-total-tokens", "1024", "--context-length", "512",
                       "--max-running-requests", "2", "--max-queued-requests", "2",
                       api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.logs()


def test_api_key_required_except_on_health_and_metrics(guarded: LiveServer) -> None:
    body = _cmpl("hello", max_tokens=2)
    url = guarded.url + CMPL
    _error(httpx.post(url, json=body, timeout=30), 401, "authentication_error")
    for wrong in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, "Bearer", f"bearer {KEY}"):
        r = httpx.post(url, json=body, headers={"Authorization": wrong}, timeout=30)
        _error(r, 401, "authentication_error")
    _error(httpx.get(guarded.url + "/v1/models", timeout=30), 401, "authentication_error")
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200
    assert httpx.get(guarded.url + "/metrics", timeout=30).status_code == 200
    guarded.assert_clean()


def test_full_queue_answers_429_with_retry_after(guarded: LiveServer) -> None:
    """2 running + 2 queued at most: 16 concurrent long requests -> the rest get 429
    (never a 5xx); every accepted one completes; the counter matches what was seen."""
    before = _sample(_metrics(guarded)["kvserve:queue_full_rejections"], "_total")

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=guarded.headers,
                                     timeout=120) as client:
            bodies = [_cmpl([10 + i] * 20, max_tokens=400, ignore_eos=True) for i in range(16)]
            return await asyncio.gather(*(client.post(CMPL, json=b) for b in bodies))

    replies = asyncio.run(flood())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 429}, codes
    refused = [r for r in replies if r.status_code == 429]
    served = [r for r in replies if r.status_code == 200]
    assert len(refused) >= 1 and len(served) >= 2, codes
    for r in refused:
        assert r.headers["retry-after"] == "1"
        _error(r, 429, "rate_limit_error")
    for r in served:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 400
        assert body["usage"]["prompt_tokens"] == 20
        assert body["choices"][0]["finish_reason"] == "length"
    guarded.assert_clean()
    deadline = time.monotonic() + 10  # stats snapshots trail the engine by <= 100 ms
    while True:
        after = _sample(_metrics(guarded)["kvserve:queue_full_rejections"], "_total")
        if after - before == len(refused) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after - before == len(refused)


# -- the module's default server ----------------------------------------------------------
def test_duplicate_rid_is_refused_while_the_first_runs(server: LiveServer) -> None:
    body = _cmpl([3] * 20, rid="dup-1", **LONG)
    with _open_stream(server, CMPL, body) as events:
        second = server.post(CMPL, json={**body, "max_tokens": 2})
        error = _error(second, 400, "invalid_request_error")
        assert "dup-1" in error["message"] and error["param"] == "rid"
        last = list(events)[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    server.assert_clean()
    again = server.post(CMPL, json={**body, "max_tokens": 2})  # the id is free again
    assert again.status_code == 200 and again.json()["id"] == "cmpl-dup-1"
    server.assert_clean()


def test_abort_request_ends_a_running_stream(server: LiveServer) -> None:
    body = _cmpl([4] * 20, rid="abort-1", **LONG)
    with _open_stream(server, CMPL, body) as events:
        r = server.post("/abort_request", json={"rid": "abort-1"})
        assert r.status_code == 200
        rest = list(events)
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in rest[:-1])
    streamed = sum(1 for e in rest if e["choices"][0]["text"])
    assert streamed < LONG["max_tokens"]  # stopped early, not run to the end
    server.assert_clean()
    # aborting an unknown or finished id is a no-op
    assert server.post("/abort_request", json={"rid": "abort-1"}).status_code == 200


def test_flush_cache_only_when_idle_and_drops_cached_prefixes(server: LiveServer) -> None:
    assert server.post("/flush_cache").status_code == 200
    prompt = list(range(100, 140))  # 40 tokens: 2 full pages can be cached
    first = server.post(CMPL, json=_cmpl(prompt, max_tokens=1, temperature=0))
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = server.post(CMPL, json=_cmpl(prompt, max_tokens=1, temperature=0))
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    with _open_stream(server, CMPL, _cmpl([5] * 20, **LONG)):
        busy = server.post("/flush_cache")
        error = _error(busy, 400, "invalid_request_error")
        assert "in flight" in error["message"]
    # leaving the stream early disconnects it: the watcher aborts it in the engine
    server.assert_clean()
    flushed = server.get("/flush_cache")
    assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
    assert server.assert_clean()["pools"]["kv_tokens"]["evictable"] == 0
    assert server.metrics()["kvserve:kv_cached_tokens"] == 0  # stats sent after the flush
    third = server.post(CMPL, json=_cmpl(prompt, max_tokens=1, temperature=0))
    assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert third.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_generate_native_shape_and_cumulative_stream(server: LiveServer) -> None:
    body = {"text": "The cache", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True}}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    done = r.json()
    assert set(done) == {"text", "output_ids", "meta_info"}
    meta = done["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == 12 == len(done["output_ids"])
    assert isinstance(meta["id"], str) and meta["id"]
    assert isinstance(meta["cached_tokens"], int)
    events = _stream(server, "/generate", body)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == done["text"]
    assert events[-1]["output_ids"] == done["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    # the same greedy request through the OpenAI endpoint gives the same text
    same = server.post(CMPL, json=_cmpl("The cache", max_tokens=12, temperature=0,
                                        ignore_eos=True))
    assert same.json()["choices"][0]["text"] == done["text"]
    assert same.json()["usage"]["prompt_tokens"] == meta["prompt_tokens"] > 0
    server.assert_clean()


def _stop_candidate(text: str) -> str:
    """A 3-letter ASCII substring first found after position 0."""
    for i in range(1, len(text) - 3):
        piece = text[i:i + 3]
        if piece.isascii() and piece.isalpha() and text.find(piece) == i:
            return piece
    raise AssertionError(f"no ASCII stop candidate in {text!r}")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_stop_string_cuts_exactly_before_its_first_occurrence(server: LiveServer,
                                                              path: str) -> None:
    base = (_cmpl("Once upon a time", max_tokens=40, temperature=0, ignore_eos=True)
            if path == CMPL else _chat("Tell me a story", max_tokens=40, temperature=0,
                                       ignore_eos=True))

    def text_of(choice: dict[str, Any]) -> str:
        return choice["text"] if path == CMPL else choice["message"]["content"]

    full = text_of(server.post(path, json=base).json()["choices"][0])
    stop = _stop_candidate(full)
    expected = full[:full.index(stop)]
    cut = server.post(path, json={**base, "stop": [stop]}).json()
    assert text_of(cut["choices"][0]) == expected
    assert cut["choices"][0]["finish_reason"] == "stop"
    events = _stream(server, path, {**base, "stop": [stop]})
    pieces = [(e["choices"][0]["text"] if path == CMPL else
               e["choices"][0]["delta"].get("content", "")) for e in events if e["choices"]]
    assert "".join(pieces) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    server.assert_clean()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streams_are_utf8_json_and_match_seeded_non_stream(server: LiveServer,
                                                           seed: int) -> None:
    """A random byte-level BPE model emits partial UTF-8 sequences often: every event
    must still be valid UTF-8 JSON, and the deltas add up to the non-streamed text."""
    body = _cmpl("¿Qué tal? 日本語 ", max_tokens=48, temperature=1.0, seed=seed,
                 ignore_eos=True)
    whole = server.post(CMPL, json=body).json()["choices"][0]["text"]
    events = _stream(server, CMPL, body)
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    chat = _chat("¿Qué tal? 日本語", max_tokens=48, temperature=1.0, seed=seed,
                 ignore_eos=True)
    whole_chat = server.post(CHAT, json=chat).json()["choices"][0]["message"]["content"]
    chat_events = _stream(server, CHAT, chat)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat_events) \
        == whole_chat
    server.assert_clean()


def test_info_endpoints(server: LiveServer) -> None:
    assert server.post(CMPL, json=_cmpl("hello", max_tokens=1)).status_code == 200
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == 512
    assert server.get("/health").json() == {}
    load = server.get("/get_load").json()
    assert isinstance(load, list) and load and isinstance(load[0]["num_tokens"], int)
    families = _metrics(server)
    kinds = {
        "kvserve:num_running_reqs": "gauge", "kvserve:num_queue_reqs": "gauge",
        "kvserve:kv_used_tokens": "gauge", "kvserve:kv_cached_tokens": "gauge",
        "kvserve:kv_total_tokens": "gauge", "kvserve:prompt_tokens": "counter",
        "kvserve:prefix_cache_hit_tokens": "counter", "kvserve:retractions": "counter",
        "kvserve:aborts": "counter", "kvserve:finished_reqs": "counter",
        "kvserve:queue_full_rejections": "counter", "kvserve:checker_runs": "counter",
        "kvserve:checker_violations": "counter",
        "kvserve:time_to_first_token_seconds": "histogram",
        "kvserve:inter_token_latency_seconds": "histogram",
        "kvserve:e2e_request_latency_seconds": "histogram",
    }
    for name, kind in kinds.items():
        assert name in families and families[name].type == kind, name
    assert _sample(families["kvserve:kv_total_tokens"]) == 4096
    assert _sample(families["kvserve:checker_violations"], "_total") == 0
    assert _sample(families["kvserve:finished_reqs"], "_total") > 0
    assert _sample(families["kvserve:e2e_request_latency_seconds"], "_count") > 0


def test_logprobs_per_completion_token(server: LiveServer) -> None:
    r = server.post(CMPL, json=_cmpl("hello", max_tokens=7, logprobs=1, temperature=0,
                                     ignore_eos=True)).json()
    logprobs = r["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == r["usage"]["completion_tokens"] == 7
    assert len(logprobs["tokens"]) == 7
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    chat = server.post(CHAT, json=_chat("hello", max_tokens=5, logprobs=True,
                                        temperature=0, ignore_eos=True)).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 5
    assert all(item["logprob"] <= 0 for item in content)
    server.assert_clean()
