"""The invariant checker: proves that every page, row and slot has exactly one owner.

Per pool (DESIGN section 3)::

    KV tokens: available + evictable + protected + session_held + pending_release
               + uncached + held == total
    rows:      free + session + live_request_rows == size
    mamba:     free + session + live_request_slots == size
    queues:    every live request in exactly one registered queue, in a state it allows

``uncached`` sums, over every live request, the pages it owns itself
(``[protected_len, allocated_len)``); ``session_held`` the same over the slots of
streaming sessions between turns (``sched.session``), whose rows count as
``session``; ``held`` is what named external holders keep (a test exhausting the
pool). A sum below the total is a leak, above it a
double free or double count: both are violations. The full ownership walk (page
ledger, row contents, lock receipts) runs when ``full=True``; strict mode runs
it and raises ``InvariantViolation`` with the per-pool report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.cache.base import BasePrefixCache
from kvserve.kv import ReqKV
from kvserve.mem.allocator import FREE, PENDING, RESERVED, USED
from kvserve.mem.ledger import PageLedger
from kvserve.mem.pages import num_pages, slot_ids
from kvserve.sched.state import LEGAL_HOLDINGS, ReqState


class TrackedReq(Protocol):
    """A live request as the checker sees it."""

    rid: str
    kv: ReqKV
    state: ReqState


class KVHolder(Protocol):
    """A holder of pool resources outside any request (a session slot)."""

    @property
    def rid(self) -> str: ...

    kv: ReqKV


class TrackedQueue(Protocol):
    """A named request queue (``kvserve.sched.queues``) as the checker sees it."""

    name: str
    states: frozenset[ReqState]

    def __iter__(self) -> Iterator[TrackedReq]: ...


@dataclass
class CheckReport:
    """Numbers per pool and every violation found, in words."""

    pools: dict[str, dict[str, int]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        lines = [
            f"{name}: " + " ".join(f"{k}={v}" for k, v in numbers.items())
            for name, numbers in self.pools.items()
        ]
        lines += [f"VIOLATION: {v}" for v in self.violations[:50]]
        if len(self.violations) > 50:
            lines.append(f"... and {len(self.violations) - 50} more")
        return "\n".join(lines)


class InvariantViolation(AssertionError):
    def __init__(self, report: CheckReport) -> None:
        super().__init__(f"invariant check failed:\n{report}")
        self.report = report


class InvariantChecker:
    """Checks pools, cache and live requests together.

    Args:
        tree_cache: the prefix cache; its ``pools`` are the pools checked.
        strict: run the full walk on every ``check`` and raise on a violation.
    """

    def __init__(self, tree_cache: BasePrefixCache, strict: bool = True) -> None:
        self.tree_cache = tree_cache
        self.pools = tree_cache.pools
        self.strict = strict
        self.runs = 0
        self.total_violations = 0
        self.total_seconds = 0.0

    def check(
        self,
        requests: Iterable[TrackedReq],
        held_pages: Mapping[str, Sequence[int]] | None = None,
        full: bool | None = None,
        queues: Iterable[TrackedQueue] | None = None,
        sessions: Iterable[KVHolder] = (),
    ) -> CheckReport:
        """Check everything; ``held_pages`` names external holders of pages. With
        ``queues``, every request must sit in exactly one of them. ``sessions``: the
        session slots holding KV between turns (owners like requests, in no queue)."""
        start = time.perf_counter()
        reqs = list(requests)
        slots = list(sessions)
        owners: list[TrackedReq | KVHolder] = [*reqs, *slots]
        held = dict(held_pages or {})
        full = self.strict if full is None else full
        report = CheckReport()
        self._check_requests(reqs, report)
        malformed = self._check_ladders(owners, report)
        self._check_kv_equation(reqs, slots, held, report)
        self._check_rows(reqs, slots, report)
        self._check_mamba(owners, report)
        if queues is not None:
            _check_queues(reqs, list(queues), report)
        report.violations += self.tree_cache.verify()
        if full:
            locks = [r.kv.lock for r in owners if r.kv.lock is not None]
            locks += self.tree_cache.deferred_locks()
            report.violations += self.tree_cache.lock_path_counts(locks)
            self._walk_pages(owners, held, report)
            self._check_row_contents([r for r in owners if r.rid not in malformed], report)
        report.seconds = time.perf_counter() - start
        self.runs += 1
        self.total_violations += len(report.violations)
        self.total_seconds += report.seconds
        if self.strict and report.violations:
            raise InvariantViolation(report)
        return report

    # -- per request ------------------------------------------------------------------
    def _check_requests(self, reqs: list[TrackedReq], report: CheckReport) -> None:
        """Each request registered once, holding what its state allows."""
        seen: set[str] = set()
        for req in reqs:
            kv, rid = req.kv, req.rid
            if rid in seen:
                report.violations.append(f"request {rid} is registered twice")
            seen.add(rid)
            holdings = (kv.holds_row, kv.holds_kv, kv.holds_lock, kv.holds_mamba)
            for name, must, has in zip(("row", "kv", "lock", "mamba"), LEGAL_HOLDINGS[req.state],
                                       holdings, strict=True):
                if must is not None and must != has:
                    report.violations.append(
                        f"request {rid} in state {req.state.value} "
                        f"{'lacks' if must else 'holds'} {name}"
                    )

    def _check_ladders(self, owners: Sequence[TrackedReq | KVHolder],
                       report: CheckReport) -> set[str]:
        """The length ladder and page list of every owner's record; returns the rids
        whose record is too broken to walk."""
        page_size = self.pools.page_size
        width = self.pools.req_to_token_pool.row_width
        malformed: set[str] = set()
        for req in owners:
            kv, rid = req.kv, req.rid
            who = _who(rid)
            if not 0 <= kv.protected_len <= kv.committed_len <= kv.allocated_len <= width:
                malformed.add(rid)
                report.violations.append(
                    f"{who}: ladder broken: protected={kv.protected_len} "
                    f"committed={kv.committed_len} allocated={kv.allocated_len} width={width}"
                )
            if kv.protected_len % page_size:
                report.violations.append(f"{who}: protected_len {kv.protected_len} "
                                         f"not page aligned")
            if len(kv.page_ids) != num_pages(kv.allocated_len, page_size):
                malformed.add(rid)
                report.violations.append(
                    f"{who}: {len(kv.page_ids)} page ids for allocated_len "
                    f"{kv.allocated_len}"
                )
            if kv.holds_kv and not kv.holds_row:
                report.violations.append(f"{who} holds KV without a row")
            lock_len = kv.lock.prefix_len if kv.lock is not None else 0
            if kv.holds_row and lock_len != kv.protected_len:
                report.violations.append(
                    f"{who}: protected_len {kv.protected_len} != locked prefix {lock_len}"
                )
        return malformed

    # -- pools ------------------------------------------------------------------------
    def _check_kv_equation(self, reqs: list[TrackedReq], slots: list[KVHolder],
                           held: dict[str, Sequence[int]], report: CheckReport) -> None:
        alloc, cache = self.pools.allocator, self.tree_cache
        page_size = alloc.page_size
        uncached = sum(len(r.kv.owned_page_ids(page_size)) for r in reqs) * page_size
        session_held = sum(len(s.kv.owned_page_ids(page_size)) for s in slots) * page_size
        numbers = {
            "available": alloc.available_size(),
            "evictable": cache.evictable_size(),
            "protected": cache.protected_size(),
            "session_held": session_held,
            "pending_release": alloc.pending_release_size(),
            "uncached": uncached,
            "held": sum(len(p) for p in held.values()) * page_size,
        }
        total = sum(numbers.values())
        numbers["total"] = alloc.size
        report.pools["kv_tokens"] = numbers
        _balance("kv tokens", total, alloc.size, report)

    def _check_rows(self, reqs: list[TrackedReq], slots: list[KVHolder],
                    report: CheckReport) -> None:
        held = [(r.rid, r.kv.row) for r in reqs if r.kv.row is not None]
        session = [(s.rid, s.kv.row) for s in slots if s.kv.row is not None]
        _check_slot_pool(self.pools.req_to_token_pool, "rows", "row", held, report, session)

    def _check_mamba(self, reqs: Sequence[TrackedReq | KVHolder], report: CheckReport) -> None:
        pool = self.pools.mamba_pool
        held = [(r.rid, s) for r in reqs for s in r.kv.mamba_slots]
        if pool is None:
            if held:
                report.violations.append("requests hold Mamba slots but there is no Mamba pool")
            return
        _check_slot_pool(pool, "mamba_slots", "Mamba slot", held, report)

    # -- full walk --------------------------------------------------------------------
    def _walk_pages(self, reqs: Sequence[TrackedReq | KVHolder],
                    held: dict[str, Sequence[int]], report: CheckReport) -> None:
        alloc = self.pools.allocator
        page_size = alloc.page_size
        ledger = PageLedger(alloc.num_pages)
        ledger.claim([0], "reserved", RESERVED)
        ledger.claim(alloc.free_page_ids(), "free", FREE)
        for batch, deferred in alloc.deferred_batches().items():
            ledger.claim(deferred, f"pending:{batch}", PENDING)
        ledger.claim(self.tree_cache.cached_page_ids(), "tree", USED)
        for req in reqs:
            name = req.rid if req.rid.startswith("session:") else f"req:{req.rid}"
            ledger.claim(req.kv.owned_page_ids(page_size), name, USED)
        for name, pages in held.items():
            ledger.claim(pages, f"held:{name}", USED)
        for page, first, second in ledger.conflicts[:20]:
            report.violations.append(f"page {page} owned by both {first} and {second}")
        if len(ledger.conflicts) > 20:
            report.violations.append(f"... {len(ledger.conflicts) - 20} more page conflicts")
        for page, holder in ledger.out_of_range[:20]:
            report.violations.append(f"{holder} holds page id {page}, outside the pool")
        leaked = ledger.unowned()
        if leaked:
            report.violations.append(f"{len(leaked)} pages have no owner (leaked): {leaked[:20]}")
        states = alloc.state_bytes()
        if states != ledger.expected_states:
            for page in range(1, alloc.num_pages + 1):
                owner = ledger.owner(page)
                if owner is not None and states[page] != ledger.expected_states[page]:
                    report.violations.append(
                        f"page {page} owned by {owner} but the allocator marks it "
                        f"{alloc.page_state(page)}"
                    )

    def _check_row_contents(self, reqs: Sequence[TrackedReq | KVHolder],
                            report: CheckReport) -> None:
        """Every live row entry below allocated_len points at the page the request owns
        or has locked, at the right offset."""
        pool, page_size = self.pools.req_to_token_pool, self.pools.page_size
        for req in reqs:
            kv = req.kv
            if kv.row is None or kv.allocated_len == 0:
                continue
            if kv.lock is not None:
                locked = self.tree_cache.lock_page_ids(kv.lock)
                if kv.page_ids[: len(locked)] != locked:
                    report.violations.append(
                        f"{_who(req.rid)}: prefix pages differ from the pages its lock protects"
                    )
            want = slot_ids(kv.page_ids, page_size, 0, kv.allocated_len)
            have = pool.req_to_token[kv.row, : kv.allocated_len].cpu()
            if not torch.equal(want, have):
                bad = int((want != have).nonzero()[0, 0])
                report.violations.append(
                    f"{_who(req.rid)}: row {kv.row} position {bad} holds slot "
                    f"{int(have[bad])}, its pages say {int(want[bad])}"
                )


def _check_queues(reqs: list[TrackedReq], queues: list[TrackedQueue],
                  report: CheckReport) -> None:
    """Each live request in exactly one queue, in a state that queue allows; no queue
    holds a request that is not live."""
    live = {id(r): r for r in reqs}
    homes: dict[int, list[str]] = {id(r): [] for r in reqs}
    sizes: dict[str, int] = {}
    for queue in queues:
        count = 0
        for req in queue:
            count += 1
            if id(req) not in live:
                report.violations.append(f"queue {queue.name} holds request {req.rid}, "
                                         f"which is not live")
                continue
            homes[id(req)].append(queue.name)
            if req.state not in queue.states:
                report.violations.append(f"request {req.rid} in queue {queue.name} is in "
                                         f"state {req.state.value}")
        sizes[queue.name] = count
    report.pools["queues"] = sizes
    for key, names in homes.items():
        if len(names) != 1:
            where = "no queue" if not names else "queues " + ", ".join(names)
            report.violations.append(f"request {live[key].rid} is in {where}")


class _SlotPool(Protocol):
    size: int

    def available_size(self) -> int: ...

    def is_free(self, slot: int, /) -> bool: ...


def _check_slot_pool(pool: _SlotPool, key: str, noun: str, held: list[tuple[str, int]],
                     report: CheckReport, session: Sequence[tuple[str, int]] = ()) -> None:
    """free + session + live == size for a pool of numbered slots (rows, Mamba slots),
    and every held slot allocated and held once (``session``: held by session slots)."""
    numbers = {"free": pool.available_size(), "session": len(session), "live": len(held),
               "size": pool.size}
    report.pools[key] = numbers
    _balance(key.replace("_", " "), numbers["free"] + numbers["session"] + numbers["live"],
             pool.size, report)
    ids = [i for _, i in [*held, *session]]
    if len(set(ids)) != len(ids):
        report.violations.append(f"a {noun} is held by two owners")
    for rid, i in [*held, *session]:
        if not 0 < i <= pool.size or pool.is_free(i):
            report.violations.append(f"{_who(rid)} holds {noun} {i}, which is free")


def _who(rid: str) -> str:
    """How a violation names an owner: a request, or a session slot (``session:<id>``)."""
    return rid if rid.startswith("session:") else f"request {rid}"


def _balance(name: str, counted: int, total: int, report: CheckReport) -> None:
    if counted < total:
        report.violations.append(f"{name}: {total - counted} missing from the sum (leak): "
                                 f"{counted} counted of {total}")
    elif counted > total:
        report.violations.append(f"{name}: {counted - total} over the total (double free or "
                                 f"double count): {counted} counted of {total}")

