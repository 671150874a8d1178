"""Streaming sessions: multi-turn conversations that keep their KV between turns.

Follows SGLang's session API (``/open_session``, ``/close_session``, ``session_params``
with ``id``, ``rid``, ``offset``, ``replace``) and its streaming session
(``--enable-streaming-session``): between turns a ``SessionSlot`` holds the row, the
committed KV and the prefix lock of the session's last completed turn, and the next
turn takes them over instead of matching the radix tree.

A turn's context (SGLang's ``Session.create_req``)::

    rid given:    context of turn rid (its prompt + output), cut to [:offset] when
                  offset is non-zero, then the new tokens
    rid None:     the new tokens alone (a client may send the whole conversation)

The KV record moves, it is never shared::

    turn ends (stop / length)   cache_unfinished_req, trim the tail   ReqKV -> slot
    next turn admitted          context extends the slot's tokens     slot -> ReqKV
    context does not extend     (edited history, offset, another rid) slot released
                                to the tree at add_request; the turn matches the tree
    turn aborted / OOM          released as any request; the session rolls back to
                                its last completed turn (the slot holds nothing)
    retraction                  released as any request; the turn waits again
    close with a turn in flight the release waits for the end of that turn
    pool pressure               idle slots given back oldest first (``reclaim``): their
                                pages to the tree as evictable, the tail freed, the row
                                freed; the next turn falls back to a prefix match
    idle past session_timeout   the session is closed (``expire``)

Every release of a slot goes through ``release_kv_cache`` (the slot is a ``KVOwner``),
so the one-exit rule holds for sessions too; the invariant checker counts slots as
owners (``session_held`` tokens, ``session`` rows).
"""

from __future__ import annotations

import itertools
import math
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.base import BasePrefixCache
from kvserve.kv import ReqKV, lock_prefix, move_kv, release_kv_cache, trim_kv_tail
from kvserve.sched.req import FinishKind, FinishReason, Req, RequestRejected, _is_int

SLOT_MATCH = object()  # Req.match_node of a turn whose prefix is its session's slot


class SessionError(RequestRejected):
    """A session command or ``session_params`` was refused; nothing changed."""


