"""Bad input against one live server: each case gets its exact status code and OpenAI's
error body, and after the whole table the server is idle, clean and still serving.

The module's ``server`` has context 512 (a prompt may have at most 511 tokens) and a
tiny model with a 512-token vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
GEN = "/generate"
M = {"model": MODEL_NAME}
USER = [{"role": "user", "content": "hello"}]
CONTEXT = 512
VOCAB = 512


@dataclass
class Case:
    name: str
    path: str
    body: Any  # a JSON-able object, raw bytes, or a callable giving a chunked byte stream
    status: int
    says: str = ""  # a substring of the error message
    param: str | None = None  # the error's param, when it names one
    check: Callable[[dict[str, Any]], None] | None = None  # for accepted (200) cases


def _cmpl(**fields: Any) -> dict[str, Any]:
    return {**M, "prompt": "hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {**M, "messages": USER, "max_tokens": 2, **fields}


def _over_limit_chunks() -> Iterator[bytes]:
    """5 MB without a Content-Length (chunked): the limit is enforced while reading."""
    yield b'{"model": "tiny", "prompt": "'
    for _ in range(5):
        yield b"a" * (1024 * 1024)
    yield b'"}'


def _exactly_at_limit(body: dict[str, Any]) -> None:
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == CONTEXT - 1
    assert body["usage"]["completion_tokens"] == 1
    assert choice["finish_reason"] == "length"


def _capped_by_context(body: dict[str, Any]) -> None:
    assert body["usage"]["prompt_tokens"] == 500
    assert body["usage"]["completion_tokens"] == CONTEXT - 500
    assert body["choices"][0]["finish_reason"] == "length"


def _prefill_only(body: dict[str, Any]) -> None:
    assert body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["text"] == ""
    assert body["choices"][0]["finish_reason"] == "length"


def _two_tokens(body: dict[str, Any]) -> None:
    assert body["usage"]["completion_tokens"] == 2


def _generate_prefill_only(body: dict[str, Any]) -> None:
    assert body["text"] == "" and body["output_ids"] == []
    assert body["meta_info"]["completion_tokens"] == 0


CASES = [
    # -- the body itself ---------------------------------------------------------------
    Case("invalid-json", CMPL, b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    Case("json-array", CMPL, b"[1, 2]", 400, "must be a JSON object"),
    Case("json-string", CHAT, b'"hello"', 400, "must be a JSON object"),
    Case("empty-body", CMPL, b"", 400, "not valid JSON"),
    Case("invalid-utf8", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    Case("lone-surrogate-escape", CMPL, b'{"model": "tiny", "prompt": "\\ud800x"}', 400,
         "not valid JSON"),
    Case("lone-surrogate-chat", CHAT,
         b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         "not valid JSON"),
    Case("nan-constant", CMPL, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400,
         "NaN"),
    Case("infinity-constant", CMPL,
         b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', 400, "Infinity"),
    Case("deeply-nested", CMPL, b'{"model": "tiny", "prompt": ' + b"[" * 100_000, 400,
         "not valid JSON"),
    Case("5000-digit-int", CMPL, b'{"model": "tiny", "prompt": "hi", "max_tokens": 1'
         + b"0" * 5000 + b"}", 400, "not valid JSON"),
    Case("10MB-body", CMPL, b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}',
         413, "exceeds"),
    Case("5MB-chunked-body", CMPL, _over_limit_chunks, 413, "exceeds"),
    # -- missing and mistyped fields ---------------------------------------------------
    Case("missing-model", CMPL, {"prompt": "hi"}, 400, "model", "model"),
    Case("missing-prompt", CMPL, M, 400, "prompt", "prompt"),
    Case("missing-messages", CHAT, M, 400, "messages", "messages"),
    Case("prompt-int", CMPL, _cmpl(prompt=123), 400, "prompt"),
    Case("prompt-floats", CMPL, _cmpl(prompt=[1.5]), 400, "prompt"),
    Case("max-tokens-string", CMPL, _cmpl(max_tokens="many"), 400, "max_tokens", "max_tokens"),
    Case("max-tokens-bool", CMPL, _cmpl(max_tokens=True), 400, "max_tokens", "max_tokens"),
    Case("max-tokens-fraction", CMPL, _cmpl(max_tokens=1.5), 400, "max_tokens", "max_tokens"),
    Case("temperature-string", CMPL, _cmpl(temperature="hot"), 400, "temperature",
         "temperature"),
    Case("temperature-string-chat", CHAT, _chat(temperature="hot"), 400, "temperature",
         "temperature"),
    Case("stream-string", CMPL, _cmpl(stream="yes"), 400, "stream", "stream"),
    Case("stream-string-chat", CHAT, _chat(stream="yes"), 400, "stream", "stream"),
    Case("messages-string", CHAT, _chat(messages="hi"), 400, "messages", "messages"),
    Case("message-without-role", CHAT, _chat(messages=[{"content": "hi"}]), 400, "role",
         "messages.0.role"),
    Case("message-unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]),
         400, "role", "messages.0.role"),
    Case("message-image-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "content"),
    Case("stream-options-int", CHAT, _chat(stream_options=5), 400, "stream_options",
         "stream_options"),
    Case("abort-without-rid", "/abort_request", {}, 400, "rid", "rid"),
    Case("abort-int-rid", "/abort_request", {"rid": 5}, 400, "rid", "rid"),
    # -- empty and oversized prompts ---------------------------------------------------
    Case("empty-prompt", CMPL, _cmpl(prompt=""), 400, "must not be empty", "prompt"),
    Case("empty-prompt-list", CMPL, _cmpl(prompt=[]), 400, "must not be empty", "prompt"),
    Case("empty-prompt-in-list", CMPL, _cmpl(prompt=[""]), 400, "must not be empty", "prompt"),
    Case("empty-id-list-in-list", CMPL, _cmpl(prompt=[[]]), 400, "must not be empty",
         "prompt"),
    Case("batched-prompts", CMPL, _cmpl(prompt=["a", "b"]), 400, "not supported", "prompt"),
    Case("empty-messages", CHAT, _chat(messages=[]), 400, "must not be empty", "messages"),
    Case("prompt-over-context", CMPL, _cmpl(prompt=[5] * 600), 400, "longer than the context"),
    Case("chat-over-context", CHAT, _chat(messages=[{"role": "user", "content": "x " * 600}]),
         400, "longer than the context"),
    Case("prompt-at-limit", CMPL, _cmpl(prompt=[5] * (CONTEXT - 1), max_tokens=16,
                                        temperature=0, ignore_eos=True), 200,
         check=_exactly_at_limit),
    Case("output-capped-by-context", CMPL, _cmpl(prompt=[7] * 500, max_tokens=100,
                                                 temperature=0, ignore_eos=True), 200,
         check=_capped_by_context),
    Case("token-id-at-vocab", CMPL, _cmpl(prompt=[1, 2, VOCAB]), 400, "vocabulary"),
    Case("token-id-huge", CMPL, _cmpl(prompt=[2**40]), 400, "token ids"),
    Case("token-id-negative", CMPL, _cmpl(prompt=[1, -1]), 400, "token ids"),
    # -- sampling limits ---------------------------------------------------------------
    Case("max-tokens-0", CMPL, _cmpl(max_tokens=0), 200, check=_prefill_only),
    Case("max-tokens-negative", CMPL, _cmpl(max_tokens=-1), 400, "max_tokens", "max_tokens"),
    Case("max-tokens-beyond-context", CMPL, _cmpl(max_tokens=100_000), 400, "max_tokens",
         "max_tokens"),
    Case("max-completion-tokens-beyond-context", CHAT, _chat(max_completion_tokens=600), 400,
         "max_tokens", "max_tokens"),
    Case("chat-max-tokens-negative", CHAT, _chat(max_tokens=-1), 400, "max_tokens",
         "max_tokens"),
    Case("temperature-negative", CMPL, _cmpl(temperature=-0.5), 400, "temperature"),
    Case("temperature-beyond-float", CMPL, _cmpl(temperature=10**400), 400, "temperature",
         "temperature"),
    Case("top-p-0", CMPL, _cmpl(top_p=0), 400, "top_p"),
    Case("top-p-1.5", CMPL, _cmpl(top_p=1.5), 400, "top_p"),
    Case("top-k-minus-2", CMPL, _cmpl(top_k=-2), 400, "top_k"),
    Case("top-k-beyond-int32", CMPL, _cmpl(top_k=2**63), 400, "top_k"),
    Case("min-p-2", CMPL, _cmpl(min_p=2), 400, "min_p"),
    Case("seed-negative", CMPL, _cmpl(seed=-1), 400, "seed"),
    Case("seed-beyond-int64", CMPL, _cmpl(seed=2**64), 400, "seed"),
    Case("n-2", CMPL, _cmpl(n=2), 400, "n=2 is not supported", "n"),
    Case("n-2-chat", CHAT, _chat(n=2), 400, "n=2 is not supported", "n"),
    Case("presence-penalty", CMPL, _cmpl(presence_penalty=0.5), 400, "not supported",
         "presence_penalty"),
    Case("echo", CMPL, _cmpl(echo=True), 400, "echo", "echo"),
    Case("stop-100-strings", CMPL, _cmpl(stop=[f"s{i}" for i in range(100)]), 400,
         "stop strings", "stop"),
    Case("stop-600-chars", CMPL, _cmpl(stop="x" * 600), 400, "stop strings", "stop"),
    Case("stop-token-id-negative", CMPL, _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    Case("logprobs-6", CMPL, _cmpl(logprobs=6), 400, "logprobs", "logprobs"),
    Case("logprobs-minus-1", CMPL, _cmpl(logprobs=-1), 400, "logprobs", "logprobs"),
    Case("top-logprobs-21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
         "top_logprobs"),
    Case("unknown-model", CMPL, _cmpl(model="gpt-17"), 404, "not found", "model"),
    Case("unknown-model-chat", CHAT, _chat(model="gpt-17"), 404, "not found", "model"),
    Case("unknown-fields-ignored", CMPL, _cmpl(frobnicate={"x": 1}, user="u1"), 200,
         check=_two_tokens),
    # -- /generate (SGLang native) -----------------------------------------------------
    Case("generate-neither", GEN, {"sampling_params": {}}, 400, "exactly one", "text"),
    Case("generate-both", GEN, {"text": "hi", "input_ids": [1, 2]}, 400, "exactly one", "text"),
    Case("generate-empty-text", GEN, {"text": ""}, 400, "must not be empty"),
    Case("generate-empty-ids", GEN, {"input_ids": []}, 400, "must not be empty", "input_ids"),
    Case("generate-id-at-vocab", GEN, {"input_ids": [VOCAB]}, 400, "vocabulary"),
    Case("generate-over-context", GEN, {"input_ids": [5] * 600}, 400, "longer than the context"),
    Case("generate-unknown-param", GEN, {"text": "hi", "sampling_params": {"bogus": 1}}, 400,
         "unknown sampling parameters", "sampling_params"),
    Case("generate-max-new-tokens-negative", GEN,
         {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, 400, "max_new_tokens",
         "sampling_params"),
    Case("generate-max-new-tokens-beyond-context", GEN,
         {"text": "hi", "sampling_params": {"max_new_tokens": 600}}, 400, "max_new_tokens"),
    Case("generate-temperature-null", GEN,
         {"text": "hi", "sampling_params": {"temperature": None}}, 400, "temperature"),
    Case("generate-return-logprob-string", GEN,
         {"text": "hi", "sampling_params": {"return_logprob": "yes", "max_new_tokens": 2}},
         400, "return_logprob"),
    Case("generate-ignore-eos-string", GEN,
         {"text": "hi", "sampling_params": {"ignore_eos": "yes", "max_new_tokens": 2}},
         400, "ignore_eos"),
    Case("generate-top-k-beyond-int32", GEN,
         {"text": "hi", "sampling_params": {"top_k": 2**40}}, 400, "top_k"),
    Case("generate-sampling-params-list", GEN, {"text": "hi", "sampling_params": [1]}, 400,
         "sampling_params", "sampling_params"),
    Case("generate-21-stops", GEN, {"text": "hi", "sampling_params": {"stop": ["x"] * 21}},
         400, "stop strings", "stop"),
    Case("generate-stop-600-chars", GEN,
         {"text": "hi", "sampling_params": {"stop": "x" * 600}}, 400, "stop strings", "stop"),
    Case("generate-stop-dict", GEN,
         {"text": "hi", "sampling_params": {"stop": {"a": 1}}}, 400, "stop must be a string"),
    Case("generate-max-new-tokens-true", GEN,
         {"text": "hi", "sampling_params": {"max_new_tokens": True}}, 400, "max_new_tokens"),
    Case("generate-stop-token-ids-bool", GEN,
         {"text": "hi", "sampling_params": {"stop_token_ids": [True]}}, 400, "stop_token_ids"),
    Case("generate-max-new-tokens-0", GEN,
         {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 200,
         check=_generate_prefill_only),
]


def _send(server: LiveServer, case: Case) -> httpx.Response:
    if isinstance(case.body, bytes) or callable(case.body):
        content = case.body() if callable(case.body) else case.body
        return httpx.post(server.url + case.path, content=content, timeout=60,
                          headers={**server.headers, "Content-Type": "application/json"})
    return server.post(case.path, json=case.body)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """``{"error": {"message": <non-empty str>, "type": str, "param": str|None, "code"}}``"""
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, error
    return error


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(server: LiveServer, case: Case) -> None:
    r = _send(server, case)
    if case.status == 200:
        assert r.status_code == 200, r.text[:500]
        assert case.check is not None
        case.check(r.json())
        return
    error = assert_openai_error(r, case.status)
    assert case.says.lower() in error["message"].lower(), error
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.status == 404:
        assert error["type"] == "not_found_error"
    else:
        assert error["type"] == "invalid_request_error"


def test_unknown_path_and_wrong_method_use_the_openai_error_shape(server: LiveServer) -> None:
    error = assert_openai_error(server.post("/v1/nope", json={}), 404)
    assert error["type"] == "not_found_error"
    error = assert_openai_error(server.get(CMPL), 405)
    assert error["type"] == "invalid_request_error"


def test_server_clean_and_serving_after_the_table(server: LiveServer) -> None:
    """Runs after the table (file order): nothing leaked, the engine still serves."""
    server.assert_clean()
    r = server.post(CMPL, json=_cmpl(max_tokens=4, temperature=0, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert server.get("/health").status_code == 200
    server.assert_clean()
