"""Multi-turn token-exactness (issue 12): a 4-turn conversation through a streaming
session gives the same tokens as sending each turn's whole history without a session,
and every later turn reuses the KV its session held (tiny real model, greedy, checker
strict)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import Engine

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
TURNS = ["Hello there, how are you today?", " Fine, thanks.", " And then what happened",
         " OK, bye!"]


@pytest.fixture(scope="module")
def engines(ckpt: Path) -> Iterator[tuple[Engine, Engine]]:
    """The session engine, and a reference without a prefix cache (so nothing it
    computes comes from earlier turns)."""
    with Engine(model_path=ckpt, page_size=4, chunked_prefill_size=8, max_total_tokens=512,
                device="cpu", strict_checks=True) as sessions, \
            Engine(model_path=ckpt, page_size=4, max_total_tokens=512, device="cpu",
                   disable_radix_cache=True) as reference:
        yield sessions, reference


def test_four_turns_through_a_session_match_the_whole_history_sent_each_time(
        engines: tuple[Engine, Engine]) -> None:
    engine, reference = engines
    sid = engine.open_session()
    history: list[int] = []
    previous = None
    for k, text in enumerate(TURNS):
        new_ids = engine.tokenizer.encode(text)
        params = {"id": sid} if previous is None else {"id": sid, "rid": previous.rid}
        turn = engine.generate(input_ids=new_ids, sampling_params=GREEDY,
                               session_params=params)
        history += new_ids
        plain = reference.generate(input_ids=history, sampling_params=GREEDY)
        assert turn.output_ids == plain.output_ids, f"turn {k}"
        assert turn.finish_reason == "length" and len(turn.output_ids) == 5
        assert turn.prompt_tokens == len(history) == plain.prompt_tokens
        if k == 0:
            assert turn.cached_tokens == 0
        else:  # the held context: everything but the last output token of turn k - 1
            held = previous.prompt_tokens + previous.completion_tokens - 1
            assert turn.cached_tokens == held
            assert turn.prompt_tokens - turn.cached_tokens == len(new_ids) + 1
        history += turn.output_ids
        previous = turn
    stats = engine.stats()
    assert (stats.open_sessions, stats.session_slot_hits, stats.session_mismatches,
            stats.session_rollbacks) == (1, 3, 0, 0)
    assert engine.close_session(sid) is True
    report = engine.check()
    kv, rows = report["pools"]["kv_tokens"], report["pools"]["rows"]
    assert report["ok"] and report["idle"] and report["open_sessions"] == 0
    assert kv["available"] + kv["evictable"] == kv["total"] == 512
    assert kv["protected"] == kv["session_held"] == 0
    assert rows["free"] == rows["size"] and rows["session"] == 0
