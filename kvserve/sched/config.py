"""Scheduler settings: limits, policies and the speculative-decoding shape."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv import spec_reserve_tokens


class ConfigError(ValueError):
    """Scheduler settings that cannot work together."""


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding shape (EAGLE-style): steps x topk drafts, verified tokens."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def reserve(self) -> int:
        return spec_reserve_tokens(self.num_steps, self.topk, self.num_draft_tokens)


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one engine. Token counts are tokens; ``chunked_prefill_size`` None or
    <= 0 disables chunking."""

    page_size: int = 1
    context_len: int = 4096
    max_running_requests: int = 256
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # token ids must be below it (None: any int32)
    speculative: SpecConfig | None = None
    strict_checks: bool = False
    raise_on_violation: bool = False
    session_timeout: float | None = None  # seconds a streaming session may idle (None: ever)

    def validate(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk > 0 and chunk % self.page_size:
            raise ConfigError(
                f"chunked_prefill_size ({chunk}) must be a multiple of page_size "
                f"({self.page_size})"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError(f"schedule_policy must be 'fcfs' or 'lpm', got "
                              f"{self.schedule_policy!r}")
        if self.context_len < 2 or self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ConfigError("context_len >= 2, max_running_requests >= 1 and "
                              "max_prefill_tokens >= 1 are required")
        if self.schedule_conservativeness <= 0:
            raise ConfigError("schedule_conservativeness must be > 0")
        timeout = self.session_timeout
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ConfigError(f"session_timeout must be > 0 seconds, got {timeout!r}")

    @property
    def chunk_size(self) -> int | None:
        chunk = self.chunked_prefill_size
        return chunk if chunk is not None and chunk > 0 else None
