"""``Engine``: the engine core loop in a background thread, behind a small Python API.

    from kvserve import Engine, SamplingParams
    with Engine(model_path="/path/to/hf-checkpoint") as engine:
        out = engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16})
        print(out.text, out.finish_reason)

Requests go in through a thread-safe queue; the loop adds them to the scheduler,
steps while there is work and hands each request's new tokens to its own queue,
so ``abort`` works while another thread reads a stream. Stop strings are checked
inside the step on a tail decode of the output, so no token past a stop is cached
or counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.detokenize import IncrementalDetokenizer
from kvserve.sched.req import Req, RequestRejected, SamplingParams
from kvserve.sched.scheduler import ReqOutput, Scheduler, SchedulerConfig

_STOP_TAIL_TOKENS = 16  # tokens decoded to look for a stop string ending at the last one


@dataclass
class GenerateOutput:
    """A finished (or, when streaming, partial) request. Token counts are tokens."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    finish_message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    delta: str = ""  # streaming: text new since the previous chunk
    output_logprobs: list[float] | None = None  # with return_logprob, on the final output


def _hold_back_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """``text`` less its longest tail that could be the start of a stop string, so a
    stream never shows text the final reply will cut."""
    keep = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]


def _default_pool_tokens(config: Any, device: str, dtype: torch.dtype, context_len: int,
                         mem_fraction: float) -> int:
    """KV pool size in tokens: on CUDA what ``mem_fraction`` of the device memory leaves
    after the (already loaded) weights; on CPU four contexts, at least 65,536."""
    if not device.startswith("cuda"):
        return max(context_len * 4, 65536)
    free, total = torch.cuda.mem_get_info()
    budget = free - (1 - mem_fraction) * total
    per_token = (config.num_layers * 2 * config.num_kv_heads * config.head_dim
                 * torch.tensor([], dtype=dtype).element_size())
    tokens = int(budget // per_token)
    if tokens < context_len:
        raise RuntimeError(f"only {tokens} KV tokens fit in {mem_fraction:.0%} of the device "
                           f"memory; lower the context length or raise mem_fraction_static")
    return tokens


class Engine:
    """An in-process engine over a local Hugging Face checkpoint.

    Args:
        model_path: checkpoint folder; None uses the tiny random-weight default model
            (created once in ``~/.cache/kvserve``; its output is meaningless text).
        page_size, chunked_prefill_size, max_total_tokens (KV pool size in tokens),
        disable_radix_cache, max_running_requests, context_len, schedule_policy:
            scheduler limits (see ``SchedulerConfig``).
        device: "cpu" or "cuda" (default: cuda when available); dtype: default float32
            on CPU, bfloat16 on GPU.
        attention_backend: "auto" (Triton on CUDA, else torch), "torch" or "triton".
        mem_fraction_static: on CUDA without ``max_total_tokens``, the share of the
            device memory (weights included) the engine may use; the KV pool gets what
            the weights leave of it.
        disable_cuda_graph: decode eagerly on CUDA (graphs are used by default with the
            Triton backend; see ``kvserve.model.cuda_graph``).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        page_size: int = 16,
        chunked_prefill_size: int | None = 2048,
        max_total_tokens: int | None = None,
        disable_radix_cache: bool = False,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        context_len: int | None = None,
        max_running_requests: int = 64,
        schedule_policy: str = "fcfs",
        strict_checks: bool = False,
        seed: int = 0,
        attention_backend: str = "auto",
        mem_fraction_static: float = 0.85,
        disable_cuda_graph: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        from kvserve.model.init import default_model_dir
        from kvserve.model.loader import load_model
        from kvserve.model.runner import ModelRunner, make_pools

        if model_path is None:
            model_path = default_model_dir()
            print(f"kvserve: no model given; using the tiny default at {model_path} "
                  "(random weights: the text it writes is meaningless)", file=sys.stderr)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model, config = load_model(model_path, device, dtype)  # type: ignore[arg-type]
        context_len = context_len or min(config.max_position_embeddings, 8192)
        if max_total_tokens is None:
            max_total_tokens = _default_pool_tokens(config, device, dtype,  # type: ignore[arg-type]
                                                    context_len, mem_fraction_static)
        pools = make_pools(config, max_total_tokens, page_size, max_running_requests,
                           context_len, device, dtype)  # type: ignore[arg-type]
        self.runner = ModelRunner(model, config, pools, seed=seed,
                                  attention_backend=attention_backend,
                                  cuda_graph=False if disable_cuda_graph else None)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=page_size, context_len=context_len,
                max_running_requests=max_running_requests,
                chunked_prefill_size=chunked_prefill_size,
                disable_radix_cache=disable_radix_cache, schedule_policy=schedule_policy,
                eos_token_ids=config.eos_token_ids, strict_checks=strict_checks,
            ),
            pools, self.runner,
        )
        self.scheduler.stop_string_matcher = self._match_stop
        self.model_path = str(model_path)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._outboxes: dict[str, queue.Queue[ReqOutput | Exception]] = {}
        self._rids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Run one request (a str or one id list) or many (a list of them) to completion.
        Raises RequestRejected for bad input (nothing is queued for it)."""
        single, requests = self._requests(prompt, input_ids)
        rids = [self._submit(ids, sampling_params, rid if single else None) for ids in requests]
        try:
            results = [self._collect(r) for r in rids]
        except Exception:
            for other in rids:  # one was rejected: stop the rest instead of orphaning them
                self.abort(other)
                self._outboxes.pop(other, None)
            raise
        return results[0] if single else results

    def generate_stream(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> Iterator[GenerateOutput]:
        """Yield a ``GenerateOutput`` per step that produced tokens; ``delta`` is the new
        text (incomplete UTF-8 held back); the last one has ``finish_reason`` set."""
        single, requests = self._requests(prompt, input_ids)
        if not single:
            raise RequestRejected("generate_stream takes one prompt")
        sampling = self._sampling(sampling_params)
        rid = self._submit(requests[0], sampling, rid)
        yield from self._stream(rid, sampling.stop)

    def abort(self, rid: str) -> None:
        """Abort a request at any stage (no-op for an unknown or finished rid)."""
        self._inbox.put(("abort", rid))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop", None))
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request plumbing ---------------------------------------------------------------
    def _requests(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise RequestRejected("give exactly one of prompt or input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return True, [self.tokenizer.encode(prompt)]
            if not all(isinstance(p, str) for p in prompt):
                raise RequestRejected("prompt must be a string or a list of strings")
            return False, [self.tokenizer.encode(p) for p in prompt]
        if input_ids and all(isinstance(t, int) for t in input_ids):
            return True, [list(input_ids)]
        if input_ids and all(isinstance(t, list | tuple) for t in input_ids):
            return False, [list(t) for t in input_ids]
        raise RequestRejected("input_ids must be a non-empty list of ints or of int lists")

    def _submit(self, ids: list[int], params: SamplingParams | dict[str, Any] | None,
                rid: str | None) -> str:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        sampling = self._sampling(params)
        rid = rid or f"gen-{next(self._rids)}"
        if rid in self._outboxes:
            raise RequestRejected(f"duplicate request id {rid!r}")
        outbox: queue.Queue[ReqOutput | Exception] = queue.Queue()
        self._outboxes[rid] = outbox
        self._inbox.put(("add", (rid, ids, sampling, outbox)))
        return rid

    @staticmethod
    def _sampling(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = set(params) - names
        if unknown:
            raise RequestRejected(f"unknown sampling parameters: {sorted(unknown)}")
        values = dict(params)
        for key in ("stop_token_ids", "stop"):
            if key in values:
                v = values[key]
                values[key] = (v,) if isinstance(v, str | int) else tuple(v)
        sampling = SamplingParams(**values)
        sampling.validate()
        return sampling

    def _stream(self, rid: str, stops: Sequence[str] = ()) -> Iterator[GenerateOutput]:
        outbox = self._outboxes[rid]
        ids: list[int] = []
        detok = IncrementalDetokenizer(self.tokenizer)
        sent = ""
        finished = False
        try:
            while not finished:
                item = outbox.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                ids += item.new_token_ids
                reason = item.finished_reason
                finished = reason is not None
                if finished:
                    visible = self._text(ids, reason)  # cut exactly at a stop string
                else:
                    detok.add(item.new_token_ids)  # complete characters only
                    visible = _hold_back_stop_prefix(detok.text, stops)
                delta, sent = visible[len(sent):], visible
                yield GenerateOutput(
                    rid, visible, list(ids), reason.kind.value if reason else None,
                    reason.message if reason else "", item.prompt_tokens, item.cached_tokens,
                    item.completion_tokens, delta,
                    list(item.output_logprobs) if item.output_logprobs is not None else None,
                )
        finally:
            if not finished:  # the reader walked away: stop the request
                self.abort(rid)
            self._outboxes.pop(rid, None)

    def _collect(self, rid: str) -> GenerateOutput:
        last = None
        for last in self._stream(rid):  # noqa: B007
            pass
        assert last is not None
        last.delta = ""
        return last

    def _text(self, ids: list[int], reason: Any) -> str:
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        if reason is not None and reason.matched_stop:
            cut = text.find(reason.matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def _match_stop(self, req: Req) -> str | None:
        tail = str(self.tokenizer.decode(req.output_ids[-_STOP_TAIL_TOKENS:],
                                         skip_special_tokens=True))
        return next((s for s in req.sampling.stop if s in tail), None)

    # -- the engine core loop (background thread) ----------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        try:
            while True:
                block = sched.is_idle
                try:
                    command, arg = self._inbox.get(timeout=0.05) if block else \
                        self._inbox.get_nowait()
                except queue.Empty:
                    command = None
                while command is not None:
                    if command == "stop":
                        self._abort_all("engine shut down")
                        return
                    self._handle(command, arg)
                    try:
                        command, arg = self._inbox.get_nowait()
                    except queue.Empty:
                        command = None
                outputs = sched.step() if not sched.is_idle else sched.take_outputs()
                for out in outputs:
                    box = self._outboxes.get(out.rid)
                    if box is not None:
                        box.put(out)
        except BaseException as err:  # report to every waiting caller instead of hanging
            self._error = err
            for box in self._outboxes.values():
                box.put(RuntimeError(f"engine loop died: {err!r}"))
            raise

    def _handle(self, command: str, arg: Any) -> None:
        if command == "abort":
            self.scheduler.abort_request(arg)
            return
        rid, ids, sampling, outbox = arg
        try:
            self.scheduler.add_request(ids, sampling, rid=rid)
        except RequestRejected as err:
            outbox.put(err)

    def _abort_all(self, message: str) -> None:
        """Shutdown: release every live request (the loop stops stepping) and tell waiters."""
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort_request(rid, message)
        if not self.scheduler.is_idle:
            self.scheduler.step()  # finalize the pending aborts through release_kv_cache
        for box in self._outboxes.values():
            box.put(RuntimeError(message))


__all__ = ["Engine", "GenerateOutput", "SamplingParams"]
