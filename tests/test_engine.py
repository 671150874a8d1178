"""The Engine API end to end on a tiny random checkpoint (CPU, checker strict)."""

import threading

import pytest
from transformers import AutoTokenizer

from kvserve import Engine, SamplingParams
from kvserve.cli import main
from kvserve.model.config import ModelLoadError
from kvserve.sched.req import RequestRejected

PROMPT = "Hello world! The quick brown fox"


@pytest.fixture(scope="module")
def engine(ckpt):
    with Engine(model_path=ckpt, page_size=4, chunked_prefill_size=8,
                strict_checks=True) as e:
        yield e


def pools_full(e):
    s = e.scheduler
    alloc = s.pools.allocator
    return s.is_idle and alloc.available_size() + s.tree_cache.evictable_size() == alloc.size


def test_generate_returns_text_ids_and_usage(engine):
    out = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 12,
                                                          "temperature": 0})
    ids = engine.tokenizer.encode(PROMPT)
    assert out.prompt_tokens == len(ids) and out.completion_tokens == 12 == len(out.output_ids)
    assert out.finish_reason == "length"
    assert out.text == engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    again = engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=12,
                                                                          temperature=0))
    assert again.output_ids == out.output_ids
    assert again.cached_tokens == (len(ids) - 1) // 4 * 4
    assert pools_full(engine)


def test_many_prompts_and_seeded_sampling(engine):
    params = {"max_new_tokens": 6, "temperature": 0.9, "seed": 11}
    batch = engine.generate(prompt=["a b c", PROMPT, "x"], sampling_params=params)
    alone = engine.generate(prompt=PROMPT, sampling_params=params)
    assert [len(o.output_ids) for o in batch] == [6, 6, 6]
    assert batch[1].output_ids == alone.output_ids  # a seed gives the same tokens in any batch


def test_stream_deltas_add_up_and_end_with_the_reason(engine):
    chunks = list(engine.generate_stream(prompt=PROMPT,
                                         sampling_params={"max_new_tokens": 10}))
    assert len(chunks) == 10 and chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.delta for c in chunks) == chunks[-1].text


def test_stop_string_cuts_the_reply_and_nothing_past_it_is_counted(engine):
    full = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 16,
                                                           "temperature": 0})
    stop = full.text[6:9]
    assert stop and full.text.find(stop) == 6
    out = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 16,
                                                          "temperature": 0, "stop": [stop]})
    assert out.finish_reason == "stop" and out.text == full.text[:6]
    decoded = engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in engine.tokenizer.decode(out.output_ids[:-1])
    assert out.completion_tokens == len(out.output_ids) < 16
    assert pools_full(engine)


def test_abort_from_another_thread_while_streaming(engine):
    stream = engine.generate_stream(prompt="x", rid="long",
                                    sampling_params={"max_new_tokens": 400,
                                                     "ignore_eos": True})
    first = next(stream)
    assert first.finish_reason is None
    threading.Thread(target=engine.abort, args=("long",)).start()
    last = list(stream)[-1]
    assert last.finish_reason == "abort" and len(last.output_ids) < 400
    engine.abort("long")  # finished: a no-op
    engine.abort("never-seen")
    assert engine.generate(prompt="ok", sampling_params={"max_new_tokens": 2}).output_ids
    assert pools_full(engine)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of prompt or input_ids"),
    ({"prompt": "a", "input_ids": [1]}, "exactly one of prompt or input_ids"),
    ({"input_ids": []}, "non-empty"),
    ({"prompt": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"prompt": "a", "sampling_params": {"bogus": 1}}, "unknown sampling parameters"),
    ({"input_ids": [1] * 9000}, "context limit"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": "a", "sampling_params": {"stop": ["\ud800"]}}, "lone surrogates"),
    ({"prompt": "a", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"prompt": "a", "sampling_params": {"top_k": True}}, "top_k"),
    ({"prompt": "a", "sampling_params": {"seed": False}}, "seed"),
    ({"prompt": "a", "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
    ({"prompt": "a", "sampling_params": {"stop": {"a": 1}}}, "stop must be a string"),
    ({"prompt": "a", "rid": ""}, "rid must be a non-empty string"),
])
def test_bad_input_is_rejected_and_the_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(RequestRejected, match=message):
        engine.generate(**kwargs)
    assert engine.generate(prompt="ok", sampling_params={"max_new_tokens": 1}).output_ids
    assert pools_full(engine)


def test_shut_down_engine_refuses_work(ckpt):
    e = Engine(model_path=ckpt)
    e.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(prompt="a")


def test_loader_errors(tmp_path, ckpt):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model_path=tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], '
                                                  '"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine(model_path=tmp_path / "bad")


def test_init_model_is_deterministic_and_loads_in_transformers(tmp_path, capsys):
    assert main(["init-model", str(tmp_path / "a"), "--shape", "tiny-qwen3", "--seed", "4"]) == 0
    assert main(["init-model", str(tmp_path / "b"), "--shape", "tiny-qwen3", "--seed", "4"]) == 0
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.decode(tok.encode("héllo, wörld")) == "héllo, wörld"
    assert "random weights" in capsys.readouterr().out


