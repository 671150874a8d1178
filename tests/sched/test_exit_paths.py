"""Every exit path x page size {1, 16} x chunked prefill on/off, checker strict every step.

After each: run_until_idle() leaves every pool at its total and no trace of the
request in any queue or component.
"""

import pytest

from kvserve.sched import ReqState
from kvserve.sched.req import OOM_MESSAGE, FinishKind, RequestRejected
from kvserve.sched.scheduler import AbortStatus
from kvserve.testing.scripted import ScriptedEngine

PROMPT = list(range(1000, 1040))  # 40 tokens: 3 chunks of 16 at page 16


def make(page_size, chunked, **kw):
    chunk = (8 if page_size == 1 else 16) if chunked else None
    kw.setdefault("num_tokens", 64 * 16)
    return ScriptedEngine(page_size=page_size, chunked_prefill_size=chunk, context_len=256, **kw)


def gone(engine, handle):
    """No trace of the request anywhere once it finished."""
    sched = engine.scheduler
    assert handle.state is ReqState.FINISHED
    assert handle.rid not in sched.reqs
    assert handle.req not in sched.waiting and handle.req not in sched.running
    assert sched.chunked_req is not handle.req
    assert not handle.req.kv.holds_anything
    assert handle.kv_pages == 0 and handle.owned_pages == 0 and handle.lock_refs == 0
    engine.assert_idle_and_full()


