"""Request lifecycle states (DESIGN section 1, legal resource combinations)."""

from __future__ import annotations

import enum


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, never admitted (or back after a retraction)
    ADMITTED = "admitted"  # chosen by the PrefillAdder, before its first extend
    RUNNING = "running"
    CHUNKED = "chunked"  # mid chunked prefill
    RETRACTED = "retracted"
    FINISHED = "finished"


# state -> (row, kv, lock, mamba): True must hold, False must not, None either way.
LEGAL_HOLDINGS: dict[ReqState, tuple[bool | None, bool | None, bool | None, bool | None]] = {
    ReqState.WAITING: (False, False, False, False),
    ReqState.ADMITTED: (False, False, None, None),
    ReqState.RUNNING: (True, True, None, None),
    ReqState.CHUNKED: (True, True, None, None),
    ReqState.RETRACTED: (False, False, False, False),
    ReqState.FINISHED: (False, False, False, False),
}
