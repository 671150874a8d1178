"""Regression tests for scheduler bugs a breaker session found (one per finding)."""

import threading
import time

from kvserve.sched import ReqState
from kvserve.sched.req import FinishKind
from kvserve.testing.scripted import ScriptedEngine


def test_abort_of_a_waiting_request_between_steps_reaches_the_next_outputs():
    e = ScriptedEngine(page_size=1, num_tokens=256, max_running_requests=1)
    e.add([1, 2, 3], max_new_tokens=3)
    b = e.add([4, 5, 6], max_new_tokens=3)
    previous = e.step()
    snapshot = list(previous)
    e.abort(b.rid)
    assert previous == snapshot  # an earlier step's result is never changed afterwards
    outputs = e.step()
    mine = [o for o in outputs if o.rid == b.rid]
    assert len(mine) == 1 and mine[0].finished_reason.kind is FinishKind.ABORT
    e.run_until_idle()
    e.assert_idle_and_full()


def test_running_reservation_sums_fractions_before_rounding():
    # 40 running requests with one token left each reserve 40 * 0.7 = 28 tokens, not 0.
    e = ScriptedEngine(page_size=1, num_tokens=170, num_rows=64, context_len=64)
    for i in range(40):
        e.add([1000 + 2 * i, 1001 + 2 * i], max_new_tokens=2)
    e.step()
    assert e.pools.allocator.available_size() == 90
    x = e.add(list(range(5000, 5055)), max_new_tokens=20)  # 55 + 20 + 1 = 76 > 90 - 28
    e.step()
    assert x.state is ReqState.WAITING
    e.run_until_idle()
    assert e.scheduler.stats.retractions == 0
    e.assert_idle_and_full()


def test_reservation_uses_the_output_the_context_allows():
    e = ScriptedEngine(page_size=1, num_tokens=4096, context_len=64)
    e.add(list(range(100, 110)), max_new_tokens=40)
    e.step()
    b = e.add(list(range(200, 210)), max_new_tokens=10**6)  # at most 54 tokens fit
    c = e.add(list(range(300, 310)), max_new_tokens=5)
    assert b.req.max_output_len == 54
    e.step()
    assert b.state is ReqState.RUNNING and c.state is ReqState.RUNNING
    e.run_until_idle()
    assert len(b.output_ids) == 54
    e.assert_idle_and_full()


def test_retraction_evicts_what_the_victim_handed_to_the_cache():
    e = ScriptedEngine(page_size=1, num_tokens=4096, context_len=512)
    a = e.add(list(range(100, 120)), max_new_tokens=50)
    b = e.add(list(range(200, 220)), max_new_tokens=50)
    e.step()  # both prefilled; their prompts are in the tree, locked
    e.exhaust_pool(10**9)  # every free page taken
    e.step()  # decode retracts one; its prompt becomes evictable and must be used
    assert e.scheduler.stats.retractions == 1
    assert a.finished_reason is None or a.finished_reason.kind is not FinishKind.ABORT
    e.restore_pool()
    e.run_until_idle()
    assert a.finished_reason.kind is FinishKind.LENGTH and len(a.output_ids) == 50
    assert b.finished_reason.kind is FinishKind.LENGTH and len(b.output_ids) == 50
    e.assert_idle_and_full()


def test_engine_abort_of_a_queued_request_returns(tmp_path):
    from kvserve import Engine
    from kvserve.model.init import init_model

    ckpt = init_model(tmp_path / "m", "tiny-qwen2")
    with Engine(model_path=ckpt, page_size=4, max_running_requests=1,
                strict_checks=True) as engine:
        results = {}
        long = threading.Thread(target=lambda: results.setdefault("long", engine.generate(
            input_ids=[1, 2, 3], rid="long",
            sampling_params={"max_new_tokens": 3000, "ignore_eos": True})))
        long.start()
        while "long" not in engine.scheduler.reqs:
            time.sleep(0.01)
        queued = threading.Thread(target=lambda: results.setdefault("queued", engine.generate(
            input_ids=[4, 5, 6], rid="queued", sampling_params={"max_new_tokens": 5})),
            daemon=True)
        queued.start()
        while "queued" not in engine.scheduler.reqs:
            time.sleep(0.01)
        engine.abort("queued")
        queued.join(timeout=20)
        assert not queued.is_alive() and results["queued"].finish_reason == "abort"
        engine.abort("long")
        long.join(timeout=20)
        assert results["long"].finish_reason == "abort"