CASES = [(p, c) for p in (1, 16) for c in (False, True)]


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_finish_in_first_prefill_by_length(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT, max_new_tokens=1)
    e.run_until_idle()
    assert h.output_ids == e.reference(PROMPT, 1)
    assert h.finished_reason.kind is FinishKind.LENGTH
    gone(e, h)
    assert e.tree_cache.evictable_size() == (40 // page_size) * page_size


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_finish_in_first_prefill_by_stop_token(page_size, chunked):
    e = make(page_size, chunked)
    first = e.reference(PROMPT, 1)[0]
    h = e.add(PROMPT, max_new_tokens=10, stop_token_ids=(first,))
    e.run_until_idle()
    assert h.output_ids == [first]
    assert h.finished_reason.kind is FinishKind.STOP and h.finished_reason.matched_token == first
    gone(e, h)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_finish_in_decode(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT, max_new_tokens=7)
    e.run_until_idle()
    assert h.output_ids == e.reference(PROMPT, 7)
    gone(e, h)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_abort_while_waiting(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT)
    assert e.abort(h.rid) is AbortStatus.ABORTED
    assert h.finished_reason.kind is FinishKind.ABORT
    outputs = e.run_until_idle()  # the abort reply, and nothing else
    assert [(o.rid, o.new_token_ids, o.finished_reason.kind) for o in outputs] == [
        (h.rid, [], FinishKind.ABORT)]
    gone(e, h)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_abort_after_admission_before_extend(page_size, chunked):
    e = make(page_size, chunked)
    warm = e.add(PROMPT, max_new_tokens=1)
    e.run_until_idle()
    h = e.add(PROMPT + [5, 6, 7])
    seen = []

    def on_admitted(reqs):
        assert reqs == [h.req] and h.state is ReqState.ADMITTED
        assert h.req.kv.holds_lock and not h.req.kv.holds_row  # locked the cached prefix
        seen.append(e.abort(h.rid))

    e.scheduler.on_admitted = on_admitted
    e.run_until_idle()
    assert seen == [AbortStatus.PENDING]
    assert h.finished_reason.kind is FinishKind.ABORT and h.output_ids == []
    gone(e, h)
    gone(e, warm)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_abort_after_allocation_before_forward(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT)
    e.scheduler.on_launch = lambda batch: e.abort(h.rid)
    e.run_until_idle()
    assert h.finished_reason.kind is FinishKind.ABORT and h.output_ids == []
    gone(e, h)


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_of_chunked_request_after_chunk_1_of_3(page_size):
    chunk = 16
    e = ScriptedEngine(page_size=page_size, chunked_prefill_size=chunk, num_tokens=1024,
                       context_len=256)
    h = e.add(PROMPT)  # 40 tokens: chunks of 16, 16, 8
    e.step()
    assert h.state is ReqState.CHUNKED and h.req.kv.committed_len == 16
    assert e.scheduler.chunked_req is h.req
    assert e.abort(h.rid) is AbortStatus.PENDING
    assert h.state is ReqState.CHUNKED  # never released mid-iteration
    e.step()  # process_pending_chunked_abort releases it first thing
    assert h.finished_reason.kind is FinishKind.ABORT
    gone(e, h)
    assert e.tree_cache.evictable_size() == 16  # chunk 1 was cached


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_abort_in_decode(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT, max_new_tokens=50)
    while len(h.output_ids) < 3:
        e.step()
    assert e.abort(h.rid) is AbortStatus.PENDING
    e.step()  # finalized when this step's results are processed
    assert h.finished_reason.kind is FinishKind.ABORT
    assert h.output_ids == e.reference(PROMPT, len(h.output_ids))
    gone(e, h)
    assert e.abort(h.rid) is AbortStatus.NOT_FOUND
    assert e.abort("never-seen") is AbortStatus.NOT_FOUND


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_retraction_then_completion(page_size, chunked):
    e = make(page_size, chunked, num_tokens=160)
    a = e.add(PROMPT, max_new_tokens=20)
    b = e.add([7] + PROMPT[1:], max_new_tokens=20)
    while len(b.output_ids) < 3:
        e.step()
    assert a.state is b.state is ReqState.RUNNING
    e.exhaust_pool(10_000)  # memory pressure: soon no room for the next decode step
    for _ in range(16):
        e.step()
        if e.scheduler.stats.retractions:
            break
    assert e.scheduler.stats.retractions == 1
    retracted = [h for h in (a, b) if h.state is ReqState.RETRACTED]
    assert len(retracted) == 1 and not retracted[0].req.kv.holds_anything
    assert e.scheduler.ratio.value == min(1.0, (len(a.output_ids) + 20 * 1) / (20 + 1))
    e.restore_pool()
    e.run_until_idle()
    assert a.output_ids == e.reference(PROMPT, 20)
    assert b.output_ids == e.reference([7] + PROMPT[1:], 20)
    gone(e, a)
    gone(e, b)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_retraction_of_the_last_request_aborts_with_message(page_size, chunked):
    e = make(page_size, chunked, num_tokens=64 if page_size == 16 else 48)
    h = e.add(PROMPT, max_new_tokens=100)
    e.run_until_idle()
    assert h.finished_reason.kind is FinishKind.ABORT
    assert h.finished_reason.message == OOM_MESSAGE
    assert h.output_ids == e.reference(PROMPT, len(h.output_ids))
    gone(e, h)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_max_new_tokens_zero_prefills_only(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT, max_new_tokens=0)
    outs = e.run_until_idle()
    assert h.output_ids == [] and h.finished_reason.kind is FinishKind.LENGTH
    assert [o.new_token_ids for o in outs if o.rid == h.rid] == [[]]
    gone(e, h)
    assert e.tree_cache.evictable_size() == (40 // page_size) * page_size


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_same_prompt_twice_second_fully_cached(page_size, chunked):
    e = make(page_size, chunked)
    a = e.add(PROMPT, max_new_tokens=3)
    e.run_until_idle()
    b = e.add(PROMPT, max_new_tokens=3)
    e.run_until_idle()
    assert b.req.cached_tokens == (39 // page_size) * page_size  # capped: one token computed
    assert a.output_ids == b.output_ids == e.reference(PROMPT, 3)
    gone(e, b)


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_rejected_requests_hold_nothing(page_size, chunked):
    e = make(page_size, chunked)
    with pytest.raises(RequestRejected, match="context limit"):
        e.add(list(range(1, 257)))
    with pytest.raises(RequestRejected, match="empty prompt"):
        e.add([])
    with pytest.raises(RequestRejected, match="max_new_tokens"):
        e.add(PROMPT, max_new_tokens=-1)
    with pytest.raises(RequestRejected, match="token ids"):
        e.add([1, -5])
    h = e.add(PROMPT, rid="dup", max_new_tokens=2)
    with pytest.raises(RequestRejected, match="duplicate request id 'dup'"):
        e.add(PROMPT, rid="dup")
    assert list(e.scheduler.reqs) == ["dup"]
    e.run_until_idle()
    gone(e, h)


def test_prompt_larger_than_the_pool_is_rejected():
    e = ScriptedEngine(page_size=16, num_tokens=64, context_len=512)
    with pytest.raises(RequestRejected, match="exceeds the KV pool of 64 tokens"):
        e.add(list(range(1, 100)))
    e.assert_idle_and_full()


@pytest.mark.parametrize(("page_size", "chunked"), CASES)
def test_allocation_missing_after_admission_goes_back_to_waiting(page_size, chunked):
    e = make(page_size, chunked)
    h = e.add(PROMPT, max_new_tokens=3)
    e.scheduler.on_admitted = lambda reqs: e.exhaust_pool(10**9)  # memory stolen meanwhile
    e.step()
    assert h.state is ReqState.RETRACTED and not h.req.kv.holds_anything
    assert h.req in e.scheduler.waiting
    e.scheduler.on_admitted = None
    e.restore_pool()
    e.run_until_idle()
    assert h.output_ids == e.reference(PROMPT, 3)
    gone(e, h)
