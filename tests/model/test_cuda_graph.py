"""The decode graph runner's padding, exercised on CPU (eager through the same static
buffers the CUDA graphs record)."""

import dataclasses

import torch

from kvserve.forward import ForwardBatch, ForwardMode
from kvserve.model.cuda_graph import DecodeGraphRunner
from kvserve.model.runner import ModelRunner
from kvserve.sched.req import SamplingParams
from kvserve.sched.scheduler import Scheduler, SchedulerConfig


def test_padding_to_captured_sizes_keeps_outputs_exact(checkpoints, hf_models):
    runner = ModelRunner.from_pretrained(checkpoints["tiny-llama"], max_total_tokens=1024,
                                         page_size=4, max_requests=8, context_len=128)
    runner.graph_runner = DecodeGraphRunner(runner, batch_sizes=(4, 8))
    assert not runner.graph_runner.use_graphs  # CPU: eager through the static buffers
    assert [runner.graph_runner.padded_size(n) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    sched = Scheduler(SchedulerConfig(page_size=4, context_len=128, strict_checks=True),
                      runner.pools, runner)
    prompts = [[11, 12, 13, 14, 15], [200, 3, 4], [7] * 9]
    reqs = [sched.add_request(p, SamplingParams(max_new_tokens=6, temperature=0))
            for p in prompts]
    k0 = runner.pools.kv_buffer.k_buffers[0]
    sched.step()  # prefill
    page0_before = k0[:4].clone()
    sched.step()  # a decode of 3 requests padded to 4: the padding writes slot 0 only
    assert not torch.equal(k0[0], page0_before[0])
    assert torch.equal(k0[1:4], page0_before[1:4])
    sched.run_until_idle()
    hf = hf_models["tiny-llama"]
    for req, prompt in zip(reqs, prompts, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert req.output_ids == ref
    big = DecodeGraphRunner(runner, batch_sizes=(2,))
    three = ForwardBatch(0, ForwardMode.DECODE, *(torch.zeros(3, dtype=torch.int32),) * 7,
                         torch.ones(3, dtype=torch.bool))
    assert not big.can_run(three)  # above the largest size: eager path
    assert not big.can_run(dataclasses.replace(three, forward_mode=ForwardMode.EXTEND))
