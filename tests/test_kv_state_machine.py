"""Model-based fuzzing of the KV resource layer: random event sequences, checker strict
after every step, everything released and every pool at its total at the end."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvserve.kv import release_kv_cache
from kvserve.sched import ReqState
from kvserve.testing.kv_harness import KVHarness

SYSTEM_PROMPTS = [[], [7] * 5, [7] * 5 + [8] * 12, [9, 1, 9, 1] * 9]
MIN_STEPS = 2000


class KVLayerMachine(RuleBasedStateMachine):
    page_size = 1
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        self.h = KVHarness(page_size=p, num_tokens=24 * p if p > 1 else 160, num_rows=5,
                           context_len=96, spec_reserve=8, mamba_slots=6)
        self.batch = 0
        self.holds = 0
        self.deferred: list[int] = []

    # -- helpers --------------------------------------------------------------------
    def _pick(self, index, *states):
        reqs = [r for r in self.h.live.values() if r.state in states]
        return reqs[index % len(reqs)] if reqs else None

    def _has(self, *states) -> bool:
        return any(r.state in states for r in self.h.live.values())

    # -- arrivals and admission -------------------------------------------------------
    @precondition(lambda self: len(self.h.live) < 6)
    @rule(system=st.sampled_from(range(len(SYSTEM_PROMPTS))),
          suffix=st.lists(st.integers(1, 3), min_size=1, max_size=20),
          namespaced=st.booleans())
    def arrive(self, system, suffix, namespaced):
        self.h.new(SYSTEM_PROMPTS[system] + suffix, extra_key="ns" if namespaced else None)

    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 99), mamba=st.integers(0, 2),
          chunk=st.sampled_from([None, None, 1, 3, 16, 17]),
          spec_accepted=st.sampled_from([0, 0, 0, 1, 2, 3, 8]), repeat=st.integers(1, 8))
    def advance(self, index, mamba, chunk, spec_accepted, repeat):
        """Move one request through its next stages: admit, extend chunks, decode steps."""
        req = self._pick(index, *ReqState)
        for _ in range(repeat):
            self._advance(req, mamba, chunk, spec_accepted)
            self.h.check()

    def _advance(self, req, mamba, chunk, spec_accepted):
        kv = req.kv
        if req.state is ReqState.WAITING:
            mamba = min(mamba, self.h.pools.mamba_pool.available_size())
            prefix = self.h.admit(req, mamba=mamba)
            assert prefix % self.page_size == 0 and prefix < len(req.prompt_ids)
        elif req.state in (ReqState.ADMITTED, ReqState.CHUNKED):
            before = (kv.committed_len, kv.allocated_len, kv.row)
            if not self.h.extend(req, chunk) and kv.holds_row:
                assert (kv.committed_len, kv.allocated_len, kv.row) == before
        elif spec_accepted == 0:
            allocated = kv.allocated_len
            if not self.h.decode(req):
                assert kv.allocated_len == allocated
        else:
            allocated = kv.allocated_len
            if self.h.spec_decode(req, reserve=8, accepted=spec_accepted):
                assert kv.allocated_len >= allocated
                assert kv.allocated_len % self.page_size == 0 or kv.allocated_len == allocated

    # -- exits ------------------------------------------------------------------------
    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 99), insert=st.booleans(), deferred=st.booleans(),
          retract=st.booleans(), running=st.booleans())
    def exit(self, index, insert, deferred, retract, running):
        """Finish (insert) or abort (no insert) a live request, or retract a running one."""
        states = (ReqState.RUNNING, ReqState.CHUNKED) if running else tuple(ReqState)
        req = self._pick(index, *states) or self._pick(index, *ReqState)
        if retract and req.state is not ReqState.WAITING:
            self.h.retract(req)
            req.output_ids.clear()
            return
        if deferred:  # an in-flight batch may still read these pages
            self.batch += 1
            with self.h.cache.deferring(self.batch):
                self.h.finish(req, insert=insert)
            self.deferred.append(self.batch)
        else:
            self.h.finish(req, insert=insert)
        release_kv_cache(req, self.h.cache, insert=insert)  # a second release: no-op
        assert not req.kv.holds_anything

    @precondition(lambda self: self.deferred)
    @rule()
    def batch_results_processed(self):
        self.h.cache.release_deferred(self.deferred.pop(0))

    # -- memory pressure ----------------------------------------------------------------
    @precondition(lambda self: self.h.cache.evictable_size())
    @rule(num_tokens=st.integers(1, 64))
    def evict(self, num_tokens):
        evictable = self.h.cache.evictable_size()
        freed = self.h.cache.evict(num_tokens)
        assert freed == evictable - self.h.cache.evictable_size()
        assert freed >= min(num_tokens, evictable) - self.page_size + 1 or freed == evictable

    @precondition(lambda self: len(self.h.held_pages) < 2)
    @rule(num_pages=st.integers(1, 6))
    def hold_pages(self, num_pages):
        pages = self.h.pools.allocator.alloc_pages(num_pages)
        if pages is not None:
            self.holds += 1
            self.h.held_pages[f"hold{self.holds}"] = pages

    @precondition(lambda self: self.h.held_pages)
    @rule()
    def release_held(self):
        name = next(iter(self.h.held_pages))
        self.h.pools.allocator.free(self.h.held_pages.pop(name))

    @invariant()
    def checker_is_clean(self):
        type(self).steps += 1
        self.h.check()
        assert self.h.cache.evictable_size() >= 0
        assert 0 not in self.h.cache.cached_page_ids()

    def teardown(self):
        for req in list(self.h.live.values()):
            self.h.finish(req, insert=False)
        for batch in self.deferred:
            self.h.cache.release_deferred(batch)
        for pages in self.h.held_pages.values():
            self.h.pools.allocator.free(pages)
        self.h.held_pages.clear()
        self.h.assert_idle_and_full()
        self.h.cache.reset()
        assert self.h.pools.allocator.available_size() == self.h.pools.allocator.size


class PagedKVLayerMachine(KVLayerMachine):
    page_size = 16


def _run(machine):
    machine.steps = 0
    run_state_machine_as_test(
        machine, settings=settings(settings(), stateful_step_count=40)
    )
    assert machine.steps >= MIN_STEPS, f"only {machine.steps} steps executed"


def test_kv_layer_random_events_page_1():
    _run(KVLayerMachine)


def test_kv_layer_random_events_page_16():
    _run(PagedKVLayerMachine)
