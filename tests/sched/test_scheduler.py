"""Scheduler behaviour: batching, admission budgets, ratios, speculation, determinism."""

import pytest
import torch

from kvserve.forward import ForwardMode
from kvserve.sched import ReqState
from kvserve.sched.policy import NewTokenRatio
from kvserve.sched.req import FinishKind
from kvserve.sched.scheduler import (
    LPM_FALLBACK_QUEUE_LEN,
    ConfigError,
    SchedulerConfig,
    SpecConfig,
)
from kvserve.testing.scripted import ScriptedEngine

SYSTEM = list(range(2000, 2032))


def test_chunked_prefill_size_must_be_a_page_multiple():
    with pytest.raises(ConfigError, match=r"chunked_prefill_size \(24\) must be a multiple of "
                                          r"page_size \(16\)"):
        ScriptedEngine(page_size=16, chunked_prefill_size=24)
    with pytest.raises(ConfigError, match="schedule_policy"):
        SchedulerConfig(schedule_policy="random").validate()


def test_forward_batches_are_plain_tensors_with_exact_contents():
    e = ScriptedEngine(page_size=4, num_tokens=64, context_len=64)
    batches = []
    e.scheduler.on_launch = batches.append
    a = e.add([11, 12, 13, 14, 15, 16], max_new_tokens=2)
    e.step()
    fb = batches[-1].forward_batch
    assert fb.forward_mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert fb.positions.tolist() == list(range(6))
    assert fb.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9]  # pages 1 and 2, page 0 reserved
    assert fb.req_pool_indices.tolist() == [a.req.kv.row]
    assert (fb.seq_lens.tolist(), fb.prefix_lens.tolist(), fb.extend_lens.tolist()) == (
        [6], [0], [6])
    assert fb.input_ids.dtype == torch.int32
    e.step()
    fb = batches[-1].forward_batch
    assert fb.forward_mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [a.output_ids[0]]
    assert fb.positions.tolist() == [6] and fb.out_cache_loc.tolist() == [10]
    assert fb.seq_lens.tolist() == [7]
    e.run_until_idle()
    e.assert_idle_and_full()


def test_outputs_do_not_depend_on_batch_composition_or_caching():
    target = SYSTEM + [5, 6, 7, 8, 9]
    alone = ScriptedEngine(page_size=16, num_tokens=2048)
    h = alone.add(target, max_new_tokens=12)
    alone.run_until_idle()
    expected = alone.reference(target, 12)
    assert h.output_ids == expected

    for radix in (True, False):
        e = ScriptedEngine(page_size=16, num_tokens=2048, chunked_prefill_size=32,
                           disable_radix_cache=not radix)
        warm = e.add(SYSTEM + [1], max_new_tokens=3)  # caches the shared system prompt
        e.run_until_idle()
        others = [e.add(SYSTEM + [i] * 20, max_new_tokens=4 + i) for i in range(3)]
        others.append(e.add(list(range(40, 90)), max_new_tokens=6))  # a miss
        h = e.add(target, max_new_tokens=12)
        e.run_until_idle()
        assert h.output_ids == expected
        assert h.req.cached_tokens == (32 if radix else 0)
        assert warm.output_ids == e.reference(SYSTEM + [1], 3)
        for o in others:
            assert o.output_ids == e.reference(o.req.prompt_ids, len(o.output_ids))
        e.assert_idle_and_full()


def test_same_tokens_after_being_retracted_and_resumed():
    e = ScriptedEngine(page_size=1, num_tokens=200, context_len=128)
    a = e.add(SYSTEM, max_new_tokens=30)
    b = e.add([9] + SYSTEM, max_new_tokens=30)
    for _ in range(5):
        e.step()
    e.exhaust_pool(10_000)
    e.step()
    assert e.scheduler.stats.retractions == 1
    e.restore_pool()
    e.run_until_idle()
    assert a.output_ids == e.reference(SYSTEM, 30)
    assert b.output_ids == e.reference([9] + SYSTEM, 30)
    e.assert_idle_and_full()


def test_new_token_ratio_follows_sglang():
    r = NewTokenRatio(schedule_conservativeness=1.0)
    assert (r.init, r.min) == (0.7, pytest.approx(0.098))
    for _ in range(300):
        r.on_decode_step()
    assert r.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(400):
        r.on_decode_step()
    assert r.value == pytest.approx(0.098)
    r.reset()
    assert r.value == 0.7
    assert NewTokenRatio(2.0).init == 1.0


def test_admission_budget_counts_running_reservations():
    # page 1, 200 tokens. A running request reserves min(max_new - generated, 4096) * ratio.
    e = ScriptedEngine(page_size=1, num_tokens=200, context_len=512)
    a = e.add(list(range(10, 60)), max_new_tokens=100)  # idle engine admits it
    e.step()
    b = e.add(list(range(60, 100)), max_new_tokens=100)  # 40 + 100 + 1 > 200 - 51 - 99*0.7
    e.step()
    assert b.state is ReqState.WAITING and a.state is ReqState.RUNNING
    c = e.add(list(range(100, 110)), max_new_tokens=10)  # 10 + 10 + 1 fits
    e.scheduler.waiting.reverse()  # c first
    e.step()
    assert c.state is ReqState.RUNNING and b.state is ReqState.WAITING
    e.run_until_idle()
    e.assert_idle_and_full()


