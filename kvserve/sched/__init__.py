"""Scheduling: requests, batches, admission, the scheduler and the invariant checker."""

from kvserve.sched.batch import ScheduleBatch
from kvserve.sched.invariants import CheckReport, InvariantChecker, InvariantViolation
from kvserve.sched.policy import NewTokenRatio, PrefillAdder
from kvserve.sched.req import FinishKind, FinishReason, Req, RequestRejected, SamplingParams
from kvserve.sched.scheduler import AbortStatus, Scheduler, SchedulerConfig, SpecConfig
from kvserve.sched.state import ReqState

__all__ = [
    "AbortStatus",
    "CheckReport",
    "FinishKind",
    "FinishReason",
    "InvariantChecker",
    "InvariantViolation",
    "NewTokenRatio",
    "PrefillAdder",
    "Req",
    "ReqState",
    "RequestRejected",
    "SamplingParams",
    "ScheduleBatch",
    "Scheduler",
    "SchedulerConfig",
    "SpecConfig",
]
