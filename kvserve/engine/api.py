"""``Engine``: an in-process engine, ``EngineCore.run`` in a background thread.

    from kvserve import Engine, SamplingParams
    with Engine(model_path="/path/to/hf-checkpoint") as engine:
        out = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16})
        print(out.text, out.finish_reason)
        reply = engine.chat([{"role": "user", "content": "Hi!"}])  # the chat template

Streaming sessions (SGLang's session API) keep a conversation's KV between turns::

        sid = engine.open_session()
        t1 = engine.generate(input_ids=ids, session_params={"id": sid})
        t2 = engine.generate(input_ids=new_ids, session_params={"id": sid, "rid": t1.rid})
        engine.close_session(sid)

Callers' threads put commands in an inbox queue; the loop's thread routes each
request's events to the caller's queue through a ``RequestRouter``, so ``abort``
works while another thread reads a stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.engine.chat import chat_prompt_ids
from kvserve.engine.core import EngineArgs, EngineCore
from kvserve.engine.messages import (
    AbortReq,
    AddReq,
    CheckReq,
    CloseSession,
    Command,
    EngineStats,
    Event,
    OpenSession,
    Rejected,
    Reply,
    RpcReq,
    SessionReply,
    ShutdownReq,
)
from kvserve.engine.router import RequestRouter
from kvserve.engine.stream import OutputStream
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import RequestRejected, SamplingParams
from kvserve.sched.session import SessionError, SessionParams

Outbox = queue.Queue[ReqOutput | Exception]  # one request's outputs, for its reader
SessionParamsLike = SessionParams | Mapping[str, Any]
_REPLY_TIMEOUT_S = 30.0  # an engine query (session command, rpc, check) waits this long


@dataclass
class GenerateOutput:
    """A finished (or, when streaming, partial) request. Token counts are tokens."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    finish_message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    delta: str = ""  # streaming: text new since the previous chunk
    output_logprobs: list[float] | None = None  # with return_logprob, on the final output


