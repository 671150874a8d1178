"""``RequestRouter``: which reader gets an engine event, by request id. No I/O, no locks.

Both sides of the engine use it: the in-process ``Engine`` (channels are
``queue.Queue``, guarded by the engine's lock) and the HTTP side's ``EngineClient``
(channels are ``asyncio.Queue``, one event loop). A route's life::

    open(rid)  --route(final)-->  finished  --close(rid)-->  gone     (the reader read it all)
    open(rid)  --close(rid)---->  orphan    --route(final)-> gone     (the reader left early)

An orphan keeps its rid taken until the engine's final event for it, so a new request
that reuses the rid is refused as a duplicate meanwhile and never receives the old
request's outputs or its abort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvserve.engine.messages import Rejected, is_final
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import RequestRejected

ChannelT = TypeVar("ChannelT")


@dataclass(slots=True)
class _Route(Generic[ChannelT]):
    channel: ChannelT
    finished: bool = False  # the engine's final event for the rid was routed
    orphaned: bool = False  # the reader left before that


class RequestRouter(Generic[ChannelT]):
    """rid -> the channel of the reader that waits for that request's events."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route[ChannelT]] = {}

    def open(self, rid: str, channel: ChannelT) -> None:
        """Route ``rid``'s events to ``channel``. Raises RequestRejected when ``rid`` is
        taken (by a live request or an orphan)."""
        if rid in self._routes:
            raise RequestRejected(f"duplicate request id {rid!r}")
        self._routes[rid] = _Route(channel)

    def route(self, event: ReqOutput | Rejected) -> ChannelT | None:
        """The channel to put ``event`` in, or None to drop it (an unknown rid, or an
        orphan: nobody reads it). A final event (``is_final``) frees an orphan's rid."""
        route = self._routes.get(event.rid)
        if route is None:
            return None
        final = is_final(event)
        route.finished = route.finished or final
        if not route.orphaned:
            return route.channel
        if final:
            del self._routes[event.rid]
        return None

    def close(self, rid: str) -> bool:
        """The reader of ``rid`` is done with it. Returns True when the engine has not
        sent the final event yet (the reader left early): the rid stays taken as an
        orphan until it comes, and the caller should abort the request."""
        route = self._routes.get(rid)
        if route is None:
            return False
        if route.finished:
            del self._routes[rid]
            return False
        route.orphaned = True
        return True

    def channels(self) -> list[ChannelT]:
        """Every open channel, orphans' included (to fail them all when the engine dies)."""
        return [route.channel for route in self._routes.values()]

    def rids(self) -> list[str]:
        """Every taken rid, orphans included."""
        return list(self._routes)

    def orphans(self) -> list[str]:
        """The rids whose reader left before the engine's final event."""
        return [rid for rid, route in self._routes.items() if route.orphaned]

    def __contains__(self, rid: object) -> bool:
        return rid in self._routes

    def __len__(self) -> int:
        return len(self._routes)
