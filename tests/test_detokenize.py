import random

import pytest

from kvserve.detokenize import IncrementalDetokenizer
from kvserve.model.init import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", ["Hello world! The quick brown fox.",
                                  "héllo wörld ✓ 🎉🎉 日本語テキスト", "a\nb\n\n  c   d", "🎉"])
def test_streamed_deltas_add_up_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        delta = detok.add(ids[i : i + n])
        assert "\ufffd" not in delta
        pieces.append(delta)
        i += n
    pieces.append(detok.finish())
    assert "".join(pieces) == text == tokenizer.decode(ids)


def test_byte_tokens_of_an_emoji_are_held_back_until_complete(tokenizer):
    # byte-level tokens of a 4-byte character, one at a time
    byte_ids = [tokenizer.convert_tokens_to_ids(t)
                for t in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🎉")[0][0]]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in byte_ids]
    assert deltas[:-1] == [""] * (len(byte_ids) - 1) and deltas[-1] == "🎉"


def test_finish_flushes_an_incomplete_tail(tokenizer):
    byte_ids = [tokenizer.convert_tokens_to_ids(t)
                for t in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🎉")[0][0]]
    detok = IncrementalDetokenizer(tokenizer)
    # a step ending inside a character is held back whole (as vLLM does) ...
    assert detok.add(tokenizer.encode("ok ") + byte_ids[:2]) == ""
    # ... and finish() flushes it, the broken tail as U+FFFD
    assert detok.finish() == "ok " + tokenizer.decode(byte_ids[:2])
    assert detok.text.endswith("\ufffd")