def test_max_running_requests_and_rows_bound_admission():
    e = ScriptedEngine(page_size=1, num_tokens=4096, num_rows=3, max_running_requests=2)
    hs = [e.add([i + 1] * 5, max_new_tokens=5) for i in range(4)]
    e.step()
    assert [h.state for h in hs] == [ReqState.RUNNING] * 2 + [ReqState.WAITING] * 2
    e.run_until_idle()
    assert all(h.finished_reason.kind is FinishKind.LENGTH for h in hs)
    e.assert_idle_and_full()


def test_lpm_admits_the_longest_prefix_match_first():
    e = ScriptedEngine(page_size=1, num_tokens=4096, max_running_requests=1,
                       schedule_policy="lpm")
    e.add(SYSTEM, max_new_tokens=1)
    e.run_until_idle()
    miss = e.add(list(range(5000, 5040)), max_new_tokens=1)
    hit = e.add(SYSTEM + [1, 2], max_new_tokens=1)
    e.step()
    assert hit.state is ReqState.FINISHED and miss.state is ReqState.WAITING
    e.run_until_idle()
    e.assert_idle_and_full()


def test_lpm_falls_back_to_fcfs_and_matches_only_what_it_admits_above_128_waiting():
    e = ScriptedEngine(page_size=1, num_tokens=16384, num_rows=256, max_running_requests=1,
                       schedule_policy="lpm")
    e.add(SYSTEM, max_new_tokens=1)
    e.run_until_idle()
    misses = [e.add(list(range(5000 + 50 * i, 5040 + 50 * i)), max_new_tokens=1)
              for i in range(LPM_FALLBACK_QUEUE_LEN)]
    hit = e.add(SYSTEM + [1, 2], max_new_tokens=1)
    e.step()  # 129 waiting: first come, first served; only the first one matched
    assert misses[0].state is ReqState.FINISHED and hit.state is ReqState.WAITING
    assert [m.req.match_node is not None for m in misses[1:3]] == [True, False]
    e.run_until_idle()
    e.assert_idle_and_full()


def test_speculative_steps_commit_only_accepted_tokens():
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)  # reserve 8
    accepts = iter([2, 3, 1, 4] * 20)
    e = ScriptedEngine(page_size=16, num_tokens=1024, context_len=256, speculative=spec,
                       accept_counts=lambda i, step: next(accepts))
    prompt = list(range(3000, 3010))
    h = e.add(prompt, max_new_tokens=13)
    seen = []
    while not h.req.finished:
        e.step()
        if not h.req.finished:
            kv = h.req.kv
            seen.append((kv.committed_len, kv.allocated_len))
            assert kv.committed_len == len(prompt) + len(h.output_ids) - 1
            assert kv.allocated_len % 16 == 0 or len(seen) == 1  # aligned after a spec step
    # 1 token from prefill, then 2, 3, 1, 4 accepted, then 2 more (of 3) to reach 13
    assert len(h.output_ids) == 13
    assert h.output_ids == e.reference(prompt, 13)
    assert seen[0] == (10, 10) and seen[1] == (12, 32)
    e.assert_idle_and_full()


def test_speculative_tokens_past_a_stop_are_dropped():
    spec = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    e = ScriptedEngine(page_size=1, num_tokens=1024, speculative=spec)
    prompt = list(range(3000, 3010))
    ref = e.reference(prompt, 6)
    h = e.add(prompt, max_new_tokens=50, stop_token_ids=(ref[3],))
    e.run_until_idle()
    assert h.output_ids == ref[:4]
    assert h.finished_reason.kind is FinishKind.STOP
    e.assert_idle_and_full()
    # the cache got exactly the committed tokens (prompt + 3 outputs), nothing past the stop
    assert e.tree_cache.evictable_size() == 10 + 3


def test_context_limit_finishes_by_length():
    e = ScriptedEngine(page_size=1, num_tokens=1024, context_len=20)
    h = e.add(list(range(1, 19)), max_new_tokens=100)
    e.run_until_idle()
    assert len(h.output_ids) == 2 and h.finished_reason.kind is FinishKind.LENGTH
    e.assert_idle_and_full()


def test_run_until_idle_reports_stuck_engine():
    from kvserve.sched.scheduler import SchedulerStuck

    e = ScriptedEngine(page_size=1, num_tokens=64)
    e.exhaust_pool(64)
    e.add(list(range(1, 30)))
    with pytest.raises(SchedulerStuck, match="no progress with 1 live requests"):
        e.run_until_idle()
    e.restore_pool()
    e.run_until_idle()
    e.assert_idle_and_full()


def test_eos_from_the_model_stops_requests_exactly_where_the_reference_does():
    e = ScriptedEngine(page_size=4, num_tokens=4096, eos_prob=0.2)
    prompts = [[i + 1] * 6 + list(range(30, 40)) for i in range(8)]
    hs = [e.add(p, max_new_tokens=40) for p in prompts]
    e.run_until_idle()
    stopped = [h for h in hs if h.finished_reason.kind is FinishKind.STOP]
    assert stopped  # with p=0.2 over up to 40 tokens, some requests hit EOS
    for h, p in zip(hs, prompts, strict=True):
        assert h.output_ids == e.reference(p, 40)
        if h.finished_reason.kind is FinishKind.STOP:
            assert h.output_ids[-1] == 2 and h.finished_reason.matched_token == 2
    e.assert_idle_and_full()


def test_non_strict_checker_runs_once_at_idle():
    e = ScriptedEngine(page_size=1, num_tokens=256, strict_checks=False)
    e.add([1, 2, 3], max_new_tokens=3)
    e.run_until_idle()
    e.step()  # idle again: no second check
    assert e.scheduler.checker.runs == 1
    assert e.scheduler.last_report is not None and e.scheduler.last_report.ok
