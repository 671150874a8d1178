"""Model-based fuzzing of the whole scheduler with the scripted runtime: arrivals with
shared prefixes, random aborts at random steps, random speculative accept counts and a
tiny pool that forces retraction. Checker strict after every step; with no more
arrivals everything finishes within a bounded number of steps, pools back at totals."""

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvserve.sched import ReqState
from kvserve.sched.req import OOM_MESSAGE, FinishKind
from kvserve.sched.scheduler import SpecConfig
from kvserve.testing.scripted import ScriptedEngine

SYSTEMS = [[], list(range(500, 520)), list(range(500, 510)) + [9] * 14, [3, 1, 4, 1, 5] * 6]
MIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    page_size = 1
    num_tokens = 160
    chunk: int | None = 8
    spec: SpecConfig | None = None
    radix = True
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.accepts: deque[int] = deque()
        self.e = ScriptedEngine(
            page_size=self.page_size, num_tokens=self.num_tokens, num_rows=6, context_len=96,
            chunked_prefill_size=self.chunk, speculative=self.spec,
            disable_radix_cache=not self.radix,
            accept_counts=lambda i, step: self.accepts.popleft() if self.accepts else 99,
        )
        self.handles = []

    @precondition(lambda self: len(self.e.scheduler.reqs) < 8)
    @rule(system=st.sampled_from(range(len(SYSTEMS))),
          suffix=st.lists(st.integers(1, 4), min_size=1, max_size=24),
          max_new=st.sampled_from([0, 1, 2, 5, 12, 30]), stop=st.booleans())
    def arrive(self, system, suffix, max_new, stop):
        prompt = SYSTEMS[system] + suffix
        stop_ids = (self.e.reference(prompt, 3)[-1],) if stop and max_new else ()
        self.handles.append(self.e.add(prompt, max_new_tokens=max_new, stop_token_ids=stop_ids))

    @rule(count=st.integers(1, 6), squeeze=st.sampled_from([False, False, True]))
    def run_steps(self, count, squeeze):
        """Run steps; ``squeeze`` first empties the cache and takes every free page, so a
        decode step that needs a page must retract (or abort the last request)."""
        if squeeze:
            self.e.tree_cache.evict(10**9)
            self.e.exhaust_pool(10**9)
        for _ in range(count):
            self.e.step()  # strict checker inside
            type(self).steps += 1
        if squeeze:
            self.e.restore_pool()

    @precondition(lambda self: self.e.scheduler.reqs)
    @rule(index=st.integers(0, 99))
    def abort(self, index):
        live = list(self.e.scheduler.reqs)
        self.e.abort(live[index % len(live)])

    @rule(counts=st.lists(st.integers(1, 8), min_size=1, max_size=6))
    def speculative_accepts(self, counts):
        self.accepts.extend(counts)

    @precondition(lambda self: "exhausted" not in self.e.scheduler.held_pages)
    @rule(num_tokens=st.integers(1, 200))
    def memory_pressure(self, num_tokens):
        self.e.exhaust_pool(num_tokens)

    @precondition(lambda self: "exhausted" in self.e.scheduler.held_pages)
    @rule()
    def pressure_gone(self):
        self.e.restore_pool()

    def teardown(self):
        e = self.e
        e.restore_pool()
        bound = 40 * (len(e.scheduler.reqs) + 1) * 8
        e.run_until_idle(max_steps=bound)
        type(self).steps += e.scheduler.stats.steps
        e.assert_idle_and_full()
        for h in self.handles:
            assert h.state is ReqState.FINISHED
            reason = h.finished_reason
            expected = e.reference(h.req.prompt_ids, len(h.output_ids))
            assert h.output_ids == expected, h.rid
            if reason.kind is FinishKind.STOP:
                assert h.output_ids[-1] in h.req.sampling.stop_token_ids
            elif reason.kind is FinishKind.LENGTH:
                n = len(h.output_ids)
                assert n == h.req.sampling.max_new_tokens or h.req.seq_len >= 96
            else:
                assert reason.message in ("aborted by request", OOM_MESSAGE)


class PagedSpeculativeMachine(SchedulerMachine):
    page_size = 16
    num_tokens = 16 * 12
    chunk = 16
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


class NoRadixMachine(SchedulerMachine):
    page_size = 4
    num_tokens = 128
    chunk = None
    radix = False


def _run(machine):
    machine.steps = 0
    run_state_machine_as_test(machine, settings=settings(settings(), stateful_step_count=30))
    assert machine.steps >= MIN_STEPS, f"only {machine.steps} scheduler steps executed"


def test_scheduler_random_events_page_1_chunked():
    _run(SchedulerMachine)


def test_scheduler_random_events_page_16_speculative():
    _run(PagedSpeculativeMachine)


def test_scheduler_random_events_page_4_no_radix():
    _run(NoRadixMachine)
