"""``min_new_tokens`` (SGLang) / ``min_tokens`` (vLLM): below it, EOS and stop ids are
masked in the logits and no stop (token or string) ends a request; only the length
limits do. Scripted runtime and the tiny real model, checker strict."""

import pytest

from kvserve import Engine
from kvserve.sched.req import FinishKind, RequestRejected
from kvserve.testing.scripted import ScriptedEngine

PROMPT = "Hello world! The quick brown fox"
EOS = 2  # the scripted engine's EOS id


# -- scripted runtime ----------------------------------------------------------------------
def _eos_prompts(e: ScriptedEngine, count: int) -> list[list[int]]:
    """Prompts whose unconstrained reply hits EOS within its first 5 tokens."""
    found = []
    for i in range(500):
        prompt = [i + 1] * 6 + list(range(30, 40))
        if len(e.reference(prompt, 40)) <= 5:
            found.append(prompt)
        if len(found) == count:
            return found
    raise AssertionError("no prompt stops early at this eos_prob")


def test_scripted_eos_is_masked_until_min_new_tokens_then_ends_the_reply():
    e = ScriptedEngine(page_size=4, num_tokens=4096, eos_prob=0.3)
    prompts = _eos_prompts(e, 6)
    hs = [e.add(p, max_new_tokens=40, min_new_tokens=10) for p in prompts]
    e.run_until_idle()
    for h, p in zip(hs, prompts, strict=True):
        assert h.output_ids == e.reference(p, 40, min_new_tokens=10)
        assert len(h.output_ids) >= 10 and EOS not in h.output_ids[:10]
        if h.finished_reason.kind is FinishKind.STOP:  # EOS ends it once allowed
            assert h.output_ids[-1] == EOS and EOS not in h.output_ids[:-1]
    assert any(h.finished_reason.kind is FinishKind.STOP for h in hs)
    e.assert_idle_and_full()


def test_scripted_min_new_tokens_equal_to_max_gives_exactly_max():
    e = ScriptedEngine(page_size=4, num_tokens=4096, eos_prob=0.3)
    prompts = _eos_prompts(e, 3)
    hs = [e.add(p, max_new_tokens=7, min_new_tokens=7) for p in prompts]
    e.run_until_idle()
    for h, p in zip(hs, prompts, strict=True):
        assert len(h.output_ids) == 7 and EOS not in h.output_ids
        assert h.output_ids == e.reference(p, 7, min_new_tokens=7)
        assert h.finished_reason.kind is FinishKind.LENGTH
    e.assert_idle_and_full()


def test_scripted_min_new_tokens_zero_changes_nothing():
    e = ScriptedEngine(page_size=4, num_tokens=4096, eos_prob=0.3)
    prompts = _eos_prompts(e, 3)
    zero = [e.add(p, max_new_tokens=40, min_new_tokens=0) for p in prompts]
    plain = [e.add(p, max_new_tokens=40) for p in prompts]
    e.run_until_idle()
    for a, b, p in zip(zero, plain, prompts, strict=True):
        assert a.output_ids == b.output_ids == e.reference(p, 40)
    e.assert_idle_and_full()


def test_scripted_stop_token_id_is_masked_in_a_batch_beside_unmasked_requests():
    e = ScriptedEngine(page_size=4, num_tokens=4096)
    prompt = list(range(50, 70))
    first = e.reference(prompt, 1)[0]
    masked = e.add(prompt, max_new_tokens=12, min_new_tokens=4, stop_token_ids=[first])
    free = e.add(prompt, max_new_tokens=12, stop_token_ids=[first])
    e.run_until_idle()
    assert free.output_ids == [first] and free.finished_reason.matched_token == first
    assert masked.output_ids[0] != first and first not in masked.output_ids[:4]
    assert len(masked.output_ids) >= 4
    e.assert_idle_and_full()


# -- the tiny real model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(ckpt):
    with Engine(model_path=ckpt, page_size=4, chunked_prefill_size=8,
                strict_checks=True) as e:
        yield e


def _greedy(engine, **params):
    return engine.generate(prompt=PROMPT, sampling_params={
        "max_new_tokens": 12, "temperature": 0, **params})


