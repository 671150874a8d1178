"""Incremental detokenization that only ever emits complete UTF-8 text.

Byte-level BPE tokens can split a character: decoding the output so far may end in
U+FFFD until the rest of the character arrives. ``IncrementalDetokenizer`` decodes
only a short window (the last few tokens before the unsent ones plus the new ones,
as vLLM and SGLang do), emits the text past what it already sent, and holds back a
trailing U+FFFD. Cost per token is constant, not the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5  # already-sent tokens decoded again so merges at the edge are right


class IncrementalDetokenizer:
    """Feed token ids, get the new text. ``finish()`` flushes what was held back."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip))

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the newly complete text (possibly empty)."""
        self.ids += new_ids
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        delta = window[len(prefix) :]
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, self.prefix_offset)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text, incomplete characters included (as U+FFFD)."""
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def hold_back_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """``text`` less its longest tail that could be the start of a stop string, so a
    stream never shows text the final reply will cut."""
    keep = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]


def _cut_at_stop(tokenizer: Any, ids: list[int], text: str, stop: str) -> str:
    """``text`` (all of ``ids`` decoded) cut before the ``stop`` that the last token
    completed (the engine finishes on that token). An earlier whole occurrence is
    kept: it was output while min_new_tokens held stops off."""
    before = len(str(tokenizer.decode(ids[:-1], skip_special_tokens=True)))
    cut = text.find(stop, max(before - len(stop) + 1, 0))
    if cut < 0:  # the decodes disagree at the edge: the first occurrence, as before
        cut = text.find(stop)
    return text[:cut] if cut >= 0 else text


class TextStream:
    """The visible text of one request's output, step by step.

    While running: complete UTF-8 characters only, less a tail that could start a
    stop string. At finish: the whole output decoded and cut exactly before the stop
    string that ended it (``matched_stop``, the occurrence its last token completed).
    Every call returns the text new since the previous one; what was sent is always a
    prefix of the final text.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.sent = ""

    def add(self, new_ids: list[int], finished: bool = False,
            matched_stop: str | None = None) -> str:
        """Append tokens; returns the new visible text (possibly empty)."""
        self.ids += new_ids
        if finished:
            visible = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
            if matched_stop:
                visible = _cut_at_stop(self.tokenizer, self.ids, visible, matched_stop)
        else:
            self.detok.add(new_ids)
            visible = hold_back_stop_prefix(self.detok.text, self.stops)
        delta = visible[len(self.sent):] if visible.startswith(self.sent) else ""
        self.sent = self.sent + delta
        return delta
