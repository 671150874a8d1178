"""The Triton paged-attention kernel against the torch reference backend, on CPU under
TRITON_INTERPRET=1 (tiny shapes), and end to end against transformers."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import pytest
import torch

pytest.importorskip("triton")  # CI installs it (tests extra); GPU machines bring their own

from kvserve.forward import ForwardBatch, ForwardMode
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.model.attention import TorchPagedAttention
from kvserve.model.runner import ModelRunner
from kvserve.model.triton_attention import TritonPagedAttention
from kvserve.sched.req import SamplingParams
from kvserve.sched.scheduler import Scheduler, SchedulerConfig


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(("page_size", "heads", "kv_heads", "head_dim"),
                         [(1, 4, 4, 16), (16, 4, 2, 24), (16, 8, 1, 32)])
def test_kernel_matches_torch_backend(page_size, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(page_size + head_dim)
    pool = MHATokenToKVPool(4096, page_size, 1, kv_heads, head_dim, torch.float32)
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    table = torch.zeros((6, 300), dtype=torch.int32)
    # (row, seq_len, prefix_len): extend with prefix, fresh prefill, decode, a long decode
    specs = [(1, 70, 40), (2, 5, 0), (3, 100, 99), (5, 257, 256)]
    slots = torch.randperm(4000, generator=gen)[:500] + page_size
    start = 0
    for row, seq, _ in specs:
        table[row, :seq] = slots[start : start + seq].int()
        start += seq
    new = [s - p for _, s, p in specs]
    tokens = sum(new)
    batch = ForwardBatch(
        1, ForwardMode.EXTEND, i32([0] * tokens), i32([0] * tokens),
        torch.cat([table[r, p:s] for r, s, p in specs]), i32([r for r, _, _ in specs]),
        i32([s for _, s, _ in specs]), i32([p for _, _, p in specs]), i32(new),
        torch.ones(len(specs), dtype=torch.bool))
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    ref = TorchPagedAttention(pool, table)
    tri = TritonPagedAttention(pool, table)
    expected = ref.forward(q, k, v, 0, ref.prepare(batch), head_dim**-0.5)
    got = tri.forward(q, k, v, 0, tri.prepare(batch), head_dim**-0.5)
    assert (expected - got).abs().max().item() < 1e-4


def test_engine_with_triton_backend_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvserve.model.init import init_model

    ckpt = init_model(tmp_path / "m", "tiny-qwen3")
    runner = ModelRunner.from_pretrained(ckpt, max_total_tokens=1024, page_size=16,
                                         max_requests=4, context_len=256,
                                         attention_backend="triton")
    assert runner.attention_backend == "triton"
    sched = Scheduler(SchedulerConfig(page_size=16, context_len=256, chunked_prefill_size=16,
                                      strict_checks=True), runner.pools, runner)
    prompts = [list(range(30, 70)), list(range(30, 50)) + [7, 8, 9]]
    reqs = [sched.add_request(p, SamplingParams(max_new_tokens=4, temperature=0))
            for p in prompts]
    sched.run_until_idle()
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for req, prompt in zip(reqs, prompts, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert req.output_ids == out


def test_backend_names_are_checked():
    from kvserve.model.attention_backend import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="attention backend"):
        resolve_backend("flash", torch.device("cpu"))
