"""``Server``: what every route reads from ``request.app.state.server``: the engine
client, the tokenizer, the metrics and the table of requests in flight on the HTTP side.

A request is tokenized here, queued in the engine process and read back as token
ids, detokenized here (``OutputStream``: complete UTF-8 only; cut exactly at a stop
string). A watcher polls every in-flight request for a client disconnect every 50 ms
and aborts it in the engine (streaming, non-streaming, queued or prefilling alike).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.engine.client import EngineClient, RequestChannel
from kvserve.engine.core import EngineArgs
from kvserve.engine.stream import OutputStream
from kvserve.model.loader import load_tokenizer
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import SamplingParams
from kvserve.sched.session import SessionParams
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ApiError

DISCONNECT_POLL_S = 0.05  # every in-flight request is checked this often
_BodyT = TypeVar("_BodyT", bound=BaseModel)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
    stream: OutputStream
    arrival: float
    http: Request | None = None
    last_token_at: float | None = None
    disconnected: bool = False
    session_id: str | None = None  # a streaming session's turn: that session
    logprobs_sent: int = 0  # streaming: tokens whose log-probabilities went out already


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class Server:
    """State shared by the endpoints: engine client, tokenizer, metrics, in-flight table.

    Args:
        args: the server's options.
        tokenizer: the checkpoint's tokenizer, already checked (``load_tokenizer``);
            None: ``start`` loads it from the engine's model folder.
    """

    def __init__(self, args: ServerArgs, tokenizer: Any = None) -> None:
        self.args = args
        self.client = EngineClient(args.engine, args.startup_timeout_s)
        self.metrics = ServerMetrics(lambda: self.client.stats, lambda: self.model_name)
        self.inflight: dict[str, Generation] = {}
        self.tokenizer: Any = tokenizer
        self.model_name = ""
        self.context_len = 0
        self._watcher: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def started(self) -> bool:
        """``start`` has returned: the engine's model is loaded."""
        return self._watcher is not None

    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded. Raises
        EngineDead (``EngineStartError`` when it could not load) or ModelLoadError."""
        await self.client.start()
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(Path(self.client.info["model_path"]))
        self.model_name = self.args.served_model_name or self.client.info["model_name"]
        self.context_len = int(self.client.info["context_len"])
        self._watcher = asyncio.create_task(self._watch_disconnects())

    def abort_inflight(self) -> None:
        """Shutdown: abort every request in flight; its client still gets the end of
        its reply (finish_reason "abort", then ``[DONE]`` when streaming)."""
        for rid in list(self.inflight):
            self.client.abort(rid)

    async def stop(self) -> None:
        """Stop the engine process (started or still loading); a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
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
                     rid: str | None, session: SessionParams | None = None) -> Generation:
        """Queue in the engine (``session``: as a turn of that streaming session, ``ids``
        being its new tokens); the returned generation is watched for disconnects, and a
        disconnect aborts it (a session turn rolls its session back)."""
        rid = rid or uuid.uuid4().hex
        if rid in self.inflight:
            raise ApiError(400, f"duplicate request id {rid!r}", "rid")
        arrival = time.perf_counter()
        if session is not None:
            await self._abort_gone_turns(session.id)
        channel = await self.client.add(rid, ids, sampling, session)
        gen = Generation(rid, channel, OutputStream(self.tokenizer, sampling.stop), arrival,
                         http, session_id=session.id if session is not None else None)
        self.inflight[rid] = gen
        return gen

    async def outputs(self, gen: Generation) -> AsyncIterator[tuple[str, ReqOutput]]:
        """(new text, output) per engine output until finished. Leaving early (client
        gone, cancelled) aborts the request in the engine."""
        try:
            while not gen.stream.finished:
                item = await gen.channel.queue.get()
                delta = gen.stream.add(item)
                assert isinstance(item, ReqOutput)  # add raised an exception item
                self._observe(gen, len(item.new_token_ids))
                yield delta, item
        finally:
            self.inflight.pop(gen.rid, None)
            self.client.release(gen.rid)

    async def final(self, gen: Generation) -> tuple[str, ReqOutput]:
        last = None
        async for _, last in self.outputs(gen):  # noqa: B007
            pass
        assert last is not None
        return gen.stream.text.sent, last

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
        if gen.stream.finished:
            self.metrics.e2e.observe(now - gen.arrival)

    async def _abort_gone_turns(self, session_id: str) -> None:
        """Abort the session's turn whose client hung up but the watcher has not seen yet
        (a client that resets its stream and sends its next turn at once): the abort
        reaches the engine before the new turn, which then supersedes it."""
        for gen in list(self.inflight.values()):
            if gen.session_id == session_id and gen.http is not None and not gen.disconnected \
                    and not gen.stream.finished and await gen.http.is_disconnected():
                gen.disconnected = True
                self.client.abort(gen.rid)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for gen in list(self.inflight.values()):
                if gen.http is not None and not gen.disconnected and not gen.stream.finished \
                        and await gen.http.is_disconnected():
                    gen.disconnected = True
                    self.client.abort(gen.rid)
