"""OpenAI routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` ->
server-sent events) and ``GET /v1/models``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.chat import chat_prompt_ids
from kvserve.sched.output import ReqOutput
from kvserve.server.http import endpoint, server_of, sse, sse_with_errors, stream_response
from kvserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    session_params,
)
from kvserve.server.state import Generation, Server

router = APIRouter()
_BodyT = TypeVar("_BodyT", CompletionRequest, ChatCompletionRequest)


async def _read_request(request: Request, model: type[_BodyT]) -> tuple[Server, _BodyT]:
    """The server and the checked body, for the served model (else 400 / 404)."""
    srv = server_of(request)
    body = await srv.read_body(request, model)
    body.check()
    srv.check_model(body.model)
    return srv, body


def _usage(out: ReqOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _logprob_tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    return [str(tokenizer.decode([i])) for i in ids]


def _new_logprobs(gen: Generation, out: ReqOutput, stream: bool
                  ) -> tuple[list[int], list[float]] | None:
    """(token ids, log-probabilities) to put in a reply: all of them, or when streaming
    only those not sent in an earlier event (the events add up to the whole list)."""
    if out.output_logprobs is None:
        return None
    start = gen.logprobs_sent if stream else 0
    values = list(out.output_logprobs[start:])
    if stream and not values:
        return None
    gen.logprobs_sent = start + len(values)
    return list(gen.stream.text.ids[start:start + len(values)]), values


def _finish_kind(out: ReqOutput) -> str | None:
    reason = out.finished_reason
    return reason.kind.value if reason else None


async def _openai_reply(srv: Server, gen: Generation, body: OpenAIRequest, reply_id: str,
                        object_name: str, choice: Callable[[str, ReqOutput], dict[str, Any]],
                        opening: dict[str, Any] | None = None) -> Response:
    """The reply of both OpenAI endpoints: one JSON object, or (``body.stream``) an SSE
    stream with ``opening`` first, a chunk per step that shows text or finishes, the
    usage chunk when ``stream_options.include_usage``, and ``[DONE]``. ``choice(text,
    output)`` builds the endpoint's choice object from new (or, unstreamed, all) text."""
    created = int(time.time())

    def frame(choices: list[Any], usage: Any = None) -> dict[str, Any]:
        obj = {"id": reply_id, "object": object_name, "created": created,
               "model": srv.model_name, "choices": choices}
        if usage is not None or not body.stream:
            obj["usage"] = usage
        return obj

    if not body.stream:
        text, out = await srv.final(gen)
        return JSONResponse(frame([choice(text, out)], _usage(out)))
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events() -> AsyncIterator[bytes]:
        if opening is not None:
            yield sse(frame([opening]))
        async for delta, out in srv.outputs(gen):
            finished = out.finished_reason is not None
            if delta or finished:
                yield sse(frame([choice(delta, out)]))
            if finished and include_usage:
                yield sse(frame([], _usage(out)))
    return stream_response(sse_with_errors(events()))


@router.post("/v1/completions")
@endpoint
async def completions(request: Request) -> Response:
    srv, body = await _read_request(request, CompletionRequest)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, "batched prompts are not supported: send one prompt "
                           "per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = srv.encode(prompt)
    elif not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    else:
        ids = list(prompt)  # type: ignore[arg-type]
    want_logprobs = body.logprobs is not None and body.logprobs > 0
    sampling = body.sampling(body.max_tokens, 16, srv.context_len, want_logprobs)
    session = session_params(body.session_params)
    gen = await srv.submit(request, ids, sampling, body.rid, session)

    def choice(text: str, out: ReqOutput) -> dict[str, Any]:
        logprobs = None
        new = _new_logprobs(gen, out, body.stream) if want_logprobs else None
        if new is not None:
            logprobs = {"tokens": _logprob_tokens(srv.tokenizer, new[0]),
                        "token_logprobs": new[1], "top_logprobs": None,
                        "text_offset": None}
        return {"index": 0, "text": text, "logprobs": logprobs,
                "finish_reason": _finish_kind(out)}

    return await _openai_reply(srv, gen, body, f"cmpl-{gen.rid}", "text_completion", choice)


@router.post("/v1/chat/completions")
@endpoint
async def chat_completions(request: Request) -> Response:
    srv, body = await _read_request(request, ChatCompletionRequest)
    session = session_params(body.session_params, chat=True)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = chat_prompt_ids(srv.tokenizer, messages)
    except ValueError as err:
        raise ApiError(400, str(err), "messages") from None
    sampling = body.sampling(body.max_new_tokens, srv.context_len, srv.context_len,
                             body.logprobs)
    gen = await srv.submit(request, ids, sampling, body.rid, session)

    def logprobs(out: ReqOutput) -> dict[str, Any] | None:
        new = _new_logprobs(gen, out, body.stream) if body.logprobs else None
        if new is None:
            return None
        tokens = _logprob_tokens(srv.tokenizer, new[0])
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": []}
                            for t, lp in zip(tokens, new[1], strict=False)]}

    def choice(text: str, out: ReqOutput) -> dict[str, Any]:
        if body.stream:
            message = {"delta": {"content": text} if text else {}}
        else:
            message = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **message, "logprobs": logprobs(out),
                "finish_reason": _finish_kind(out)}

    opening = {"index": 0, "delta": {"role": "assistant", "content": ""},
               "logprobs": None, "finish_reason": None}
    return await _openai_reply(
        srv, gen, body, f"chatcmpl-{gen.rid}",
        "chat.completion.chunk" if body.stream else "chat.completion", choice, opening)


@router.get("/v1/models")
@endpoint
async def models(request: Request) -> Response:
    srv = server_of(request)
    return JSONResponse({"object": "list", "data": [{
        "id": srv.model_name, "object": "model", "created": 0, "owned_by": "kvserve",
        "root": srv.client.info["model_path"], "max_model_len": srv.context_len,
        "random_weights": srv.client.info["random_weights"]}]})
