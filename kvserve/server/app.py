"""The FastAPI app of ``kvserve serve``: the OpenAI routes (``openai_api``) and the
SGLang-native ones (``native_api``) over one ``Server`` in ``app.state.server``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server import native_api, openai_api
from kvserve.server.http import ApiKeyMiddleware, error_response
from kvserve.server.protocol import ApiError
from kvserve.server.state import Server, ServerArgs


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths (404) and wrong methods (405) in OpenAI's error shape too."""
    assert isinstance(exc, StarletteHTTPException)
    return error_response(ApiError(exc.status_code, str(exc.detail),
                                   kind="not_found_error" if exc.status_code == 404
                                   else "invalid_request_error",
                                   headers=dict(exc.headers or {})))


def create_app(args: ServerArgs, server: Server | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts and stops the engine process unless ``server``
    was started before (``kvserve serve`` does, to fail before it listens)."""
    srv = server or Server(args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not srv.started
        if owned:
            await srv.start()
        try:
            yield
        finally:
            if owned:
                await srv.stop()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.server = srv
    app.add_exception_handler(StarletteHTTPException, _http_error)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    if args.enable_debug_endpoints:
        app.include_router(native_api.debug_router)
    return app