@dataclass(frozen=True, slots=True)
class SessionParams:
    """SGLang's ``session_params`` of a request.

    Args:
        id: the session (from ``open_session``).
        rid: the completed turn whose context this turn continues; None starts from the
            request's tokens alone.
        offset: keep only ``context[:offset]`` of turn ``rid`` (Python slice; 0 or None
            keeps all of it).
        replace: abort the session's turn in flight, if any, instead of refusing this
            one; with ``rid``, forget the turns completed after ``rid``.
    """

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False

    @classmethod
    def parse(cls, value: Any) -> SessionParams:
        """From a JSON object (or a ``SessionParams``); raises SessionError naming the
        first bad field."""
        if isinstance(value, SessionParams):
            value.validate()
            return value
        if not isinstance(value, dict):
            raise SessionError("session_params must be an object with at least an 'id'")
        unknown = set(value) - {"id", "rid", "offset", "replace"}
        if unknown:
            raise SessionError(f"unknown session_params field(s): {', '.join(sorted(unknown))}")
        if "id" not in value:
            raise SessionError("session_params needs the session 'id'")
        replace = value.get("replace")  # null is the default, as SGLang's Optional[bool]
        params = cls(value["id"], value.get("rid"), value.get("offset"),
                     False if replace is None else replace)
        params.validate()
        return params

    def validate(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise SessionError("session_params.id must be a non-empty string")
        if self.rid is not None and (not isinstance(self.rid, str) or not self.rid):
            raise SessionError("session_params.rid must be a non-empty string or null")
        if self.offset is not None and not _is_int(self.offset):
            raise SessionError(f"session_params.offset must be an integer, got {self.offset!r}")
        if self.offset and self.rid is None:
            raise SessionError("session_params.offset cuts the context of turn 'rid'; "
                               "give the rid")
        if not isinstance(self.replace, bool):
            raise SessionError(f"session_params.replace must be true or false, got "
                               f"{self.replace!r}")


@dataclass(eq=False, slots=True)
class SessionSlot:
    """What a session holds between turns: one ``ReqKV`` (row, committed KV, prefix
    lock) and the tokens whose KV it is. A ``KVOwner``, so ``release_kv_cache`` gives it
    back like a request's."""

    session_id: str
    kv: ReqKV = field(default_factory=ReqKV)
    tokens: list[int] = field(default_factory=list)  # KV exists for all of them
    extra_key: str | None = None
    idle_since: int = 0  # logical time the KV came back (reclaim order: oldest first)
    rid: str = ""  # the owner name the checker's page ledger shows: session:<id>

    def __post_init__(self) -> None:
        self.rid = f"session:{self.session_id}"

    @property
    def fill_ids(self) -> list[int]:
        return self.tokens

    @property
    def is_holding_kv(self) -> bool:
        """Reads the slot's own record (not whether some request has a row)."""
        return self.kv.holds_anything


@dataclass(eq=False)
class StreamingSession:
    """One conversation: its completed turns' contexts, its slot and its turn in flight."""

    session_id: str
    capacity: int | None  # most tokens a turn's context may hold (None: the engine's)
    slot: SessionSlot
    turns: dict[str, array] = field(default_factory=dict)  # rid -> prompt + output
    active: Req | None = None  # the turn in flight (waiting or running)
    closing: bool = False  # close asked while a turn was in flight
    last_used: float = 0.0  # clock of the last turn's end (or of opening)

    def context_for(self, params: SessionParams, new_ids: Sequence[int]) -> list[int]:
        """The context a turn with ``params`` and ``new_ids`` computes (SGLang's rule);
        raises SessionError for an unknown rid or an offset outside turn ``rid``."""
        if params.rid is None:
            return list(new_ids)
        base = self.turns.get(params.rid)
        if base is None:
            raise SessionError(f"session {self.session_id!r} has no completed turn "
                               f"{params.rid!r}")
        offset = params.offset
        if offset:
            if not -len(base) <= offset <= len(base):
                raise SessionError(f"session_params.offset {offset} is outside turn "
                                   f"{params.rid!r} (its context has {len(base)} tokens)")
            return base[:offset].tolist() + list(new_ids)
        return base.tolist() + list(new_ids)

    def find_active_slot(self, context: Sequence[int], extra_key: str | None = None
                         ) -> SessionSlot | None:
        """The slot a turn with ``context`` (in the cache namespace ``extra_key``)
        continues: it holds KV of that namespace for a proper prefix of ``context`` (at
        least one token is left to compute). None otherwise."""
        slot = self.slot
        held = len(slot.tokens)
        if not slot.is_holding_kv or held >= len(context) or slot.extra_key != extra_key:
            return None
        if list(context[:held]) != slot.tokens:
            return None
        return slot


class SessionManager:
    """The engine's streaming sessions; a ``Reclaimable`` registered with the prefix
    cache, so admission budgets count idle slots and allocation takes them back.

    Args:
        tree_cache: the prefix cache (slots lock prefixes in it and hand pages to it).
        release: the scheduler's deferred-aware release (``release(owner, insert)``).
        clock: seconds (monotonic) for ``session_timeout``.
        session_timeout: close a session idle (no turn in flight) this long; None: never.
    """

    def __init__(self, tree_cache: BasePrefixCache,
                 release: Callable[[Any, bool], None],
                 clock: Callable[[], float],
                 session_timeout: float | None = None) -> None:
        if session_timeout is not None and not (session_timeout > 0
                                                and math.isfinite(session_timeout)):
            raise ValueError(f"session_timeout must be > 0 seconds, got {session_timeout!r}")
        self.tree_cache = tree_cache
        self.release = release
        self.clock = clock
        self.session_timeout = session_timeout
        self.sessions: dict[str, StreamingSession] = {}
        self._ticks = itertools.count(1)
        self.stats = SessionStats()
        tree_cache.register_reclaimable(self)

    # -- open / close ---------------------------------------------------------------
    def open(self, session_id: str | None = None, capacity_of_str_len: int | None = None
             ) -> str:
        """A new session; returns its id. ``capacity_of_str_len`` (SGLang's name): the
        most tokens a turn's context may hold. Raises SessionError for an id in use or a
        bad capacity."""
        if session_id is None:
            session_id = uuid.uuid4().hex
        if not isinstance(session_id, str) or not session_id:
            raise SessionError("session_id must be a non-empty string")
        session = self.sessions.get(session_id)
        if session is not None and session.closing:  # the client closed it: say why it waits
            raise SessionError(f"session {session_id!r} is closing: its turn in flight "
                               f"({session.active.rid if session.active else None!r}) ends "
                               f"first, open it again after that")
        if session is not None:
            raise SessionError(f"session {session_id!r} is already open")
        if capacity_of_str_len is not None and (not _is_int(capacity_of_str_len)
                                                or capacity_of_str_len < 1):
            raise SessionError(f"capacity_of_str_len must be a positive integer, got "
                               f"{capacity_of_str_len!r}")
        self.sessions[session_id] = StreamingSession(
            session_id, capacity_of_str_len or None, SessionSlot(session_id),
            last_used=self.clock())
        self.stats.opened += 1
        return session_id

    def close(self, session_id: str) -> bool:
        """Close a session: its slot is released now, or at the end of its turn in
        flight. False for an unknown (or already closing) session."""
        session = self.sessions.get(session_id)
        if session is None or session.closing:
            return False
        if session.active is not None:
            session.closing = True
            return True
        self._drop(session)
        return True

    def _drop(self, session: StreamingSession) -> None:
        self._release_slot(session.slot)
        del self.sessions[session.session_id]
        self.stats.closed += 1

    def _release_slot(self, slot: SessionSlot) -> None:
        """The slot's KV to the tree (full pages stay cached, evictable), the rest freed."""
        if slot.is_holding_kv:
            self.release(slot, True)
        slot.tokens = []

    def expire(self) -> list[str]:
        """Close the sessions idle longer than ``session_timeout``; returns their ids."""
        if self.session_timeout is None:
            return []
        deadline = self.clock() - self.session_timeout
        old = [s for s in self.sessions.values()
               if s.active is None and not s.closing and s.last_used < deadline]
        for session in old:
            self._drop(session)
        self.stats.expired += len(old)
        return [s.session_id for s in old]

    # -- turns ----------------------------------------------------------------------
    def context_for(self, params: SessionParams, new_ids: Sequence[int]) -> list[int]:
        """Validate ``params`` for a new turn and build its context (nothing changes).
        Raises SessionError: unknown or closing session, a turn in flight (without
        ``replace``), unknown rid, bad offset, a context beyond the session's capacity."""
        session = self.sessions.get(params.id)
        if session is None or session.closing:
            raise SessionError(f"no open session {params.id!r}")
        # a turn whose abort is pending is already leaving (a client that hung up and sent
        # its next turn at once): the new turn supersedes it, as with replace
        active = session.active
        if active is not None and active.to_finish is None and not params.replace:
            raise SessionError(f"session {params.id!r} has a turn in flight "
                               f"({active.rid!r}); wait for it, abort it, or send "
                               f"replace=true")
        context = session.context_for(params, new_ids)
        if session.capacity is not None and len(context) > session.capacity:
            raise SessionError(f"the turn's context of {len(context)} tokens exceeds "
                               f"session {params.id!r}, its capacity_of_str_len of "
                               f"{session.capacity}")
        return context

    def attach(self, req: Req, params: SessionParams,
               abort: Callable[[str, str], object]) -> None:
        """``req`` (queued, holding nothing) becomes the session's turn in flight. With
        ``replace``, the turn in flight is aborted and, with a rid, later turns are
        forgotten. A slot whose tokens the context does not extend is released now."""
        session = self.sessions[params.id]
        if params.replace:
            if session.active is not None and session.active.to_finish is None:
                abort(session.active.rid, "replaced by a newer turn of its session")
            if params.rid is not None:
                rids = list(session.turns)
                for later in rids[rids.index(params.rid) + 1:]:
                    del session.turns[later]
        session.active = req
        req.session = session
        slot = session.slot
        if slot.is_holding_kv and session.find_active_slot(req.fill_ids, req.extra_key) is None:
            self.stats.mismatches += 1
            self._release_slot(slot)

    def match(self, req: Req) -> bool:
        """Admission's match for a session turn: when its slot holds KV the context
        extends, the slot is its prefix (``match_len`` = the slot's tokens, no tree
        match). False when the turn must match the tree."""
        session: StreamingSession | None = req.session
        if session is None or session.active is not req:
            return False
        slot = session.find_active_slot(req.fill_ids, req.extra_key)
        if slot is None:
            return False
        req.match_len, req.match_node = slot.kv.committed_len, SLOT_MATCH
        return True

    def acquire(self, req: Req) -> None:
        """Admission: take over the slot's record (a slot match) or lock the matched prefix."""
        if req.match_node is SLOT_MATCH:
            move_kv(req.session.slot, req)
            self.stats.slot_hits += 1
        else:
            lock_prefix(req, self.tree_cache, req.match_node)

    def give_back(self, req: Req) -> None:
        """Undo ``acquire`` (admission found the request does not fit after all)."""
        if req.match_node is SLOT_MATCH:
            move_kv(req, req.session.slot)
            self.stats.slot_hits -= 1
        else:
            release_kv_cache(req, self.tree_cache, insert=False)

    def end_turn(self, req: Req, reason: FinishReason, insert: bool) -> None:
        """The turn ``req`` leaves (called by the scheduler's ``finish``, inside its
        deferral). A completed turn's KV moves to the slot; an aborted one is released and
        the session stays at its last completed turn; a closing session is dropped."""
        session: StreamingSession = req.session
        req.session = None
        completed = reason.kind is not FinishKind.ABORT
        if session.active is not req:  # replaced (so aborted): the session is the new turn's
            release_kv_cache(req, self.tree_cache, insert=insert)
            if not completed:
                self.stats.rollbacks += 1
            return
        session.active = None
        if completed:  # completion order (replace's "later turns"), also for a reused rid
            session.turns.pop(req.rid, None)
            session.turns[req.rid] = array("i", req.fill_ids)
        session.last_used = self.clock()
        registered = self.sessions.get(session.session_id) is session
        keep = completed and not session.closing and req.kv.holds_row and registered
        if not keep:
            release_kv_cache(req, self.tree_cache, insert=insert)
            if not completed:
                self.stats.rollbacks += 1
            if session.closing and registered:
                self._drop(session)
            return
        slot = session.slot
        if slot.is_holding_kv:  # not taken over (a fallback match): the turn's is newer
            release_kv_cache(slot, self.tree_cache, insert=True)
        self.tree_cache.cache_unfinished_req(req)  # full pages to the tree, lock moved
        trim_kv_tail(req, self.tree_cache)
        move_kv(req, slot)
        slot.tokens = req.fill_ids[: slot.kv.committed_len]
        slot.extra_key = req.extra_key
        slot.idle_since = next(self._ticks)

    # -- Reclaimable ----------------------------------------------------------------
    def _idle_slots(self) -> Iterator[SessionSlot]:
        """Slots holding KV that no turn has taken over."""
        for session in self.sessions.values():
            if session.slot.is_holding_kv:
                yield session.slot

    def reclaimable_tokens(self) -> int:
        """Owned pages of every idle slot, plus the locked prefixes only idle slots lock
        (counted together: slots sharing a system prompt free it only all together)."""
        page_size = self.tree_cache.page_size
        owned = 0
        locks = []
        for slot in self._idle_slots():
            owned += len(slot.kv.owned_page_ids(page_size))
            if slot.kv.lock is not None:
                locks.append(slot.kv.lock)
        return owned * page_size + (self.tree_cache.unlock_gain(locks) if locks else 0)

    def reclaimable_rows(self) -> int:
        return sum(1 for slot in self._idle_slots() if slot.kv.holds_row)

    def reclaim(self, num_tokens: int, num_rows: int) -> None:
        """Give back idle slots, oldest first; slots a waiting turn will continue go last."""
        allocator = self.tree_cache.pools.allocator
        rows = self.tree_cache.pools.req_to_token_pool
        want = allocator.available_size() + self.tree_cache.evictable_size() + num_tokens
        want_rows = rows.available_size() + num_rows
        order = sorted(self._idle_slots(), key=lambda s: (
            self.sessions[s.session_id].active is not None, s.idle_since))
        for slot in order:
            have = allocator.available_size() + self.tree_cache.evictable_size()
            if have >= want and rows.available_size() >= want_rows:
                return
            self._release_slot(slot)
            self.stats.reclaimed += 1

    def reclaim_all(self) -> None:
        """Give back every idle slot (``flush_cache``)."""
        for slot in list(self._idle_slots()):
            self._release_slot(slot)

    # -- for the checker --------------------------------------------------------------
    def holders(self) -> list[SessionSlot]:
        """Slots holding anything (owners of pages, rows and locks)."""
        return list(self._idle_slots())


@dataclass
class SessionStats:
    """Counters of ``SessionManager`` (exact counts for tests and reports)."""

    opened: int = 0
    closed: int = 0
    expired: int = 0  # closed by session_timeout (also counted in closed)
    slot_hits: int = 0  # turns admitted on their slot's KV (no tree match)
    mismatches: int = 0  # turns whose context did not extend the slot (slot released)
    rollbacks: int = 0  # turns aborted (the session stayed at its last completed turn)
    reclaimed: int = 0  # idle slots given back under memory pressure
