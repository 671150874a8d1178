"""Token-exact against transformers (float32, CPU): teacher-forced logits at every prefill
and decode position within 1e-4, greedy outputs equal to generate(do_sample=False), under
cache on/off, page 1 / chunk 7 and page 16 / chunk 32, a batch of 8 sharing prefixes,
forced retraction and aborts. The checker runs strict after every step."""

import pytest
import torch

from kvserve.model.runner import ModelRunner
from kvserve.sched.req import FinishKind, SamplingParams
from kvserve.sched.scheduler import AbortStatus, Scheduler, SchedulerConfig

SHAPES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]

SYSTEM = [17, 23, 99, 250, 3, 77, 5, 300, 41, 8, 150, 60, 61, 62, 200, 201, 202, 9, 10, 11]


def prompts_sharing_prefixes():
    return [SYSTEM + [(7 * i + j) % 400 + 30 for j in range(3 + 5 * i)] for i in range(8)]


class Run:
    """A real engine (runner + scheduler) that records the logits of every position."""

    def __init__(self, ckpt, page_size, chunk, radix=True, num_tokens=4096):
        self.runner = ModelRunner.from_pretrained(ckpt, max_total_tokens=num_tokens,
                                                  page_size=page_size, max_requests=16,
                                                  context_len=512)
        self.sched = Scheduler(SchedulerConfig(
            page_size=page_size, context_len=512, chunked_prefill_size=chunk,
            disable_radix_cache=not radix, strict_checks=True, raise_on_violation=True),
            self.runner.pools, self.runner)
        self.logits: dict[tuple[str, int], torch.Tensor] = {}
        self._reqs = []
        self.sched.on_launch = lambda batch: self._reqs.__setitem__(slice(None), batch.reqs)
        self.runner.capture_logits = self._capture

    def _capture(self, batch, logits):
        new = (batch.seq_lens - batch.prefix_lens).tolist()
        positions = batch.positions.tolist()
        start = 0
        for req, n in zip(self._reqs, new, strict=True):
            for j in range(n):
                self.logits[(req.rid, positions[start + j])] = logits[start + j]
            start += n

    def add(self, prompt, max_new):
        return self.sched.add_request(prompt, SamplingParams(max_new_tokens=max_new,
                                                             temperature=0.0))

    def assert_matches(self, hf, reqs):
        for req in reqs:
            seq = req.prompt_ids + req.output_ids
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0]
            positions = [p for (rid, p) in self.logits if rid == req.rid]
            # every position from the first one not served by the cache was computed
            assert min(positions) == req.cached_tokens or req.admissions > 1, req.rid
            assert set(range(min(positions), len(seq) - 1)) <= set(positions), req.rid
            for p in positions:
                diff = (self.logits[(req.rid, p)] - ref[p]).abs().max().item()
                assert diff < 1e-4, (req.rid, p, diff)

    def assert_idle_and_full(self):
        s = self.sched
        assert s.is_idle and s.checker.check([], s.held_pages, full=True).ok
        alloc = s.pools.allocator
        assert alloc.available_size() + s.tree_cache.evictable_size() == alloc.size


def hf_greedy(hf, prompt, max_new):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CONFIGS = [(1, 7, True), (16, 32, True), (16, 32, False), (1, 7, False)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("page_size", "chunk", "radix"), CONFIGS)
def test_batch_of_8_sharing_prefixes(checkpoints, hf_models, shape, page_size, chunk, radix):
    run = Run(checkpoints[shape], page_size, chunk, radix)
    prompts = prompts_sharing_prefixes()
    reqs = [run.add(p, max_new=3 + 2 * i) for i, p in enumerate(prompts)]  # finish apart
    run.sched.run_until_idle()
    hf = hf_models[shape]
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == hf_greedy(hf, prompt, len(req.output_ids))
        assert len(req.output_ids) == req.sampling.max_new_tokens
    run.assert_matches(hf, reqs)
    if radix:
        assert sum(r.cached_tokens for r in reqs) > 0
    run.assert_idle_and_full()


@pytest.mark.parametrize("shape", SHAPES)
def test_retraction_and_aborts_keep_outputs_exact(checkpoints, hf_models, shape):
    run = Run(checkpoints[shape], page_size=1, chunk=7, num_tokens=400)
    prompts = prompts_sharing_prefixes()[:5]
    reqs = [run.add(p, max_new=12) for p in prompts]
    alloc = run.sched.pools.allocator
    for _ in range(12):
        run.sched.step()
    assert run.sched.abort_request(reqs[1].rid) is not AbortStatus.NOT_FOUND
    held = alloc.alloc_pages(alloc.available_pages())  # memory pressure: forces retraction
    run.sched.held_pages["pressure"] = held
    for _ in range(4):
        run.sched.step()
    assert run.sched.stats.retractions >= 1
    alloc.free(run.sched.held_pages.pop("pressure"))
    run.sched.run_until_idle()
    hf = hf_models[shape]
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == hf_greedy(hf, prompt, 12)[: len(req.output_ids)]
    assert reqs[1].finished_reason.kind is FinishKind.ABORT
    run.assert_matches(hf, [r for r in reqs if r is not reqs[1]])
    run.assert_idle_and_full()


@pytest.mark.parametrize("shape", SHAPES)
def test_outputs_depend_on_early_context(checkpoints, shape):
    run = Run(checkpoints[shape], page_size=16, chunk=32)
    a = run.add(SYSTEM + [5, 6, 7], max_new=8)
    b = run.add([18] + SYSTEM[1:] + [5, 6, 7], max_new=8)  # only the first token differs
    run.sched.run_until_idle()
    assert a.output_ids != b.output_ids


@pytest.mark.parametrize("shape", SHAPES)
def test_overwriting_a_cached_page_changes_the_reader(checkpoints, hf_models, shape):
    run = Run(checkpoints[shape], page_size=16, chunk=32)
    warm = run.add(SYSTEM + list(range(40, 60)), max_new=1)
    run.sched.run_until_idle()
    reader = run.add(SYSTEM + list(range(40, 60)) + [7, 8], max_new=1)
    page = run.sched.tree_cache.match_prefix(reader.prompt_ids).page_ids[0]
    k_buf = run.runner.pools.kv_buffer.k_buffers[0]
    k_buf[page * 16 : page * 16 + 16] += 1.0  # corrupt layer 0 keys of the first cached page
    run.sched.run_until_idle()
    assert reader.cached_tokens == 32
    seq = reader.prompt_ids
    with torch.no_grad():
        ref = hf_models[shape](torch.tensor([seq])).logits[0]
    last = run.logits[(reader.rid, len(seq) - 1)]
    assert (last - ref[len(seq) - 1]).abs().max().item() > 1e-3
    assert warm.output_ids