def test_retract_ratio_uses_the_context_capped_output():
    def run(max_new):
        e = ScriptedEngine(page_size=1, num_tokens=160, context_len=64)
        for i in range(10):
            e.add([100 + 10 * i + j for j in range(10)], max_new_tokens=max_new)
        e.run_until_idle()
        e.assert_idle_and_full()
        return e.scheduler.stats.retractions, e.scheduler.ratio.value

    assert run(10**6) == run(54)  # scheduling ignores max_new_tokens beyond the context


def test_run_until_idle_returns_a_pending_abort_output():
    e = ScriptedEngine(page_size=1, num_tokens=64)
    h = e.add([1, 2, 3])
    e.abort(h.rid)
    outputs = e.run_until_idle()
    assert [(o.rid, o.finished_reason.kind) for o in outputs] == [(h.rid, FinishKind.ABORT)]


def test_requests_whose_allocations_all_miss_go_back_in_arrival_order():
    e = ScriptedEngine(page_size=1, num_tokens=4096, context_len=512)
    waiting_before = e.add(list(range(900, 910)), max_new_tokens=2)
    handles = [e.add(list(range(100 * i, 100 * i + 10)), max_new_tokens=2) for i in range(1, 5)]
    e.scheduler.on_admitted = lambda reqs: e.exhaust_pool(10**9)  # every allocation misses
    e.step()
    e.scheduler.on_admitted = None
    assert all(h.state is ReqState.RETRACTED for h in [waiting_before, *handles])
    assert [r.rid for r in e.scheduler.waiting] == [waiting_before.rid] + [h.rid for h in handles]
    e.restore_pool()
    e.run_until_idle()
    e.assert_idle_and_full()


def test_several_decode_retractions_in_one_step_requeue_in_arrival_order():
    # Prompts P[:80], P[:64], ..., P[:16] share pages in the tree; each fills its last page,
    # so each needs a new page for its next token. With no free page, the victims (longest
    # prompt first: a, b, c) free one unshared page each until three pages are free.
    e = ScriptedEngine(page_size=16, num_tokens=4096, context_len=512)
    prompt = list(range(1000, 1080))
    a, b, c, d, f = (e.add(prompt[:n], max_new_tokens=40) for n in (80, 64, 48, 32, 16))
    e.step()
    assert all(h.state is ReqState.RUNNING for h in (a, b, c, d, f))
    e.exhaust_pool(10**9)
    e.step()
    assert e.scheduler.stats.retractions == 3
    assert [r.rid for r in e.scheduler.waiting] == [a.rid, b.rid, c.rid]
    assert d.state is f.state is ReqState.RUNNING
    e.restore_pool()
    e.run_until_idle()
    assert a.output_ids == e.reference(prompt, 40)
    e.assert_idle_and_full()


def test_checker_finds_a_live_request_that_is_in_no_queue():
    e = ScriptedEngine(page_size=1, num_tokens=256, strict_checks=False)
    h = e.add([1, 2, 3], max_new_tokens=4)
    e.step()
    e.scheduler.running.remove(h.req)  # lost: it holds a row and KV but nothing schedules it
    report = e.scheduler.check(full=False)
    assert f"request {h.rid} is in no queue" in report.violations
    assert report.pools["queues"] == {"waiting": 0, "chunked": 0, "running": 0}


def test_checker_finds_a_request_queued_twice_or_in_a_wrong_state():
    e = ScriptedEngine(page_size=1, num_tokens=256, strict_checks=False)
    h = e.add([1, 2, 3], max_new_tokens=4)
    e.step()
    e.scheduler.waiting.append(h.req)  # running and waiting at once, RUNNING in waiting
    violations = e.scheduler.check(full=False).violations
    assert f"request {h.rid} in queue waiting is in state running" in violations
    assert f"request {h.rid} is in queues waiting, running" in violations
