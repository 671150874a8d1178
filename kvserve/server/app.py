"""The FastAPI app of ``kvserve serve``: OpenAI and SGLang-native endpoints.

    POST /v1/completions, /v1/chat/completions   OpenAI; ``stream`` -> server-sent events
    POST /generate                               SGLang's native shape
    POST /abort_request  {"rid": ...}            abort at any stage
    GET|POST /flush_cache                        reset the prefix cache (only when idle)
    GET  /v1/models, /health, /health_generate, /metrics, /get_load,
         /get_model_info (/model_info), /get_server_info (/server_info)
    GET  /debug/check                            with --enable-debug-endpoints

A request is tokenized here, queued in the engine process and read back as token
ids, detokenized here (complete UTF-8 only; cut exactly at a stop string). A
watcher polls every in-flight request for a client disconnect every 50 ms and
aborts it in the engine (streaming, non-streaming, queued or prefilling alike).
Refusals are 4xx with OpenAI's error body; a full waiting queue is 429 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.detokenize import TextStream
from kvserve.engine import EngineArgs
from kvserve.sched.req import QueueFull, RequestRejected, SamplingParams
from kvserve.sched.scheduler import ReqOutput
from kvserve.server.client import EngineClient, EngineDead, RequestChannel
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    AbortRequest,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIRequest,
)

DISCONNECT_POLL_S = 0.05  # every in-flight request is checked this often
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed
_BodyT = TypeVar("_BodyT", bound=BaseModel)


@dataclass
class ServerArgs:
    """``kvserve serve`` options beyond the engine's (``EngineArgs``)."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the checkpoint folder's name
    enable_debug_endpoints: bool = False
    max_request_bytes: int = 4 * 1024 * 1024  # larger bodies get 413
    startup_timeout_s: float = 300.0


@dataclass
class Generation:
    """One request in flight on the HTTP side."""

    rid: str
    channel: RequestChannel
    text: TextStream
    arrival: float
    http: Request | None = None
    last_token_at: float | None = None
    finished: bool = False
    disconnected: bool = False
    logprobs_sent: int = 0  # streaming: tokens whose log-probabilities went out already


