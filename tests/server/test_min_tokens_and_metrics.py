"""Over HTTP: ``min_tokens`` (OpenAI routes, vLLM's extension) and ``min_new_tokens``
(/generate, SGLang's), their 400s; the token counters' exact values after known
requests and the ``model_name`` label on every series."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.server.conftest import MODEL_NAME, LiveServer

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = list(range(40, 60))  # 20 token ids
GREEDY = {"temperature": 0}


def _cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": PROMPT, **GREEDY, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}],
            **GREEDY, **fields}


def _generate(server: LiveServer, **params: Any) -> dict[str, Any]:
    r = server.post("/generate", json={"input_ids": PROMPT,
                                       "sampling_params": {**GREEDY, **params}})
    assert r.status_code == 200, r.text
    return r.json()


def _bad(r: Any, param: str | None, words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param and words in error["message"], error


def test_min_new_tokens_on_generate_masks_the_stop_id(server: LiveServer) -> None:
    first = _generate(server, max_new_tokens=4)["output_ids"][0]
    assert _generate(server, max_new_tokens=16, stop_token_ids=[first])["output_ids"] == [first]
    out = _generate(server, max_new_tokens=16, stop_token_ids=[first], min_new_tokens=6)
    assert len(out["output_ids"]) >= 6 and first not in out["output_ids"][:6]
    same = _generate(server, max_new_tokens=16, stop_token_ids=[first], min_new_tokens=0)
    assert same["output_ids"] == [first]
    server.assert_clean()


def test_min_tokens_on_the_openai_routes(server: LiveServer) -> None:
    first = _generate(server, max_new_tokens=4)["output_ids"][0]
    stop = {"stop_token_ids": [first], "max_tokens": 16}
    assert server.post(CMPL, json=_cmpl(**stop)).json()["usage"]["completion_tokens"] == 1
    r = server.post(CMPL, json=_cmpl(**stop, min_tokens=6)).json()
    assert r["usage"]["completion_tokens"] >= 6
    native = _generate(server, max_new_tokens=16, stop_token_ids=[first], min_new_tokens=6)
    assert r["choices"][0]["text"] == native["text"]  # the same request on both APIs
    chat = server.post(CHAT, json=_chat(max_tokens=5, min_tokens=5)).json()
    assert chat["usage"]["completion_tokens"] == 5
    assert chat["choices"][0]["finish_reason"] == "length"
    server.assert_clean()


def test_bad_min_tokens_is_a_400(server: LiveServer) -> None:
    _bad(server.post(CMPL, json=_cmpl(max_tokens=4, min_tokens=5)), "min_tokens",
         "min_tokens must be in [0, 4] (max_tokens), got 5")
    _bad(server.post(CMPL, json=_cmpl(min_tokens=-1)), "min_tokens", "got -1")
    _bad(server.post(CMPL, json=_cmpl(min_tokens=True)), "min_tokens", "integer")
    _bad(server.post(CHAT, json=_chat(max_completion_tokens=3, min_tokens=4)), "min_tokens",
         "min_tokens must be in [0, 3]")
    _bad(server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "min_new_tokens": 4}}), "sampling_params",
        "min_new_tokens (4) must be at most max_new_tokens (3)")
    _bad(server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "min_new_tokens": "2"}}), "sampling_params", "min_new_tokens must be an integer")
    assert server.post(CMPL, json=_cmpl(max_tokens=2)).status_code == 200  # still serving
    server.assert_clean()


# -- metrics --------------------------------------------------------------------------------
TOKENS = ("kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
          "kvserve:prefix_cache_hit_tokens_total")


def _tokens(server: LiveServer) -> tuple[float, ...]:
    metrics = server.metrics()
    return tuple(metrics[name] for name in TOKENS)


def _wait_tokens(server: LiveServer, expected: tuple[float, ...]) -> tuple[float, ...]:
    deadline = time.monotonic() + 10  # stats snapshots trail the engine by <= 100 ms
    while (seen := _tokens(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_token_counters_count_exactly_the_replies_usage(server: LiveServer) -> None:
    server.assert_clean()
    before = _tokens(server)
    usages = [
        server.post(CMPL, json=_cmpl(max_tokens=5, ignore_eos=True)).json()["usage"],
        server.post(CMPL, json=_cmpl(max_tokens=5, ignore_eos=True)).json()["usage"],
        server.post(CHAT, json=_chat(max_tokens=3, ignore_eos=True)).json()["usage"],
        server.post(CMPL, json=_cmpl(max_tokens=0)).json()["usage"],
    ]
    assert [u["completion_tokens"] for u in usages] == [5, 5, 3, 0]
    assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] == 20
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # the repeat hit the cache
    prompt = sum(u["prompt_tokens"] for u in usages)  # cached tokens count too (vLLM)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    expected = (before[0] + prompt, before[1] + 13, before[2] + hits)
    assert _wait_tokens(server, expected) == expected
    server.assert_clean()


def test_every_series_has_the_model_name_label(server: LiveServer) -> None:
    assert server.post(CMPL, json=_cmpl(max_tokens=1)).status_code == 200
    assert server.post(CMPL, json=_cmpl(n=2)).status_code == 400  # an http_errors sample
    text = server.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("kvserve:")]
    names = {line.split("{")[0] for line in lines}
    assert {"kvserve:generation_tokens_total", "kvserve:prompt_tokens_total",
            "kvserve:http_errors_total", "kvserve:time_to_first_token_seconds_count",
            "kvserve:num_running_reqs"} <= names
    unlabelled = [line for line in lines if f'model_name="{MODEL_NAME}"' not in line]
    assert not unlabelled, unlabelled
    assert "# TYPE kvserve:generation_tokens_total counter" in text


def test_chat_route_builds_the_prompt_with_chat_prompt_ids(server: LiveServer,
                                                            model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from kvserve.engine.chat import chat_prompt_ids

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi there"}]
    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), messages)
    chat = server.post(CHAT, json={**_chat(max_tokens=4, ignore_eos=True),
                                   "messages": messages}).json()
    r = server.post("/generate", json={"input_ids": ids, "sampling_params": {
        **GREEDY, "max_new_tokens": 4, "ignore_eos": True}}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids) == r["meta_info"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == r["text"]
