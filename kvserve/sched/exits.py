"""The exits a manager may send a request through; the ``Scheduler`` implements them.

Managers decide *when* a request leaves (an abort seen at admission, an allocation
miss, a retraction victim, a finished output); the scheduler's exits decide *how*:
one release (``release_kv_cache``), deferred while a batch is in flight, the state
change, the stats and the output event.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.sched.req import FinishReason, Req


class Exits(Protocol):
    def finish(self, req: Req, reason: FinishReason, insert: bool,
               new_tokens: list[int] | None = None) -> None:
        """Release everything ``req`` holds (its KV into the cache when ``insert``),
        mark it finished with ``reason`` and emit its last output."""
        ...

    def retract(self, req: Req) -> None:
        """Release everything ``req`` holds; it goes back to the head of the waiting
        queue (with the step's other retracted requests, in arrival order) and its
        context is recomputed on readmission. A pending abort finishes it instead."""
        ...

    def emit(self, req: Req, new_tokens: list[int]) -> None:
        """Report ``new_tokens`` of a request that runs on."""
        ...
