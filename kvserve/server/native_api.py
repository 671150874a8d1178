"""SGLang-native routes and operations endpoints.

    POST /generate                               SGLang's native shape
    POST /abort_request  {"rid": ...}            abort at any stage
    POST /open_session   {"capacity_of_str_len"?, "session_id"?} -> "<session id>"
    POST /close_session  {"session_id": ...}     200 (empty); 404 for an unknown session
    GET|POST /flush_cache                        reset the prefix cache (only when idle)
    GET  /health, /health_generate, /metrics, /get_load,
         /get_model_info (/model_info), /get_server_info (/server_info)
    GET  /debug/check                            ``debug_router``: --enable-debug-endpoints
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvserve.sched.output import ReqOutput
from kvserve.sched.req import SamplingParams
from kvserve.server.http import (
    endpoint,
    error_response,
    server_of,
    sse,
    sse_with_errors,
    stream_response,
)
from kvserve.server.protocol import (
    AbortRequest,
    ApiError,
    CloseSessionRequest,
    GenerateRequest,
    OpenSessionRequest,
    session_params,
)

router = APIRouter()
debug_router = APIRouter()


@router.post("/generate")
@endpoint
async def generate(request: Request) -> Response:
    srv = server_of(request)
    body = await srv.read_body(request, GenerateRequest)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    ids = srv.encode(body.text) if body.text is not None else list(body.input_ids or [])
    if not ids:
        raise ApiError(400, "input_ids must not be empty", "input_ids")
    sampling = body.sampling(srv.context_len)
    session = session_params(body.session_params)
    gen = await srv.submit(request, ids, sampling, body.rid, session)
    text = gen.stream.text

    def reply(out: ReqOutput) -> dict[str, Any]:
        reason = out.finished_reason
        finish = None if reason is None else {
            "type": reason.kind.value, "message": reason.message or None,
            "matched": reason.matched_stop if reason.matched_stop is not None
            else reason.matched_token}
        meta: dict[str, Any] = {
            "id": gen.rid, "finish_reason": finish, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens}
        if out.output_logprobs is not None:
            meta["output_token_logprobs"] = list(out.output_logprobs)
        return {"text": text.sent, "output_ids": list(text.ids), "meta_info": meta}

    if not body.stream:
        _, out = await srv.final(gen)
        return JSONResponse(reply(out))

    async def events() -> AsyncIterator[bytes]:
        async for delta, out in srv.outputs(gen):
            if delta or out.finished_reason is not None:
                yield sse(reply(out))  # cumulative text, as SGLang streams it
    return stream_response(sse_with_errors(events()))


@router.post("/abort_request")
@endpoint
async def abort_request(request: Request) -> Response:
    srv = server_of(request)
    body = await srv.read_body(request, AbortRequest)
    srv.client.abort(body.rid)
    return JSONResponse({})


@router.post("/open_session")
@endpoint
async def open_session(request: Request) -> Response:
    """SGLang's ``/open_session``: 200 with the session id as a JSON string; 400 for an
    id in use or a bad ``capacity_of_str_len``."""
    srv = server_of(request)
    body = await srv.read_body(request, OpenSessionRequest)
    return JSONResponse(await srv.client.open_session(body.session_id,
                                                      body.capacity_of_str_len))


@router.post("/close_session")
@endpoint
async def close_session(request: Request) -> Response:
    """SGLang's ``/close_session``: 200 with an empty body (a turn in flight completes
    first); 404 for an unknown or already closed session."""
    srv = server_of(request)
    body = await srv.read_body(request, CloseSessionRequest)
    if not await srv.client.close_session(body.session_id):
        raise ApiError(404, f"no open session {body.session_id!r}", "session_id",
                       kind="not_found_error")
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
@endpoint
async def flush_cache(request: Request) -> Response:
    if not await server_of(request).client.rpc("flush_cache"):
        raise ApiError(400, "cache not flushed: requests are in flight (retry when idle)")
    return PlainTextResponse("Cache flushed.\n")


@router.get("/health")
async def health(request: Request) -> Response:
    srv = server_of(request)
    if srv.client.dead is not None:
        return error_response(ApiError(503, srv.client.dead, kind="server_error"))
    return JSONResponse({})


@router.get("/health_generate")
@endpoint
async def health_generate(request: Request) -> Response:
    srv = server_of(request)
    gen = await srv.submit(None, [0], SamplingParams(max_new_tokens=1), None)
    await asyncio.wait_for(srv.final(gen), 30)
    return JSONResponse({})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_of(request).metrics.render(),
                    media_type="text/plain; version=0.0.4")


# SGLang's info endpoints; sglang-router reads /server_info then /model_info (falling
# back to the get_ names) when a worker registers, and polls /get_load (power_of_two).
@router.get("/get_model_info")
@router.get("/model_info")
@endpoint
async def get_model_info(request: Request) -> Response:
    srv = server_of(request)
    path = srv.client.info["model_path"]
    return JSONResponse({"model_path": path, "tokenizer_path": path,
                         "is_generation": True, "served_model_name": srv.model_name,
                         "model_type": srv.client.info.get("model_type"),
                         "architectures": srv.client.info.get("architectures"),
                         "random_weights": srv.client.info["random_weights"]})


@router.get("/get_server_info")
@router.get("/server_info")
@endpoint
async def get_server_info(request: Request) -> Response:
    srv = server_of(request)
    stats = srv.client.stats
    return JSONResponse({**srv.client.info, "served_model_name": srv.model_name,
                         "tp_size": 1, "dp_size": 1, "disaggregation_mode": "null",
                         "stats": stats._asdict() if stats else None,
                         # HTTP side: request channels (orphans included) and replies
                         # in progress; both 0 at idle, or a rid is held forever
                         "http_channels": len(srv.client.router),
                         "http_inflight": len(srv.inflight)})


@router.get("/get_load")
@endpoint
async def get_load(request: Request) -> Response:
    stats = server_of(request).client.stats
    return JSONResponse([{"num_tokens": stats.kv_used_tokens if stats else 0,
                          "num_reqs": stats.running + stats.waiting if stats else 0}])


@debug_router.get("/debug/check")
@endpoint
async def debug_check(request: Request) -> Response:
    return JSONResponse(await server_of(request).client.check(timeout_s=20.0))
