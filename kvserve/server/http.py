"""HTTP plumbing the route modules share: errors in OpenAI's shape, the ``endpoint``
wrapper that turns exceptions into them, server-sent events and the API-key check.

Refusals are 4xx with OpenAI's error body; a full waiting queue is 429 with
``Retry-After``; a client that hangs up mid-body gets nginx's 499.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.engine.client import EngineDead
from kvserve.sched.req import QueueFull, RequestRejected
from kvserve.server.protocol import ApiError
from kvserve.server.state import Server

OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed
SSE_DONE = b"data: [DONE]\n\n"
Handler = Callable[[Request], Awaitable[Response]]


def server_of(request: Request) -> Server:
    """The ``Server`` the app was built with (``create_app`` puts it in app state)."""
    server: Server = request.app.state.server
    return server


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def api_error(err: BaseException) -> ApiError:
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


def endpoint(handler: Handler) -> Handler:
    """``handler`` with every exception answered as its HTTP error (and counted)."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as err:
            error = api_error(err)
            server_of(request).metrics.count_error(error.status)
            return error_response(error)
    wrapped.__name__ = handler.__name__
    return wrapped


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def stream_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def sse_with_errors(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body that reports a failure after the headers as an error event."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as err:
        yield sse(api_error(err).body())
    yield SSE_DONE


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
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
