"""Scheduling: request states and the invariant checker (the scheduler comes next)."""

from kvserve.sched.invariants import CheckReport, InvariantChecker, InvariantViolation
from kvserve.sched.state import ReqState

__all__ = ["CheckReport", "InvariantChecker", "InvariantViolation", "ReqState"]
