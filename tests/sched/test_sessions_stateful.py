"""Model-based fuzzing of streaming sessions with the scripted runtime: sessions opened
and closed, turns continuing a random completed turn (sometimes cut by an offset, or
resending the whole history), replace, plain traffic sharing their prefixes, random
aborts, steps under a squeezed pool. Checker strict after every step (the scheduler's);
every request's tokens equal the reference for the context the test built itself, each
session's completed turns are the ones the test saw complete; at the end every session
is closed and every pool is back at its total."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvserve.sched import ReqState
from kvserve.sched.req import OOM_MESSAGE, FinishKind, RequestRejected
from kvserve.sched.scheduler import SpecConfig
from kvserve.sched.session import SessionError
from kvserve.testing.scripted import ScriptedEngine

SYSTEMS = [[], list(range(500, 520)), [3, 1, 4, 1, 5] * 5]
CONTEXT_LEN = 192
ABORT_MESSAGES = ("aborted by request", OOM_MESSAGE, "replaced by a newer turn of its session")
MIN_STEPS = 600
TIMEOUT = 50.0


class SessionMachine(RuleBasedStateMachine):
    page_size = 1
    num_tokens = 200
    chunk: int | None = 8
    spec: SpecConfig | None = None
    radix = True
    num_rows = 5
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.e = ScriptedEngine(
            page_size=self.page_size, num_tokens=self.num_tokens, num_rows=self.num_rows,
            context_len=CONTEXT_LEN, chunked_prefill_size=self.chunk, speculative=self.spec,
            disable_radix_cache=not self.radix, session_timeout=TIMEOUT,
            clock=lambda: self.now,
        )
        self.open: list[str] = []  # sessions the test may still send turns to
        self.completed: dict[str, dict[str, list[int]]] = {}  # sid -> rid -> prompt+output
        self.history: dict[str, list[list[int]]] = {}  # every context completed (replace too)
        self.handles: list = []  # unfinished: (handle, context, sid or None)
        self.rids = 0

    # -- helpers --------------------------------------------------------------------
    def _rid(self) -> str:
        self.rids += 1
        return f"r{self.rids}"

    def _session(self, index):
        return self.open[index % len(self.open)]

    def _verify_finished(self) -> None:
        """Finished requests: reference tokens; completed turns recorded in order."""
        pending = []
        for h, context, sid in self.handles:
            if h.state is not ReqState.FINISHED:
                pending.append((h, context, sid))
                continue
            assert h.req.prompt_ids == context
            assert h.output_ids == self.e.reference(context, len(h.output_ids)), h.rid
            reason = h.finished_reason
            if reason.kind is FinishKind.ABORT:
                assert reason.message in ABORT_MESSAGES, reason
                continue
            max_new = h.req.sampling.max_new_tokens
            assert len(h.output_ids) == max_new or len(context) + len(h.output_ids) >= \
                CONTEXT_LEN
            if sid in self.completed:  # not closed since
                self.completed[sid][h.rid] = context + h.output_ids
                self.history[sid].append(context + h.output_ids)
        self.handles = pending
        sessions = self.e.scheduler.sessions.sessions
        page_size = self.page_size
        for sid in self.open:
            assert list(sessions[sid].turns) == list(self.completed[sid]), sid
            slot = sessions[sid].slot
            kv = slot.kv
            if slot.is_holding_kv:  # a completed turn's KV, all but its last token, trimmed
                assert kv.allocated_len == kv.committed_len == len(slot.tokens)
                assert len(kv.page_ids) == -(-kv.committed_len // page_size)
                assert any(ctx[:-1] == slot.tokens for ctx in self.history[sid])

    # -- sessions -------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < 3)
    @rule()
    def open_session(self):
        sid = self.e.open_session("s-" + self._rid())
        self.open.append(sid)
        self.completed[sid] = {}
        self.history[sid] = []

    @precondition(lambda self: self.open)
    @rule(index=st.integers(0, 99), base=st.sampled_from([None, -1, -1, -1, -2, 0]),
          offset=st.sampled_from([None, None, None, None, None, -1, 5, -4, 200]),
          system=st.sampled_from(range(len(SYSTEMS))),
          new=st.lists(st.integers(1, 4), min_size=1, max_size=12),
          resend=st.booleans(), replace=st.sampled_from([False, False, True]),
          max_new=st.sampled_from([1, 3, 8, 16]), then=st.sampled_from([0, 2, 200, 200]))
    def session_turn(self, index, base, offset, system, new, resend, replace, max_new, then):
        """A turn; ``then`` steps follow (200: until idle, so later turns find it done)."""
        sid = self._session(index)
        session = self.e.scheduler.sessions.sessions[sid]
        done = self.completed[sid]
        params: dict[str, object] = {"id": sid}
        bad_offset = False
        if replace:
            params["replace"] = True
        if base is None or not done:  # rid None: the new tokens are the whole context
            prefix = list(done.values())[-1] if resend and done else SYSTEMS[system]
            new = prefix + new
            context = list(new)
        else:
            rid = list(done)[max(base, -len(done))]
            params["rid"] = rid
            history = done[rid]
            if offset is not None:
                params["offset"] = offset
            context = (history[:offset] if offset else history) + new
            bad_offset = offset is not None and not -len(history) <= offset <= len(history)
        # a turn whose abort is pending is already leaving: the new turn supersedes it
        active = session.active
        in_flight = active is not None and active.to_finish is None and not replace
        too_long = len(context) > CONTEXT_LEN - 1
        refused = in_flight or bad_offset or too_long
        before = (session.active, dict(session.turns), len(self.e.scheduler.reqs),
                  session.slot.kv.allocated_len, list(session.slot.tokens))
        try:
            h = self.e.add(new, rid=self._rid(), session_params=params, max_new_tokens=max_new)
        except RequestRejected as err:  # SessionError is one
            assert refused, err
            assert isinstance(err, SessionError) == (in_flight or bad_offset), err
            assert before == (session.active, dict(session.turns), len(self.e.scheduler.reqs),
                              session.slot.kv.allocated_len, list(session.slot.tokens))
            return
        assert not refused
        if replace and "rid" in params:  # later turns are forgotten
            keep = list(done).index(params["rid"]) + 1
            self.completed[sid] = dict(list(done.items())[:keep])
        self.handles.append((h, context, sid))
        self._steps(then)

    @precondition(lambda self: self.open)
    @rule(index=st.integers(0, 99), really=st.integers(0, 2))
    def close_session(self, index, really):
        if really:  # closing less often than the other rules, so conversations grow
            return
        sid = self._session(index)
        assert self.e.close_session(sid)
        self.open.remove(sid)
        del self.completed[sid], self.history[sid]

    # -- plain traffic, aborts, steps -------------------------------------------------
    @precondition(lambda self: len(self.e.scheduler.reqs) < 8)
    @rule(system=st.sampled_from(range(len(SYSTEMS))), share=st.booleans(),
          suffix=st.lists(st.integers(1, 4), min_size=1, max_size=20),
          max_new=st.sampled_from([1, 5, 20]), really=st.integers(0, 1))
    def plain(self, system, share, suffix, max_new, really):
        if not really:  # less often than session turns
            return
        histories = [c for done in self.completed.values() for c in done.values()]
        prompt = (histories[-1][:40] if share and histories else SYSTEMS[system]) + suffix
        h = self.e.add(prompt, rid=self._rid(), max_new_tokens=max_new)
        self.handles.append((h, prompt, None))

    @precondition(lambda self: self.e.scheduler.reqs)
    @rule(index=st.integers(0, 99), really=st.integers(0, 1))
    def abort(self, index, really):
        if not really:
            return
        live = list(self.e.scheduler.reqs)
        self.e.abort(live[index % len(live)])

    @rule(count=st.integers(1, 6), squeeze=st.sampled_from([False, False, True]))
    def run_steps(self, count, squeeze):
        """``squeeze`` empties the cache and takes every free page first, so the step
        must reclaim idle sessions, retract or abort the last request."""
        self._steps(count, squeeze)

    def _steps(self, count, squeeze=False):
        for _ in range(count):
            if self.e.scheduler.is_idle:
                return
            if squeeze:
                self.e.tree_cache.evict(10**9)
                self.e.exhaust_pool(10**9)
            self.e.step()
            if squeeze:
                self.e.restore_pool()
            type(self).steps += 1
            self._verify_finished()

    @rule(seconds=st.sampled_from([1.0, 20.0, 60.0]))
    def time_passes(self, seconds):
        """Sessions idle (no turn in flight) longer than the timeout are closed."""
        self.now += seconds
        sessions = self.e.scheduler.sessions.sessions
        idle = {sid for sid in self.open if sessions[sid].active is None
                and sessions[sid].last_used < self.now - TIMEOUT}
        assert set(self.e.scheduler.sessions.expire()) == idle
        for sid in idle:
            self.open.remove(sid)
            del self.completed[sid], self.history[sid]

    @rule(num_tokens=st.integers(1, 200))
    def memory_pressure(self, num_tokens):
        """Take free pages away until the next call gives them back."""
        if "exhausted" in self.e.scheduler.held_pages:
            self.e.restore_pool()
        else:
            self.e.exhaust_pool(num_tokens)

    def teardown(self):
        e = self.e
        e.restore_pool()
        for sid in self.open:
            assert e.close_session(sid)
        self.open.clear()
        e.run_until_idle(max_steps=2000)
        type(self).steps += e.scheduler.stats.steps
        self._verify_finished()
        assert not self.handles
        assert e.scheduler.sessions.sessions == {}
        e.assert_idle_and_full()


class PagedSpeculativeSessionMachine(SessionMachine):
    page_size = 4
    num_tokens = 4 * 60
    chunk = 16
    spec = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)


class NoRadixSessionMachine(SessionMachine):
    page_size = 4
    num_tokens = 4 * 50
    chunk = None
    radix = False


class FewRowsSessionMachine(SessionMachine):
    """Fewer rows than sessions: idle slots give their rows back to new requests."""

    page_size = 2
    num_rows = 2
    chunk = None


def _run(machine):
    machine.steps = 0
    run_state_machine_as_test(
        machine, settings=settings(settings(), max_examples=100, stateful_step_count=50))
    assert machine.steps >= MIN_STEPS, f"only {machine.steps} scheduler steps executed"


def test_sessions_random_events_page_1_chunked():
    _run(SessionMachine)


def test_sessions_random_events_page_4_speculative():
    _run(PagedSpeculativeSessionMachine)


def test_sessions_random_events_page_4_no_radix():
    _run(NoRadixSessionMachine)


def test_sessions_random_events_two_rows():
    _run(FewRowsSessionMachine)