def parse_sampling(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """``SamplingParams`` from an object, a dict of its fields or None (defaults).
    Raises RequestRejected for unknown fields or bad values."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params.validate()
        return params
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(params) - names
    if unknown:
        raise RequestRejected(f"unknown sampling parameters: {sorted(unknown)}")
    values = dict(params)
    for key in ("stop_token_ids", "stop"):
        if key in values:
            v = values[key]
            if isinstance(v, dict | set):  # tuple() of these would keep keys / lose order
                raise RequestRejected(f"{key} must be a string, an integer or a list, "
                                      f"got {type(v).__name__}")
            values[key] = () if v is None else (v,) if isinstance(v, str | int) else tuple(v)
    sampling = SamplingParams(**values)
    sampling.validate()
    return sampling


def parse_session_params(params: SessionParamsLike | None) -> SessionParams | None:
    """``SessionParams`` from an object or its JSON object (``id``, ``rid``, ``offset``,
    ``replace``); None stays None. Raises SessionError (a RequestRejected) naming the
    first bad field."""
    if params is None:
        return None
    return SessionParams.parse(dict(params) if isinstance(params, Mapping) else params)


def chat_session_params(params: SessionParamsLike | None) -> SessionParams | None:
    """``session_params`` of a chat request, whose messages are the whole conversation:
    only ``id`` (and ``replace``); ``rid``/``offset`` continue a raw token prompt and are
    refused with SessionError."""
    parsed = parse_session_params(params)
    if parsed is not None and (parsed.rid is not None or parsed.offset):
        raise SessionError("chat messages are the whole conversation: session_params takes "
                           "only 'id' (and 'replace'); 'rid' and 'offset' continue a token "
                           "prompt (send it to generate / /generate instead)")
    return parsed


class Engine:
    """An in-process engine over a local Hugging Face checkpoint: ``EngineCore.run`` in a
    background thread. Keyword arguments are ``EngineArgs`` fields (``model_path``,
    ``page_size``, ``chunked_prefill_size``, ``max_total_tokens``, ``device``, ...)."""

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        self.core = EngineCore(EngineArgs(model_path=model_path, **kwargs))
        self.runner = self.core.runner
        self.scheduler = self.core.scheduler
        self.tokenizer = self.core.tokenizer
        self.model_path = self.core.model_path
        self._inbox: queue.Queue[Command] = queue.Queue()
        self.router: RequestRouter[Outbox] = RequestRouter()
        self._lock = threading.Lock()  # the router and replies, between callers and the loop
        self._replies: dict[int, queue.Queue[Any]] = {}  # tag -> the caller's reply box
        self._tags = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        session_params: SessionParamsLike | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Run one request (a str or one id list) or many (a list of them) to completion.
        Raises RequestRejected for bad input (nothing is queued for it).

        ``session_params`` (SGLang's: ``{"id", "rid"?, "offset"?, "replace"?}``, one
        prompt only) makes the request a turn of a streaming session (``open_session``):
        the prompt is the NEW tokens, appended to turn ``rid``'s prompt + output (cut to
        ``[:offset]``), or alone when ``rid`` is None; ``prompt_tokens`` and
        ``cached_tokens`` count the whole context. A refused turn raises RequestRejected
        and leaves the session as it was: SessionError for malformed ``session_params``;
        the engine's refusal for an unknown session, a turn in flight without
        ``replace``, an unknown or aborted ``rid``, an ``offset`` outside turn ``rid``, a
        context over the session's ``capacity_of_str_len``."""
        single, requests = self._requests(prompt, input_ids)
        sampling = parse_sampling(sampling_params)
        session = parse_session_params(session_params)
        if session is not None and not single:
            raise SessionError("session_params takes one prompt (a session runs one turn "
                               "at a time)")
        opened = [self._submit(ids, sampling, rid if single else None, session)
                  for ids in requests]
        try:
            results = [self._collect(r, box, sampling.stop) for r, box in opened]
        except Exception:
            for other, _ in opened:  # one was rejected: stop the rest instead of orphaning them
                self._leave(other)
            raise
        return results[0] if single else results

    def generate_stream(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        session_params: SessionParamsLike | None = None,
    ) -> Generator[GenerateOutput, None, None]:  # close() it to walk away early
        """Yield a ``GenerateOutput`` per step that produced tokens; ``delta`` is the new
        text (incomplete UTF-8 held back); the last one has ``finish_reason`` set.
        ``session_params``: as in ``generate``; closing the generator early aborts the
        turn and its session rolls back to its last completed turn."""
        single, requests = self._requests(prompt, input_ids)
        if not single:
            raise RequestRejected("generate_stream takes one prompt")
        sampling = parse_sampling(sampling_params)
        session = parse_session_params(session_params)
        rid, box = self._submit(requests[0], sampling, rid, session)
        yield from self._stream(rid, box, sampling.stop)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        session_params: SessionParamsLike | None = None,
    ) -> GenerateOutput:
        """One chat turn: ``messages`` (``{"role", "content"}`` dicts) through the model's
        chat template (``chat_prompt_ids``, the prompt ``/v1/chat/completions`` builds),
        run to completion. Raises RequestRejected for messages the template refuses.

        ``session_params={"id": sid}`` (optionally ``"replace"``) runs it as a turn of
        session ``sid``: ``messages`` stay the whole conversation, and the KV the session
        holds is reused when the new prompt extends it (``chat_session_params``)."""
        session = chat_session_params(session_params)
        try:
            ids = chat_prompt_ids(self.tokenizer, messages)
        except ValueError as err:
            raise RequestRejected(str(err)) from None
        out = self.generate(input_ids=ids, sampling_params=sampling_params, rid=rid,
                            session_params=session)
        assert isinstance(out, GenerateOutput)
        return out

    def abort(self, rid: str) -> None:
        """Abort a request at any stage (no-op for an unknown or finished rid)."""
        self._inbox.put(AbortReq(rid))

    def open_session(self, session_id: str | None = None,
                     capacity_of_str_len: int | None = None) -> str:
        """Open a streaming session (SGLang's ``open_session``); returns its id (a new
        uuid4 hex when ``session_id`` is None). ``capacity_of_str_len``: the most tokens
        a turn's context (held history + new tokens) may hold; None: the context length.
        Raises SessionError (a RequestRejected) for an id in use or a bad capacity."""
        reply = self._call(lambda tag: OpenSession(tag, session_id, capacity_of_str_len))
        if not reply.ok:
            raise SessionError(reply.message)
        return str(reply.session_id)

    def close_session(self, session_id: str) -> bool:
        """Close a streaming session: its held KV goes back to the prefix cache now, or
        at the end of its turn in flight (which completes). False, and nothing done, for
        an unknown or already closed session (SGLang ignores those quietly too)."""
        reply: SessionReply = self._call(lambda tag: CloseSession(tag, session_id))
        return reply.ok

    def flush_cache(self) -> bool:
        """Empty the prefix cache (idle sessions' held KV first); False, and nothing done,
        while requests are in flight (SGLang's ``flush_cache``)."""
        return bool(self._call(lambda tag: RpcReq(tag, "flush_cache")))

    def stats(self) -> EngineStats:
        """The engine's gauges and counters now (``EngineCore.stats``; sessions included)."""
        snapshot: EngineStats = self._call(lambda tag: RpcReq(tag, "stats"))
        return snapshot

    def check(self) -> dict[str, Any]:
        """The engine's full invariant check once it is idle (``EngineCore.check``):
        ``ok``, ``violations``, ``pools`` (tokens and rows per pool), ``open_sessions``."""
        report: dict[str, Any] = self._call(CheckReq)
        return report

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(ShutdownReq())
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request plumbing ---------------------------------------------------------------
    def _requests(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise RequestRejected("give exactly one of prompt or input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return True, [self.tokenizer.encode(prompt)]
            if not all(isinstance(p, str) for p in prompt):
                raise RequestRejected("prompt must be a string or a list of strings")
            return False, [self.tokenizer.encode(p) for p in prompt]
        if input_ids and all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            return True, [list(input_ids)]
        if input_ids and all(isinstance(t, list | tuple) for t in input_ids):
            return False, [list(t) for t in input_ids]
        raise RequestRejected("input_ids must be a non-empty list of ints or of int lists")

    def _submit(self, ids: list[int], sampling: SamplingParams, rid: str | None,
                session: SessionParams | None = None) -> tuple[str, Outbox]:
        self._check_alive()
        if rid is None:
            rid = f"gen-{uuid.uuid4().hex}"  # never equal to a rid a caller chose
        elif not isinstance(rid, str) or not rid:
            raise RequestRejected(f"rid must be a non-empty string, got {rid!r}")
        box: Outbox = queue.Queue()
        with self._lock:
            self.router.open(rid, box)
        self._inbox.put(AddReq(rid, ids, sampling, session))
        return rid, box

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")

    def _call(self, command: Callable[[int], Command]) -> Any:
        """Send ``command(tag)`` to the loop and wait for its ``Reply`` payload."""
        self._check_alive()
        tag = next(self._tags)
        box: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._replies[tag] = box
        self._inbox.put(command(tag))
        try:
            answer = box.get(timeout=_REPLY_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no engine reply in {_REPLY_TIMEOUT_S:.0f} s") from None
        finally:
            with self._lock:
                self._replies.pop(tag, None)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _stream(self, rid: str, box: Outbox,
                stops: Sequence[str]) -> Iterator[GenerateOutput]:
        """``rid``'s outputs as ``GenerateOutput``s; ``stops`` must be the request's own
        stop strings (the text is cut exactly at the one that finished it)."""
        stream = OutputStream(self.tokenizer, stops)
        text = stream.text
        try:
            while not stream.finished:
                item = box.get()
                delta = stream.add(item)
                assert isinstance(item, ReqOutput)  # add raised an exception item
                reason = item.finished_reason
                yield GenerateOutput(
                    rid, text.sent, list(text.ids), reason.kind.value if reason else None,
                    reason.message if reason else "", item.prompt_tokens, item.cached_tokens,
                    item.completion_tokens, delta,
                    list(item.output_logprobs) if item.output_logprobs is not None else None,
                )
        finally:
            self._leave(rid)

    def _leave(self, rid: str) -> None:
        """The reader of ``rid`` is done; one that left before the engine's final output
        aborts the request (the rid stays taken until that output: ``RequestRouter``)."""
        with self._lock:
            orphaned = self.router.close(rid)
        if orphaned:
            self.abort(rid)

    def _collect(self, rid: str, box: Outbox, stops: Sequence[str]) -> GenerateOutput:
        last = None
        for last in self._stream(rid, box, stops):  # noqa: B007
            pass
        assert last is not None
        last.delta = ""
        return last

    # -- the engine core loop (background thread) ----------------------------------------
    def _recv(self, timeout_s: float) -> list[Command]:
        commands: list[Command] = []
        try:
            commands.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0
                            else self._inbox.get_nowait())
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            return commands

    def _deliver(self, events: Sequence[Event]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, Reply):
                    reply = self._replies.get(event.tag)
                    if reply is not None:
                        reply.put(event.payload)
                if not isinstance(event, ReqOutput | Rejected):
                    continue
                box = self.router.route(event)
                if box is not None:
                    box.put(event if isinstance(event, ReqOutput)
                            else RequestRejected(event.message))

    def _loop(self) -> None:
        try:
            self.core.run(self._recv, self._deliver)
        except BaseException as err:  # report to every waiting caller instead of hanging
            self._error = err
            self._fail_all(RuntimeError(f"engine loop died: {err!r}"))
            raise
        self._fail_all(RuntimeError("engine shut down"))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:  # a copy: readers close their route as they finish
            boxes = [*self.router.channels(), *self._replies.values()]
        for box in boxes:
            box.put(error)


__all__ = ["Engine", "GenerateOutput", "chat_session_params", "parse_sampling",
           "parse_session_params"]
