"""kvserve: a compact LLM serving engine built around leak-proof KV-cache management."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvserve.engine import Engine, GenerateOutput
    from kvserve.sched.req import RequestRejected, SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import kvserve` stays light (the engine pulls torch and transformers).
    if name in ("Engine", "GenerateOutput"):
        from kvserve import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "RequestRejected"):
        from kvserve.sched import req

        return getattr(req, name)
    raise AttributeError(name)


__all__ = ["Engine", "GenerateOutput", "RequestRejected", "SamplingParams"]