def test_greedy_takes_the_next_best_token_while_the_stop_id_is_masked(engine, ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    first = _greedy(engine).output_ids[0]
    assert _greedy(engine, stop_token_ids=[first]).output_ids == [first]  # stops at once
    out = _greedy(engine, stop_token_ids=[first], min_new_tokens=5)
    assert len(out.output_ids) >= 5 and first not in out.output_ids[:5]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    assert logits.topk(2).indices.tolist() == [first, out.output_ids[0]]


def test_a_stop_id_ends_the_reply_once_min_new_tokens_are_out(engine):
    first = _greedy(engine).output_ids[0]
    masked = _greedy(engine, max_new_tokens=16, stop_token_ids=[first], min_new_tokens=3)
    later = masked.output_ids[5]
    assert later not in masked.output_ids[:5] and later != first
    # banning `later` too changes none of the first 3 (it is not among them)
    out = _greedy(engine, max_new_tokens=16, stop_token_ids=[first, later], min_new_tokens=3)
    assert out.output_ids == masked.output_ids[:6]
    assert out.finish_reason == "stop" and out.completion_tokens == 6


def test_sampled_tokens_never_include_a_masked_id(engine):
    first = _greedy(engine).output_ids[0]
    for seed in range(4):
        out = engine.generate(prompt=PROMPT, sampling_params={
            "max_new_tokens": 8, "min_new_tokens": 8, "temperature": 1.5, "seed": seed,
            "stop_token_ids": [first]})
        assert len(out.output_ids) == 8 and first not in out.output_ids
        assert out.finish_reason == "length"


def test_min_new_tokens_equal_to_max_and_zero(engine):
    first = _greedy(engine).output_ids[0]
    out = _greedy(engine, max_new_tokens=6, min_new_tokens=6, stop_token_ids=[first])
    assert len(out.output_ids) == 6 and out.finish_reason == "length"
    assert first not in out.output_ids
    assert _greedy(engine, min_new_tokens=0, stop_token_ids=[first]).output_ids == [first]
    assert _greedy(engine, min_new_tokens=0).output_ids == _greedy(engine).output_ids


def _expected_cut(tokenizer, ids: list[int], stop: str, min_new: int) -> tuple[int, str]:
    """(tokens, text) the engine must return: the first occurrence of ``stop`` that ends
    after the text of the first ``min_new - 1`` tokens (stops are off while those are
    generated), found once ``min_new`` tokens are out; else every token."""
    quiet = len(tokenizer.decode(ids[: min_new - 1], skip_special_tokens=True))
    for k in range(min_new, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        cut = text.find(stop, max(quiet - len(stop) + 1, 0))
        if cut >= 0:
            return k, text[:cut]
    return len(ids), tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_strings_do_not_cut_before_min_new_tokens(engine):
    tok = engine.tokenizer
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = engine.generate(input_ids=[10, 11, 12], sampling_params=params)
    min_new = 12
    quiet_text = tok.decode(full.output_ids[: min_new - 1], skip_special_tokens=True)
    checked = 0
    for start in range(0, len(quiet_text) - 2):
        stop = quiet_text[start:start + 2]
        if "\ufffd" in stop or not stop.strip():
            continue
        without = engine.generate(input_ids=[10, 11, 12], sampling_params={
            **params, "stop": [stop]})
        assert without.completion_tokens < min_new  # it would have stopped early
        args = {**params, "stop": [stop], "min_new_tokens": min_new}
        out = engine.generate(input_ids=[10, 11, 12], sampling_params=args)
        chunks = list(engine.generate_stream(input_ids=[10, 11, 12], sampling_params=args))
        tokens, text = _expected_cut(tok, full.output_ids, stop, min_new)
        assert out.output_ids == full.output_ids[:tokens] and out.text == text
        assert out.completion_tokens >= min_new and text.startswith(quiet_text)
        assert out.finish_reason == ("stop" if tokens < 40 else "length")
        assert "".join(c.delta for c in chunks) == chunks[-1].text == text
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("params, message", [
    ({"min_new_tokens": -1}, "min_new_tokens must be an integer >= 0"),
    ({"min_new_tokens": True}, "min_new_tokens must be an integer >= 0"),
    ({"min_new_tokens": 1.5}, "min_new_tokens must be an integer >= 0"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, r"min_new_tokens \(9\) must be at most "
                                                  r"max_new_tokens \(8\)"),
])
def test_bad_min_new_tokens_is_refused_and_the_engine_keeps_serving(engine, params, message):
    with pytest.raises(RequestRejected, match=message):
        engine.generate(prompt="a", sampling_params=params)
    assert engine.generate(prompt="ok", sampling_params={"max_new_tokens": 1}).output_ids


def test_stop_ids_beyond_the_vocabulary_with_min_new_tokens_keep_the_engine_serving(engine):
    """A stop id the model cannot sample (>= vocab, even >= 2**63) is never matched; masking
    it indexed past the logits and killed the engine loop for every request."""
    vocab = engine.core.scheduler.config.vocab_size
    plain = _greedy(engine, max_new_tokens=5, min_new_tokens=3)
    out = _greedy(engine, max_new_tokens=5, min_new_tokens=3,
                  stop_token_ids=[vocab, 10**6, 2**63])
    assert out.output_ids == plain.output_ids and out.finish_reason == plain.finish_reason
    assert _greedy(engine, max_new_tokens=2).completion_tokens == 2
