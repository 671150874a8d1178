"""``OutputStream``: one request's engine outputs as text deltas, for every reader.

The in-process ``Engine`` (a thread reading a ``queue.Queue``) and the HTTP server
(a coroutine reading an ``asyncio.Queue``) both feed each item they take from their
channel to ``add`` and stop once ``finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.detokenize import TextStream
from kvserve.sched.output import ReqOutput


class OutputStream:
    """The visible text of one request (``TextStream``: complete UTF-8, stop strings
    held back while running and cut exactly at the finish) and whether it ended."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.text = TextStream(tokenizer, stops)
        self.finished = False  # the final output (or an error) was taken

    def add(self, item: ReqOutput | Exception) -> str:
        """Take the next item of the request's channel; returns the new visible text.
        Raises ``item`` when it is an exception (refused, engine gone): the stream ends."""
        if isinstance(item, Exception):
            self.finished = True
            raise item
        reason = item.finished_reason
        self.finished = reason is not None
        return self.text.add(item.new_token_ids, self.finished,
                             reason.matched_stop if reason else None)
