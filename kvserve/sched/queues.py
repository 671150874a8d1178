"""Named request queues, and the registry the invariant checker walks.

Every live request sits in exactly one registered queue, in a state that queue
allows: the scheduler's waiting queue, the chunked-prefill slot and the running
batch today; a later queue (PD bootstrap, pre-allocation,
transfer) registers itself the same way and the checker knows it without a new
branch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvserve.sched.invariants import TrackedQueue
from kvserve.sched.req import Req
from kvserve.sched.state import ReqState


class ListQueue:
    """An ordered queue of requests (the waiting queue, the running batch).

    ``reqs`` is the list itself, exposed for the scheduler's hot loops (iteration,
    batch filtering); order is the scheduling order.
    """

    __slots__ = ("name", "reqs", "states")

    def __init__(self, name: str, states: Iterable[ReqState]) -> None:
        self.name = name
        self.states = frozenset(states)
        self.reqs: list[Req] = []

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def append(self, req: Req) -> None:
        self.reqs.append(req)

    def remove(self, req: Req) -> None:
        """Raises ValueError if ``req`` is not queued."""
        self.reqs.remove(req)

    def keep(self, states: frozenset[ReqState]) -> None:
        """Drop the requests no longer in one of ``states`` (one pass, order kept)."""
        self.reqs = [r for r in self.reqs if r.state in states]

    def push_front(self, reqs: Iterable[Req]) -> None:
        """Put ``reqs`` at the head in arrival order (``Req.arrival``), ahead of the
        rest: requests sent back together (allocation misses, retraction victims)
        keep the order they arrived in."""
        group = sorted(reqs, key=_arrival)
        self.reqs[:0] = group


def _arrival(req: Req) -> int:
    return req.arrival


class SlotQueue:
    """A queue of at most one request (the request mid chunked prefill)."""

    __slots__ = ("name", "req", "states")

    def __init__(self, name: str, states: Iterable[ReqState]) -> None:
        self.name = name
        self.states = frozenset(states)
        self.req: Req | None = None

    def __iter__(self) -> Iterator[Req]:
        return iter(() if self.req is None else (self.req,))

    def __len__(self) -> int:
        return 0 if self.req is None else 1


class QueueRegistry:
    """The scheduler's queues by name; managers register theirs at construction.
    Raises ValueError for a second queue of the same name."""

    def __init__(self) -> None:
        self._queues: dict[str, TrackedQueue] = {}

    def register(self, queue: TrackedQueue) -> None:
        if queue.name in self._queues:
            raise ValueError(f"a queue named {queue.name!r} is already registered")
        self._queues[queue.name] = queue

    def __iter__(self) -> Iterator[TrackedQueue]:
        return iter(self._queues.values())
