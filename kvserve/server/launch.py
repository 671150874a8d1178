"""``kvserve serve``: arguments, then uvicorn over the app (the engine process starts in
the app's lifespan). SIGINT/SIGTERM: uvicorn stops taking connections, lets open
requests finish for a few seconds, then the engine aborts what is left, releases it
and exits; both processes are gone when this returns."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

_POLICIES = ("fcfs", "lpm")
_GRACE_S = 5  # after SIGINT/SIGTERM, open requests may finish for this long


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something (not None, False or said already)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_serve_parser(commands: argparse._SubParsersAction, positive: object,
                     non_negative: object) -> None:
    """Register ``serve`` on the top-level subcommands (no server imports here)."""
    serve = commands.add_parser(
        "serve", formatter_class=_DefaultsFormatter,
        help="OpenAI-compatible HTTP server",
        description="Serve a checkpoint over HTTP (OpenAI /v1/completions and "
        "/v1/chat/completions, SGLang /generate). Without --model, a tiny random-weight "
        "default model.",
    )
    serve.add_argument("--model", help="HF checkpoint folder; without it, the tiny "
                       "random-weight default model")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=non_negative, default=30000, help="port to listen on")
    serve.add_argument("--served-model-name", help="name in /v1/models (default: folder name)")
    serve.add_argument("--page-size", type=positive, default=16, help="KV page size in tokens")
    serve.add_argument("--max-total-tokens", type=positive, default=None,
                       help="KV pool size in tokens (default: from memory)")
    serve.add_argument("--chunked-prefill-size", type=int, default=2048,
                       help="tokens per prefill chunk (<= 0 disables chunking)")
    serve.add_argument("--context-length", type=positive, default=None,
                       help="max tokens per request (default: the model's, at most 8192)")
    serve.add_argument("--max-running-requests", type=positive, default=64,
                       help="requests decoding at once (rows of the request-to-token table)")
    serve.add_argument("--max-queued-requests", type=positive, default=None,
                       help="waiting-queue bound; beyond it requests get 429")
    serve.add_argument("--disable-radix-cache", action="store_true",
                       help="no prefix sharing between requests")
    serve.add_argument("--schedule-policy", choices=_POLICIES, default="fcfs",
                       help="admission order: first come, or longest prefix match")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--enable-debug-endpoints", action="store_true",
                       help="add GET /debug/check (strict invariant check when idle)")
    serve.add_argument("--strict-checks", action="store_true",
                       help="run the strict checker after every step (slow; tests)")
    serve.add_argument("--device", default=None,
                       help="cpu, cuda or cuda:N (default: cuda when available)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weights and KV (default: float32 on CPU, bfloat16 on GPU)")
    serve.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                       default="auto", help="auto: triton on CUDA, else torch")
    serve.add_argument("--log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level")


def _uvicorn_server(config: Any, abort_inflight: Callable[[], None]) -> Any:
    """uvicorn's server, aborting what is still in flight a second before its graceful
    shutdown would cut the connections: open streams end with finish_reason "abort" and
    ``[DONE]``, not a truncated body."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(_GRACE_S - 1, abort_inflight)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the exit status."""
    try:
        import uvicorn

        from kvserve.engine import EngineArgs
        from kvserve.server.app import create_app
        from kvserve.server.state import ServerArgs
    except ImportError as err:
        print(f"kvserve serve needs the server extras ({err.name} is missing): "
              "pip install 'kvserve[server]'", file=sys.stderr)
        return 2
    from kvserve.model.config import ModelLoadError
    from kvserve.model.loader import load_config
    from kvserve.model.source import resolve_model

    try:
        resolved = resolve_model(args.model)
        load_config(resolved.path)  # a bad folder is a message here, not a traceback
    except ModelLoadError as err:
        print(f"kvserve: cannot load model: {err}", file=sys.stderr)
        return 2
    if resolved.note:
        print(f"kvserve: {resolved.note}", file=sys.stderr)
    chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
    engine = EngineArgs(
        model_path=args.model, page_size=args.page_size, chunked_prefill_size=chunk,
        max_total_tokens=args.max_total_tokens, context_len=args.context_length,
        disable_radix_cache=args.disable_radix_cache, device=args.device, dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests, schedule_policy=args.schedule_policy,
        strict_checks=args.strict_checks, attention_backend=args.attention_backend,
    )
    server_args = ServerArgs(engine=engine, host=args.host, port=args.port,
                             api_key=args.api_key, served_model_name=args.served_model_name,
                             enable_debug_endpoints=args.enable_debug_endpoints)
    app = create_app(server_args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=_GRACE_S, access_log=False)
    server = _uvicorn_server(config, app.state.server.abort_inflight)
    print(f"kvserve: serving {resolved.source} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    # uvicorn re-raises a captured SIGINT/SIGTERM after its graceful shutdown, into the
    # handlers found at start: make those no-ops so a signalled stop exits with 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 1
