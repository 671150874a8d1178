"""The engine: ``EngineCore`` (model runner + scheduler + the one loop) and its callers.

    core.py      EngineArgs, EngineCore: the loop, dispatching commands by type
    messages.py  one NamedTuple per command (AddReq, AbortReq, ...) and event (Accepted, ...)
    router.py    RequestRouter: rid -> the reader's channel, duplicates, orphans (no I/O)
    stream.py    OutputStream: a request's outputs as text deltas
    api.py       Engine: the loop in a thread, for in-process use
    chat.py      chat_prompt_ids: messages through the chat template, as token ids
    process.py   the engine process of ``kvserve serve`` (ZMQ; imported lazily)
    client.py    EngineClient: the HTTP side's asyncio end of it (ZMQ; imported lazily)

Importing this package needs no server library (FastAPI, uvicorn, pyzmq, prometheus).
"""

from kvserve.engine.api import Engine, GenerateOutput, parse_sampling
from kvserve.engine.chat import chat_prompt_ids
from kvserve.engine.core import EngineArgs, EngineCore
from kvserve.sched.req import SamplingParams

__all__ = ["Engine", "EngineArgs", "EngineCore", "GenerateOutput", "SamplingParams",
           "chat_prompt_ids", "parse_sampling"]
