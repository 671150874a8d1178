"""Result processing: commit the step's KV, append sampled tokens, decide finishes.

For each request of a processed batch, in batch order:

- aborted while in flight (``to_finish``): finish, its computed KV goes to the cache;
- extend: commit the chunk; mid prompt -> cache the chunk (``cache_unfinished_req``);
  prompt done -> first token, the prompt is cached and the request joins decode;
- decode: commit one slot, append the token (the fast path skips the finish tests
  below ``fast_path_outputs``); speculative: commit the accepted tokens only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvserve.cache.base import BasePrefixCache
from kvserve.forward import ForwardMode, ModelOutput
from kvserve.kv import commit_kv
from kvserve.sched.batch import ScheduleBatch
from kvserve.sched.config import SchedulerConfig
from kvserve.sched.decode import DecodeManager
from kvserve.sched.exits import Exits
from kvserve.sched.req import FinishKind, FinishReason, Req
from kvserve.sched.state import ReqState


class ReqOutput(NamedTuple):
    """What one step produced for one request."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_logprobs: list[float] | None = None  # at finish, with return_logprob


# builds a ReqOutput without NamedTuple.__new__'s Python frame (decode's hot path)
new_output = tuple.__new__


class ResultProcessor:
    """Applies a ``ModelOutput`` to its batch's requests.

    ``stop_string_matcher(req)`` returns the stop string ``req``'s output now ends
    with, if any; the engine sets it (it owns the tokenizer). ``generated_tokens``
    counts the tokens appended to outputs (the ones a reply shows; tokens past a finish
    are not), for the generation-tokens counter (vLLM's ``generation_tokens_total``).
    """

    def __init__(self, config: SchedulerConfig, tree_cache: BasePrefixCache,
                 decode: DecodeManager, exits: Exits, outputs: list[ReqOutput]) -> None:
        self.config = config
        self.tree_cache = tree_cache
        self.decode = decode
        self.exits = exits
        self.outputs = outputs
        self.stop_string_matcher: Callable[[Req], str | None] | None = None
        self.generated_tokens = 0

    def process(self, batch: ScheduleBatch, result: ModelOutput) -> None:
        """Raises ValueError when the model's result does not fit the batch."""
        if len(result.token_ids) != len(batch.reqs):
            raise ValueError(f"model returned {len(result.token_ids)} results for "
                             f"{len(batch.reqs)} requests")
        fb = batch.forward_batch
        lengths = [len(r.output_ids) for r in batch.reqs] if result.logprobs is not None else []
        if batch.forward_mode is ForwardMode.DECODE and not fb.speculative:
            self._process_decode(batch.reqs, result.token_ids)
        else:
            widths = fb.extend_lens.tolist()
            for req, tokens, width in zip(batch.reqs, result.token_ids, widths, strict=True):
                if req.to_finish is not None:
                    self.exits.finish(req, req.to_finish, insert=True)
                elif batch.forward_mode is ForwardMode.EXTEND:
                    self._process_extend(req, tokens)
                else:
                    if len(tokens) > width:
                        raise ValueError(f"model accepted {len(tokens)} tokens for {req.rid}, "
                                         f"window {width}")
                    self._append_tokens(req, tokens, commit=True)
        if result.logprobs is not None:  # keep those of the tokens that were kept
            for req, before, logprobs in zip(batch.reqs, lengths, result.logprobs, strict=True):
                if req.sampling.return_logprob:
                    req.output_logprobs += logprobs[: len(req.output_ids) - before]

    def _process_decode(self, reqs: list[Req], results: list[list[int]]) -> None:
        """One token per request (the hot path): commit its input's KV, append it."""
        outputs = self.outputs
        fast = 0  # tokens appended on the fast path (the others count in _append_tokens)
        for req, tokens in zip(reqs, results, strict=True):
            if req.to_finish is not None:
                self.exits.finish(req, req.to_finish, insert=True)
                continue
            try:
                (token,) = tokens
            except ValueError:
                raise ValueError(f"model returned {len(tokens)} tokens for {req.rid} in "
                                 "decode") from None
            out = req.output_ids
            if token in req.stop_ids or len(out) >= req.fast_path_outputs:
                self._append_tokens(req, tokens, commit=True)
                continue
            kv = req.kv
            if kv.committed_len >= kv.allocated_len:
                commit_kv(req, 1)  # raises: no slot was allocated for this token
            kv.committed_len += 1
            out.append(token)
            fast += 1
            outputs.append(new_output(ReqOutput, (req.rid, tokens, None, req.prompt_len,
                                                  req.cached_tokens, len(out), None)))
        self.generated_tokens += fast

    def _process_extend(self, req: Req, tokens: list[int]) -> None:
        commit_kv(req, req.extend_len)
        if req.kv.committed_len < req.seq_len:  # more chunks to go
            req.state = ReqState.CHUNKED
            self.tree_cache.cache_unfinished_req(req)
            return
        if req.sampling.max_new_tokens == 0:
            self.exits.finish(req, FinishReason(FinishKind.LENGTH), insert=True)
            return
        req.state = ReqState.RUNNING
        if self._append_tokens(req, tokens[:1], commit=False):
            # Share the prompt with requests arriving while this one decodes (as SGLang).
            self.tree_cache.cache_unfinished_req(req)
            self.decode.add(req)

    def _append_tokens(self, req: Req, tokens: list[int], commit: bool) -> bool:
        """Append sampled tokens up to the first finish condition (tokens after it are
        dropped and their KV is not committed); returns whether the request runs on."""
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            kept.append(token)
            req.output_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                break
        self.generated_tokens += len(kept)
        if commit:
            commit_kv(req, len(kept))
        if reason is not None:
            self.exits.finish(req, reason, insert=True, new_tokens=kept)
            return False
        if kept:
            self.exits.emit(req, kept)
        return True

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        """Why ``req`` finishes now that ``token`` was appended to its output, if it does."""
        sampling = req.sampling
        # below min_new_tokens only the length limits end a request (SGLang's check_finished)
        if len(req.output_ids) >= sampling.min_new_tokens:
            if token in req.stop_ids:
                return FinishReason(FinishKind.STOP, matched_token=token)
            if sampling.stop and self.stop_string_matcher is not None:
                matched = self.stop_string_matcher(req)
                if matched is not None:
                    return FinishReason(FinishKind.STOP, matched_stop=matched)
        if len(req.output_ids) >= sampling.max_new_tokens:
            return FinishReason(FinishKind.LENGTH)
        if req.seq_len >= self.config.context_len:
            return FinishReason(FinishKind.LENGTH, "context length reached")
        return None