def test_generate_cli(ckpt, capsys):
    assert main(["generate", "Hello", "--model", str(ckpt), "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "completion_tokens=4" in captured.err and captured.out
    assert main(["generate", "Hello", "--model", "/nonexistent/model"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_stream_abandoned_midway_aborts_its_request(engine):
    stream = engine.generate_stream(prompt="x", sampling_params={"max_new_tokens": 300,
                                                                 "ignore_eos": True})
    next(stream)
    stream.close()  # the reader walked away
    assert engine.generate(prompt="ok", sampling_params={"max_new_tokens": 1}).output_ids
    import time

    for _ in range(200):
        if pools_full(engine):
            break
        time.sleep(0.01)
    assert pools_full(engine)


def test_duplicate_rid_in_flight_is_rejected(engine):
    stream = engine.generate_stream(prompt="x", rid="dup", sampling_params={
        "max_new_tokens": 300, "ignore_eos": True})
    next(stream)
    with pytest.raises(RequestRejected, match="duplicate request id 'dup'"):
        engine.generate(prompt="y", rid="dup")
    stream.close()


def test_cli_user_errors_are_messages_not_tracebacks(ckpt, tmp_path, capsys, monkeypatch):
    import pytest as _pytest

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["generate", "hi", "--model", str(ckpt), "--attention-backend", "triton"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["init-model", str(ckpt), "--shape", "tiny-qwen2"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    for bad in (["generate", "hi", "--device", "foo"], ["generate", "hi", "--max-new-tokens",
                                                        "abc"]):
        with _pytest.raises(SystemExit) as err:
            main(bad)
        assert err.value.code == 2
    assert "not an integer: 'abc'" in capsys.readouterr().err


def test_logprobs_of_chosen_tokens_match_transformers(engine, ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    out = engine.generate(prompt=PROMPT, sampling_params={
        "max_new_tokens": 5, "temperature": 0, "return_logprob": True})
    assert len(out.output_logprobs) == 5
    ids = engine.tokenizer.encode(PROMPT) + out.output_ids
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    start = len(ids) - 5
    for j, token in enumerate(out.output_ids):
        assert abs(ref[start - 1 + j, token].item() - out.output_logprobs[j]) < 1e-4
    plain = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 2})
    assert plain.output_logprobs is None


def test_one_bad_prompt_in_a_batch_stops_the_others(engine):
    with pytest.raises(RequestRejected, match="context limit"):
        engine.generate(input_ids=[[1, 2, 3], [1] * 9000],
                        sampling_params={"max_new_tokens": 200, "ignore_eos": True})
    import time

    for _ in range(300):
        if pools_full(engine):
            break
        time.sleep(0.01)
    assert pools_full(engine) and not engine.router


def test_a_stream_never_shows_text_the_stop_string_cuts(engine):
    full = engine.generate(prompt=PROMPT, sampling_params={"max_new_tokens": 16,
                                                           "temperature": 0})
    stop = full.text[6:10]
    chunks = list(engine.generate_stream(prompt=PROMPT, sampling_params={
        "max_new_tokens": 16, "temperature": 0, "stop": [stop]}))
    final = chunks[-1]
    assert final.finish_reason == "stop" and final.text == full.text[:6]
    shown = ""
    for chunk in chunks:
        shown += chunk.delta
        assert final.text.startswith(shown)  # nothing later cut was ever sent
    assert shown == final.text


def test_hold_back_of_a_possible_stop_prefix():
    from kvserve.detokenize import hold_back_stop_prefix as _hold_back_stop_prefix

    assert _hold_back_stop_prefix("hello wo", ["world"]) == "hello "
    assert _hold_back_stop_prefix("hello", ["xyz"]) == "hello"
    assert _hold_back_stop_prefix("abc", []) == "abc"
    assert _hold_back_stop_prefix("ab", ["b!", "ab?"]) == ""


def test_booleans_are_not_token_ids(engine):
    with pytest.raises(RequestRejected):
        engine.generate(input_ids=[True, False])


def test_generate_cuts_its_text_at_the_stop_string_like_the_stream(engine):
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = engine.generate(input_ids=[10, 11, 12], sampling_params=params).text
    checked = 0
    for start in range(2, 30, 3):
        stop = full[start:start + 3]
        if len(stop) < 3 or "\ufffd" in stop:
            continue
        cut = full[: full.index(stop)]
        out = engine.generate(input_ids=[10, 11, 12], sampling_params={**params, "stop": [stop]})
        chunks = list(engine.generate_stream(input_ids=[10, 11, 12],
                                             sampling_params={**params, "stop": [stop]}))
        assert out.finish_reason == "stop" and out.text == cut
        assert "".join(c.delta for c in chunks) == chunks[-1].text == cut
        checked += 1
    assert checked >= 5
    assert pools_full(engine)


def test_automatic_rids_never_collide_with_a_callers_rid(engine):
    stream = engine.generate_stream(input_ids=[5, 6, 7], rid="gen-0",
                                    sampling_params={"max_new_tokens": 50, "ignore_eos": True})
    next(stream)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert out.rid != "gen-0" and out.rid.startswith("gen-") and len(out.output_ids) == 2
    stream.close()