class ApiKeyMiddleware:
    """Bearer-token check on every path but ``OPEN_PATHS`` (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                 kind="authentication_error")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _api_error(err: BaseException) -> ApiError:
    """Map an exception from the request path to its HTTP error."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, QueueFull):
        return ApiError(429, str(err), kind="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(err, RequestRejected):
        return ApiError(400, str(err))
    if isinstance(err, EngineDead):
        return ApiError(503, f"engine unavailable: {err}", kind="server_error")
    if isinstance(err, ClientDisconnect):  # hung up mid-body: nginx's 499, not a 500
        return ApiError(499, "client closed the connection before sending the whole body")
    return ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error")


def _usage(out: ReqOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class Server:
    """State shared by the endpoints: engine client, tokenizer, metrics, in-flight table."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.client = EngineClient(args.engine, args.startup_timeout_s)
        self.metrics = ServerMetrics(lambda: self.client.stats)
        self.inflight: dict[str, Generation] = {}
        self.tokenizer: Any = None
        self.model_name = ""
        self.context_len = 0
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from kvserve.model.init import CHAT_TEMPLATE

        await self.client.start()
        path = self.client.info["model_path"]
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = CHAT_TEMPLATE
        self.model_name = self.args.served_model_name or path.rstrip("/").rsplit("/", 1)[-1]
        self.context_len = int(self.client.info["context_len"])
        self._watcher = asyncio.create_task(self._watch_disconnects())

    def abort_inflight(self) -> None:
        """Shutdown: abort every request in flight; its client still gets the end of
        its reply (finish_reason "abort", then ``[DONE]`` when streaming)."""
        for rid in list(self.inflight):
            self.client.abort(rid)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self.client.shutdown()

    # -- request plumbing ------------------------------------------------------------------
    async def read_body(self, request: Request, model: type[_BodyT]) -> _BodyT:
        """The JSON body as ``model``; 413 over ``max_request_bytes``, 400 for bad
        UTF-8, bad JSON or a body that does not fit the model."""
        limit = self.args.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds {limit} bytes")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ApiError(400, f"request body is not valid UTF-8: {err.reason} at byte "
                           f"{err.start}") from None
        try:
            obj = json.loads(text, parse_constant=_reject_json_constant)
            if _SURROGATE_ESCAPE.search(text):  # a lone surrogate cannot become UTF-8 again
                json.dumps(obj, ensure_ascii=False).encode()
        except (ValueError, RecursionError) as err:  # UnicodeError is a ValueError
            raise ApiError(400, f"request body is not valid JSON: {err}") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            return model.model_validate(obj)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']} ({err.error_count()} error(s))",
                           where or None) from None

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.client.info["model_path"]):
            raise ApiError(404, f"model {name!r} not found; this server serves "
                           f"{self.model_name!r}", "model", kind="not_found_error")

    def encode(self, prompt: str) -> list[int]:
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        return list(self.tokenizer.encode(prompt))

    async def submit(self, http: Request | None, ids: list[int], sampling: SamplingParams,
                     rid: str | None) -> Generation:
        """Queue in the engine; the returned generation is watched for disconnects."""
        rid = rid or uuid.uuid4().hex
        if rid in self.inflight:
            raise ApiError(400, f"duplicate request id {rid!r}", "rid")
        arrival = time.perf_counter()
        channel = await self.client.add(rid, ids, sampling)
        gen = Generation(rid, channel, TextStream(self.tokenizer, sampling.stop), arrival, http)
        self.inflight[rid] = gen
        return gen

    async def outputs(self, gen: Generation) -> AsyncIterator[tuple[str, ReqOutput]]:
        """(new text, output) per engine output until finished. Leaving early (client
        gone, cancelled) aborts the request in the engine."""
        try:
            while not gen.finished:
                item = await gen.channel.queue.get()
                if isinstance(item, Exception):
                    raise item
                reason = item.finished_reason
                gen.finished = reason is not None
                delta = gen.text.add(item.new_token_ids, gen.finished,
                                     reason.matched_stop if reason else None)
                self._observe(gen, len(item.new_token_ids))
                yield delta, item
        finally:
            if not gen.finished:
                self.client.abort(gen.rid)
            self.inflight.pop(gen.rid, None)
            self.client.release(gen.rid)

    async def final(self, gen: Generation) -> tuple[str, ReqOutput]:
        last = None
        async for _, last in self.outputs(gen):  # noqa: B007
            pass
        assert last is not None
        return gen.text.sent, last

    def _observe(self, gen: Generation, new_tokens: int) -> None:
        now = time.perf_counter()
        if new_tokens:
            if gen.last_token_at is None:
                self.metrics.ttft.observe(now - gen.arrival)
            else:
                per_token = (now - gen.last_token_at) / new_tokens
                for _ in range(new_tokens):
                    self.metrics.itl.observe(per_token)
            gen.last_token_at = now
        if gen.finished:
            self.metrics.e2e.observe(now - gen.arrival)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for gen in list(self.inflight.values()):
                if gen.http is not None and not gen.disconnected and not gen.finished \
                        and await gen.http.is_disconnected():
                    gen.disconnected = True
                    self.client.abort(gen.rid)


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
    return list(gen.text.ids[start:start + len(values)]), values


def _stream_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _sse_with_errors(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body that reports a failure after the headers as an error event."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as err:
        yield _sse(_api_error(err).body())
    yield _SSE_DONE


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
            yield _sse(frame([opening]))
        async for delta, out in srv.outputs(gen):
            finished = out.finished_reason is not None
            if delta or finished:
                yield _sse(frame([choice(delta, out)]))
            if finished and include_usage:
                yield _sse(frame([], _usage(out)))
    return _stream_response(_sse_with_errors(events()))


def create_app(args: ServerArgs, server: Server | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the engine process."""
    srv = server or Server(args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await srv.start()
        try:
            yield
        finally:
            await srv.stop()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown paths (404) and wrong methods (405) in OpenAI's error shape too."""
        return _error_response(ApiError(exc.status_code, str(exc.detail),
                                        kind="not_found_error" if exc.status_code == 404
                                        else "invalid_request_error",
                                        headers=dict(exc.headers or {})))

    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)

    def endpoint(handler: Callable[[Request], Awaitable[Response]]
                 ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as err:
                error = _api_error(err)
                srv.metrics.http_errors.labels(str(error.status)).inc()
                return _error_response(error)
        wrapped.__name__ = handler.__name__
        return wrapped

    @app.post("/v1/completions")
    @endpoint
    async def completions(request: Request) -> Response:
        body = await srv.read_body(request, CompletionRequest)
        body.check()
        srv.check_model(body.model)
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
        gen = await srv.submit(request, ids, sampling, body.rid)

        def choice(text: str, out: ReqOutput) -> dict[str, Any]:
            logprobs = None
            new = _new_logprobs(gen, out, body.stream) if want_logprobs else None
            if new is not None:
                logprobs = {"tokens": _logprob_tokens(srv.tokenizer, new[0]),
                            "token_logprobs": new[1], "top_logprobs": None,
                            "text_offset": None}
            return {"index": 0, "text": text, "logprobs": logprobs,
                    "finish_reason": _finish_kind(out)}

        return await _openai_reply(srv, gen, body, f"cmpl-{gen.rid}", "text_completion",
                                   choice)

    @app.post("/v1/chat/completions")
    @endpoint
    async def chat_completions(request: Request) -> Response:
        body = await srv.read_body(request, ChatCompletionRequest)
        body.check()
        srv.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            rendered = srv.tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True)
        except Exception as err:
            raise ApiError(400, f"messages do not fit the chat template: {err}",
                           "messages") from None
        ids = list(srv.tokenizer.encode(str(rendered), add_special_tokens=False))
        sampling = body.sampling(body.max_new_tokens, srv.context_len, srv.context_len,
                                 body.logprobs)
        gen = await srv.submit(request, ids, sampling, body.rid)

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

    @app.post("/generate")
    @endpoint
    async def generate(request: Request) -> Response:
        body = await srv.read_body(request, GenerateRequest)
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "give exactly one of text or input_ids", "text")
        ids = srv.encode(body.text) if body.text is not None else list(body.input_ids or [])
        if not ids:
            raise ApiError(400, "input_ids must not be empty", "input_ids")
        sampling = body.sampling(srv.context_len)
        gen = await srv.submit(request, ids, sampling, body.rid)

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
            return {"text": gen.text.sent, "output_ids": list(gen.text.ids), "meta_info": meta}

        if not body.stream:
            _, out = await srv.final(gen)
            return JSONResponse(reply(out))

        async def events() -> AsyncIterator[bytes]:
            async for delta, out in srv.outputs(gen):
                if delta or out.finished_reason is not None:
                    yield _sse(reply(out))  # cumulative text, as SGLang streams it
        return _stream_response(_sse_with_errors(events()))

    @app.post("/abort_request")
    @endpoint
    async def abort_request(request: Request) -> Response:
        body = await srv.read_body(request, AbortRequest)
        srv.client.abort(body.rid)
        return JSONResponse({})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @endpoint
    async def flush_cache(request: Request) -> Response:
        if not await srv.client.rpc("flush_cache"):
            raise ApiError(400, "cache not flushed: requests are in flight (retry when idle)")
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/v1/models")
    @endpoint
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": 0, "owned_by": "kvserve",
            "root": srv.client.info["model_path"], "max_model_len": srv.context_len}]})

    @app.get("/health")
    async def health(request: Request) -> Response:
        if srv.client.dead is not None:
            return _error_response(ApiError(503, srv.client.dead, kind="server_error"))
        return JSONResponse({})

    @app.get("/health_generate")
    @endpoint
    async def health_generate(request: Request) -> Response:
        gen = await srv.submit(None, [0], SamplingParams(max_new_tokens=1), None)
        await asyncio.wait_for(srv.final(gen), 30)
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4")

    # SGLang's info endpoints; sglang-router reads /server_info then /model_info (falling
    # back to the get_ names) when a worker registers, and polls /get_load (power_of_two).
    @app.get("/get_model_info")
    @app.get("/model_info")
    @endpoint
    async def get_model_info(request: Request) -> Response:
        path = srv.client.info["model_path"]
        return JSONResponse({"model_path": path, "tokenizer_path": path,
                             "is_generation": True, "served_model_name": srv.model_name,
                             "model_type": srv.client.info.get("model_type"),
                             "architectures": srv.client.info.get("architectures")})

    @app.get("/get_server_info")
    @app.get("/server_info")
    @endpoint
    async def get_server_info(request: Request) -> Response:
        stats = srv.client.stats
        return JSONResponse({**srv.client.info, "served_model_name": srv.model_name,
                             "tp_size": 1, "dp_size": 1, "disaggregation_mode": "null",
                             "stats": stats._asdict() if stats else None,
                             # HTTP side: request channels (orphans included) and replies
                             # in progress; both 0 at idle, or a rid is held forever
                             "http_channels": len(srv.client.channels),
                             "http_inflight": len(srv.inflight)})

    @app.get("/get_load")
    @endpoint
    async def get_load(request: Request) -> Response:
        stats = srv.client.stats
        return JSONResponse([{"num_tokens": stats.kv_used_tokens if stats else 0,
                              "num_reqs": stats.running + stats.waiting if stats else 0}])

    if args.enable_debug_endpoints:
        @app.get("/debug/check")
        @endpoint
        async def debug_check(request: Request) -> Response:
            return JSONResponse(await srv.client.rpc("check", timeout_s=20.0))

    return app
