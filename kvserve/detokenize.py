"""Incremental detokenization that only ever emits complete UTF-8 text.

Byte-level BPE tokens can split a character: decoding the output so far may end in
U+FFFD until the rest of the character arrives. ``IncrementalDetokenizer`` decodes
only a short window (the last few tokens before the unsent ones plus the new ones,
as vLLM and SGLang do), emits the text past what it already sent, and holds back a
trailing U+FFFD. Cost per token is constant, not the whole output.
"""

from __future__ import annotations

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
