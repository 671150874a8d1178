"""The messages between an engine's callers and ``EngineCore.run``: one class per
command and per event. ``EngineCore.handle`` and ``EngineClient`` dispatch on the class.

    caller --commands--> EngineCore.run      AddReq, AbortReq, RpcReq, CheckReq,
                                             OpenSession, CloseSession, ShutdownReq
    caller <--events---- EngineCore.run      ReqOutput, Accepted, Rejected, Reply, EngineStats

All are NamedTuples (they cross the engine process's ZMQ sockets pickled) and free of
server libraries. The engine process opens with ``EngineReady`` or ``EngineFailed``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvserve.sched.output import ReqOutput
from kvserve.sched.req import SamplingParams
from kvserve.sched.session import SessionParams


# -- commands ------------------------------------------------------------------------------
class AddReq(NamedTuple):
    """Command: queue ``rid``; answered by ``Accepted`` or ``Rejected``. With
    ``session_params`` it is a turn of a streaming session and ``input_ids`` are the new
    tokens only (``Scheduler.add_request``)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    session_params: SessionParams | None = None


class AbortReq(NamedTuple):
    """Command: abort ``rid`` at any stage (no-op for an unknown or finished rid)."""

    rid: str


class RpcReq(NamedTuple):
    """Command: a synchronous query (``EngineCore.rpc``), answered by ``Reply(tag, ...)``."""

    tag: int
    method: str  # "stats" | "info" | "flush_cache"


class CheckReq(NamedTuple):
    """Command: the full invariant check, answered by ``Reply(tag, report)`` once the
    engine is idle (or after ``CHECK_DEADLINE_S``, whichever comes first)."""

    tag: int


class OpenSession(NamedTuple):
    """Command: open a streaming session (SGLang's ``/open_session``), answered by
    ``Reply(tag, SessionReply)``. ``session_id`` None: the engine picks one;
    ``capacity_of_str_len``: the most tokens a turn's context may hold."""

    tag: int
    session_id: str | None = None
    capacity_of_str_len: int | None = None


class CloseSession(NamedTuple):
    """Command: close a streaming session (now, or at the end of its turn in flight),
    answered by ``Reply(tag, SessionReply)``; ``ok`` False for an unknown session."""

    tag: int
    session_id: str


class ShutdownReq(NamedTuple):
    """Command: abort and release every live request, then leave the loop."""

    message: str = "engine shut down"


Command = AddReq | AbortReq | RpcReq | CheckReq | OpenSession | CloseSession | ShutdownReq


# -- events --------------------------------------------------------------------------------
class Accepted(NamedTuple):
    """Event: ``rid`` is queued."""

    rid: str


class Rejected(NamedTuple):
    """Event: ``AddReq`` refused ``rid`` (nothing was queued). ``queue_full`` -> retry later."""

    rid: str
    message: str
    queue_full: bool = False


class Reply(NamedTuple):
    """Event: the answer to an ``RpcReq`` or ``CheckReq`` with the same ``tag``."""

    tag: int
    payload: Any


class SessionReply(NamedTuple):
    """The payload of the ``Reply`` to ``OpenSession`` / ``CloseSession``: ``ok`` and the
    session's id, or ``ok`` False and why (``message``, one line)."""

    ok: bool
    session_id: str
    message: str = ""


class EngineStats(NamedTuple):
    """Event: a snapshot of the engine's gauges and counters (tokens, requests)."""

    time: float  # time.time() of the snapshot
    running: int
    waiting: int
    kv_used_tokens: int  # held by live requests (owned or locked prefix)
    kv_cached_tokens: int  # evictable prefix cache
    kv_total_tokens: int
    prompt_tokens: int  # of admitted requests
    cached_tokens: int  # of those, served by the prefix cache
    retractions: int
    aborts: int
    finished: int
    queue_full: int  # requests refused by max_queued_requests
    checker_runs: int
    violations: int
    generation_tokens: int  # tokens appended to outputs (any request, any finish)
    # streaming sessions (``SessionManager``): open now, then ``SessionStats`` counters
    open_sessions: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0  # expired ones included
    sessions_expired: int = 0  # closed by session_timeout
    session_slot_hits: int = 0  # turns admitted on their session's held KV
    session_mismatches: int = 0  # turns whose context did not extend the held KV
    session_rollbacks: int = 0  # turns aborted (the session kept its last completed turn)
    session_reclaimed: int = 0  # idle sessions' KV given back under memory pressure


Event = ReqOutput | Accepted | Rejected | Reply | EngineStats


# -- the engine process's first message ----------------------------------------------------
class EngineReady(NamedTuple):
    info: dict[str, Any]  # EngineCore.rpc("info")
    stats: EngineStats  # so /metrics has every series from the start


class EngineFailed(NamedTuple):
    """The engine process could not load the model, or its loop died (a traceback)."""

    message: str


def is_final(event: ReqOutput | Rejected) -> bool:
    """Whether ``event`` is the engine's last word on its rid (a refusal or a finish)."""
    return isinstance(event, Rejected) or event.finished_reason is not None
