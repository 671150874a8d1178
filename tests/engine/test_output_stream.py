"""``OutputStream``, the one stream loop body of ``Engine`` and the HTTP server: a
request's outputs become text deltas that add up to the final text, a tail that could
start a stop string is held back, and an error item ends the stream by raising."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.engine.stream import OutputStream
from kvserve.model.init import build_tokenizer
from kvserve.sched.output import ReqOutput
from kvserve.sched.req import FinishKind, FinishReason


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _out(ids: list[int], reason: FinishReason | None = None) -> ReqOutput:
    return ReqOutput("r", ids, reason, 4, 0, len(ids))


def test_deltas_hold_back_a_possible_stop_and_the_final_cuts_at_it(tokenizer: Any):
    ids = tokenizer.encode("one two!")
    stream = OutputStream(tokenizer, ["two!"])
    deltas = [stream.add(_out([i])) for i in ids[:-1]]
    assert deltas == ["o", "ne", " "] and not stream.finished  # "two" may start "two!"
    last = stream.add(_out(ids[-1:], FinishReason(FinishKind.STOP, matched_stop="two!")))
    assert (last, stream.text.sent, stream.finished) == ("", "one ", True)


def test_an_error_item_ends_the_stream_and_is_raised(tokenizer: Any):
    stream = OutputStream(tokenizer, ())
    assert stream.add(_out(tokenizer.encode("hi"))) == "hi"
    with pytest.raises(RuntimeError, match=r"^gone$"):
        stream.add(RuntimeError("gone"))
    assert stream.finished and stream.text.sent == "hi"
