"""The scheduler's side of a step: the requests and the ``ForwardBatch`` sent to the model."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.forward import ForwardBatch, ForwardMode
from kvserve.sched.req import Req


@dataclass(slots=True)
class ScheduleBatch:
    """The scheduler's side of a step: the requests and the snapshot sent to the model."""

    batch_id: int
    forward_mode: ForwardMode
    reqs: list[Req]
    forward_batch: ForwardBatch
