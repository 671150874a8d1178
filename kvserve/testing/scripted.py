"""The scripted runtime: the real scheduler, pools and caches with a deterministic fake
model that really uses the KV pool.

``ScriptedModel`` writes a fingerprint of every input token (token id, position)
into the KV buffer at its slot, and computes each next token from the values it
gathers back through the request's ``req_to_token`` row. Freed pages are
poisoned. A row pointing at a wrong, stale or freed page therefore changes the
output, and ``reference_tokens`` (the same function without any KV) says what a
correct engine must produce.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from kvserve.cache.base import BasePrefixCache
from kvserve.forward import ForwardBatch, ModelOutput
from kvserve.mem.kv_buffer import MHATokenToKVPool
from kvserve.mem.pages import num_pages, slot_ids
from kvserve.mem.pools import MemoryPools, build_pools
from kvserve.sched.invariants import CheckReport
from kvserve.sched.req import FinishReason, Req, SamplingParams
from kvserve.sched.scheduler import (
    AbortStatus,
    ReqOutput,
    Scheduler,
    SchedulerConfig,
    SpecConfig,
)
from kvserve.sched.state import ReqState

VOCAB_LO, VOCAB_HI = 100, 30_000
_MOD = 65_521  # keeps every hash below 2**53, so float64 sums are exact
_POISON = -1.0


def _weights(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    return (i * 2_654_435_761) % 65_521 + 1


class ScriptedModel:
    """Deterministic fake model over a real KV pool (1 layer, 1 head, 2 float64 values
    per slot: the token id modulo 65,521 and the position; freed slots read -1).

    Args:
        pools: the engine's pools; ``pools.kv_buffer`` is created if absent.
        eos_token_id: the token emitted when the hash says so.
        eos_prob: probability-like share of steps that emit EOS (0 = never).
        accept_counts: for speculative steps, ``f(rid_index, step) -> tokens accepted``
            (bonus included); default accepts the whole window.
    """

    uses_sampling_params = False

    def __init__(
        self,
        pools: MemoryPools,
        eos_token_id: int = 2,
        eos_prob: float = 0.0,
        accept_counts: Callable[[int, int], int] | None = None,
    ) -> None:
        if pools.kv_buffer is None:
            pools.kv_buffer = MHATokenToKVPool(
                pools.allocator.size, pools.page_size, 1, 1, 2, dtype=torch.float64
            )
        self.pools = pools
        self.eos_token_id = eos_token_id
        self.eos_threshold = int(eos_prob * 1000)
        self.accept_counts = accept_counts
        self.steps = 0
        self._weights = _weights(pools.req_to_token_pool.row_width)
        pools.allocator.on_free = self._poison

    # -- the function a correct engine computes ----------------------------------------
    def _next_from_hash(self, h: int, banned: Collection[int] = ()) -> int:
        """The scripted choice; with ``banned`` ids (min_new_tokens) the next allowed
        one, as a real model's masked logits give its next best token."""
        token = VOCAB_LO + h % (VOCAB_HI - VOCAB_LO)
        if (h // 7) % 1000 < self.eos_threshold and self.eos_token_id not in banned:
            return self.eos_token_id
        while token in banned:
            token = VOCAB_LO + (token + 1 - VOCAB_LO) % (VOCAB_HI - VOCAB_LO)
        return token

    def reference_next(self, tokens: Sequence[int], banned: Collection[int] = ()) -> int:
        """Next token after ``tokens`` as a correct engine computes it (no KV involved)."""
        toks = torch.tensor(list(tokens), dtype=torch.int64)
        pos = torch.arange(len(tokens), dtype=torch.int64)
        a = (toks % _MOD) * 31 + pos
        return self._next_from_hash(int((a * self._weights[: len(tokens)]).sum()), banned)

    def reference_tokens(self, prompt: Sequence[int], max_new_tokens: int,
                         stop_ids: Sequence[int] = (), min_new_tokens: int = 0) -> list[int]:
        seq = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = self.reference_next(seq, stop_ids if len(out) < min_new_tokens else ())
            out.append(token)
            seq.append(token)
            if token in stop_ids:
                break
        return out

    # -- forward --------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        self.steps += 1
        if batch.speculative:
            return self._forward_speculative(batch)
        self._write(batch.out_cache_loc, batch.input_ids, batch.positions)
        banned = batch.banned_token_ids
        nexts = self._next_tokens(batch.req_pool_indices, batch.seq_lens,
                                  [] if banned is None else banned.tolist())
        sample = batch.sample.tolist()
        return ModelOutput([[t] if s else [] for t, s in zip(nexts, sample, strict=True)])

    def _forward_speculative(self, batch: ForwardBatch) -> ModelOutput:
        widths = batch.extend_lens.tolist()
        starts = batch.prefix_lens.tolist()
        tokens = batch.input_ids.tolist()
        out: list[list[int]] = [[] for _ in widths]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        accept = [
            max(1, min(w, self.accept_counts(i, self.steps) if self.accept_counts else w))
            for i, w in enumerate(widths)
        ]
        for j in range(max(accept, default=0)):
            live = [i for i, a in enumerate(accept) if a > j]
            slots = batch.out_cache_loc[[offsets[i] + j for i in live]]
            self._write(slots, torch.tensor([tokens[i] for i in live]),
                        torch.tensor([starts[i] + j for i in live]))
            nexts = self._next_tokens(batch.req_pool_indices[live],
                                      torch.tensor([starts[i] + j + 1 for i in live]))
            for i, token in zip(live, nexts, strict=True):
                out[i].append(token)
                tokens[i] = token
        return ModelOutput(out)

    def _write(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        kbuf = self.pools.kv_buffer.get_kv_buffer(0)[0]  # type: ignore[union-attr]
        idx = slots.long()
        kbuf[idx, 0, 0] = torch.remainder(token_ids.to(torch.int64), _MOD).to(torch.float64)
        kbuf[idx, 0, 1] = positions.to(torch.float64)

    def _next_tokens(self, rows: torch.Tensor, seq_lens: torch.Tensor,
                     banned: Sequence[Collection[int]] = ()) -> list[int]:
        """Hash of every (token, position) the rows point at, for the whole batch;
        ``banned[i]``: ids row i must not produce (-1 padding is no token id)."""
        if rows.numel() == 0:
            return []
        flat = self.pools.kv_buffer.get_kv_buffer(0)[0].view(-1, 2)  # type: ignore[union-attr]
        length = int(seq_lens.max())
        table = self.pools.req_to_token_pool.req_to_token
        values = flat[table[rows.long(), :length].long()]  # [batch, length, 2]
        a = values[..., 0] * 31 + values[..., 1]
        a *= torch.arange(length)[None, :] < seq_lens.long()[:, None]
        hashes = (a @ self._weights[:length].to(torch.float64)).tolist()
        if not banned:
            return [self._next_from_hash(int(h)) for h in hashes]
        return [self._next_from_hash(int(h), ids) for h, ids in zip(hashes, banned, strict=True)]

    def _poison(self, page_ids: Sequence[int]) -> None:
        kbuf = self.pools.kv_buffer.get_kv_buffer(0)[0]  # type: ignore[union-attr]
        page_size = self.pools.page_size
        kbuf[slot_ids(page_ids, page_size, 0, len(page_ids) * page_size).long()] = _POISON


@dataclass(eq=False)
class ReqHandle:
    """A test's view of one request (SGLang scripted runtime's ``ReqHandle``)."""

    req: Req
    engine: ScriptedEngine

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def state(self) -> ReqState:
        return self.req.state

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids

    @property
    def finished_reason(self) -> FinishReason | None:
        return self.req.finished_reason

    @property
    def kv_pages(self) -> int:
        """``ceil(allocated_len / page_size)``; 0 when the request holds no KV."""
        return num_pages(self.req.kv.allocated_len, self.engine.page_size)

    @property
    def owned_pages(self) -> int:
        """Pages covering ``[protected_len, allocated_len)``: owned by the request itself."""
        return len(self.req.kv.owned_page_ids(self.engine.page_size))

    @property
    def lock_refs(self) -> int:
        """``lock_ref`` of the node the request has locked (0 without a lock)."""
        lock = self.req.kv.lock
        return lock.node.lock_ref if lock is not None else 0


class ScriptedEngine:
    """The real scheduler + pools + cache + strict checker, driven step by step."""

    def __init__(
        self,
        page_size: int = 1,
        num_tokens: int = 4096,
        num_rows: int = 64,
        context_len: int = 512,
        max_running_requests: int | None = None,
        chunked_prefill_size: int | None = None,
        max_prefill_tokens: int = 16384,
        schedule_policy: str = "fcfs",
        disable_radix_cache: bool = False,
        speculative: SpecConfig | None = None,
        eos_token_id: int = 2,
        eos_prob: float = 0.0,
        accept_counts: Callable[[int, int], int] | None = None,
        strict_checks: bool = True,
        session_timeout: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.page_size = page_size
        self.config = SchedulerConfig(
            page_size=page_size,
            context_len=context_len,
            max_running_requests=max_running_requests or num_rows,
            chunked_prefill_size=chunked_prefill_size,
            max_prefill_tokens=max_prefill_tokens,
            schedule_policy=schedule_policy,
            disable_radix_cache=disable_radix_cache,
            eos_token_ids=(eos_token_id,),
            speculative=speculative,
            strict_checks=strict_checks,
            raise_on_violation=True,
            session_timeout=session_timeout,
        )
        self.config.validate()
        reserve = speculative.reserve if speculative else 0
        self.pools = build_pools(num_rows, context_len, num_tokens, page_size,
                                 spec_reserve=reserve)
        self.model = ScriptedModel(self.pools, eos_token_id, eos_prob, accept_counts)
        self.scheduler = (Scheduler(self.config, self.pools, self.model) if clock is None
                          else Scheduler(self.config, self.pools, self.model, clock))
        self.handles: dict[str, ReqHandle] = {}

    @property
    def tree_cache(self) -> BasePrefixCache:
        return self.scheduler.tree_cache

    def add(self, prompt_ids: Sequence[int], rid: str | None = None,
            extra_key: str | None = None, session_params: dict[str, object] | None = None,
            **sampling: object) -> ReqHandle:
        """Queue a request (a session turn with ``session_params``); ``sampling`` are
        ``SamplingParams`` fields."""
        req = self.scheduler.add_request(prompt_ids, SamplingParams(**sampling),  # type: ignore[arg-type]
                                         rid=rid, extra_key=extra_key,
                                         session_params=session_params)
        handle = ReqHandle(req, self)
        self.handles[req.rid] = handle
        return handle

    def open_session(self, session_id: str | None = None,
                     capacity_of_str_len: int | None = None) -> str:
        return self.scheduler.open_session(session_id, capacity_of_str_len)

    def close_session(self, session_id: str) -> bool:
        return self.scheduler.close_session(session_id)

    def abort(self, rid: str) -> AbortStatus:
        return self.scheduler.abort_request(rid)

    def step(self) -> list[ReqOutput]:
        return self.scheduler.step()

    def run_until_idle(self, max_steps: int = 10_000) -> list[ReqOutput]:
        return self.scheduler.run_until_idle(max_steps)

    def exhaust_pool(self, num_tokens: int) -> int:
        """Take up to ``num_tokens`` of free KV (whole pages) away from the engine, held
        by the owner "exhausted" that the checker knows. Returns tokens taken."""
        alloc = self.pools.allocator
        pages = alloc.alloc_pages(min(num_pages(num_tokens, self.page_size),
                                      alloc.available_pages())) or []
        self.scheduler.held_pages.setdefault("exhausted", []).extend(pages)
        return len(pages) * self.page_size

    def restore_pool(self) -> None:
        self.pools.allocator.free(self.scheduler.held_pages.pop("exhausted", []))

    def check(self) -> CheckReport:
        return self.scheduler.check()

    def assert_idle_and_full(self) -> None:
        """No live request, nothing queued, every pool back at its total."""
        sched = self.scheduler
        report = self.check()
        assert report.ok, report
        assert sched.is_idle and not sched.waiting and not sched.running
        assert sched.chunked_req is None
        alloc = self.pools.allocator
        held = sum(len(p) for p in sched.held_pages.values()) * self.page_size
        assert alloc.available_size() + self.tree_cache.evictable_size() + held == alloc.size
        assert self.tree_cache.protected_size() == 0
        assert alloc.pending_release_size() == 0
        rows = self.pools.req_to_token_pool
        assert rows.available_size() == rows.size

    def reference(self, prompt_ids: Sequence[int], max_new_tokens: int,
                  min_new_tokens: int = 0) -> list[int]:
        """Tokens a correct engine returns for this prompt (EOS the only stop id)."""
        return self.model.reference_tokens(prompt_ids, max_new_tokens,
                                           stop_ids=self.config.eos_token_ids,
                                           min_new_tokens=min_new_tokens)
