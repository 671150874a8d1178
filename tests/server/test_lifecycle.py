"""Process lifecycle of ``kvserve serve``: the HTTP process and its engine process.

- SIGINT / SIGTERM: exit code 0, the engine process gone too; requests still open after
  the grace period end with finish_reason "abort" (streams then ``[DONE]``).
- The engine process killed: every open request answers at once (an error event on a
  stream, 503 with an OpenAI error body otherwise), /health and new requests get 503,
  the HTTP process keeps answering and still exits cleanly on SIGTERM.
- The HTTP process killed: the engine process notices (``getppid``) and exits on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, start_server

EXIT_TIMEOUT_S = 30.0  # generous: a signalled stop takes about 5 s grace + teardown
LONG = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 4000, "ignore_eos": True}
LONG_STREAM = {**LONG, "stream": True, "stream_options": {"include_usage": True}}


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def engine_pid(server: LiveServer) -> int:
    """The engine process: the HTTP process's ``multiprocessing`` spawn child (the other
    child, if any, is multiprocessing's resource tracker)."""
    kids = children(server.proc.pid)
    engines = [c for c in kids if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, (kids, server.logs())
    return engines[0]


def ipc_dirs(pid: int) -> set[Path]:
    """The folders of the ZMQ ipc sockets ``pid`` has open (its ``kvserve-ipc-*``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
    rows = (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
    return {Path(r[7]).parent for r in rows
            if len(r) > 7 and r[6] in inodes and "kvserve-ipc-" in r[7]}


def is_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pid: int, timeout_s: float) -> float:
    start = time.monotonic()
    while not is_gone(pid):
        assert time.monotonic() - start < timeout_s, f"process {pid} still alive"
        time.sleep(0.05)
    return time.monotonic() - start


def signal_and_wait(server: LiveServer, sig: signal.Signals) -> tuple[int, float]:
    """Send ``sig``; returns (exit code, seconds to exit)."""
    start = time.monotonic()
    server.proc.send_signal(sig)
    try:
        code = server.proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise AssertionError(f"no exit {EXIT_TIMEOUT_S} s after {sig.name}:\n"
                             f"{server.logs()}") from None
    return code, time.monotonic() - start


@dataclass
class Stream:
    """One streamed reply as read by a client."""

    status: int = 0
    events: list[str] = field(default_factory=list)  # payloads of the data: lines
    first_event: asyncio.Event = field(default_factory=asyncio.Event)
    headers: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def payloads(self) -> list[dict]:
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return [json.loads(e) for e in self.events[:-1]]

    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for p in self.payloads for c in p.get("choices", [])
                   if c["finish_reason"] is not None]
        assert len(reasons) == 1, self.events[-3:]
        return reasons[0]

    async def read(self, client: httpx.AsyncClient, path: str, body: dict) -> None:
        async with client.stream("POST", path, json=body) as response:
            self.status = response.status_code
            self.headers.set()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.first_event.set()


def started(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, *flags: str
            ) -> LiveServer:
    return start_server(model_dir, tmp_path_factory.mktemp("logs"), *flags)


def test_sigint_stops_both_processes(model_dir, tmp_path_factory) -> None:
    server = started(model_dir, tmp_path_factory)
    engine = engine_pid(server)
    code, seconds = signal_and_wait(server, signal.SIGINT)
    assert code == 0, server.logs()
    wait_gone(engine, 5.0)
    print(f"\nSIGINT (idle): exit 0 after {seconds:.1f} s")


def test_sigterm_ends_open_requests_with_abort_and_stops_both_processes(
        model_dir, tmp_path_factory) -> None:
    # One request runs at a time: three more wait behind one that needs thousands of
    # decode steps, so they are all still open when the grace period ends.
    server = started(model_dir, tmp_path_factory, "--max-running-requests", "1",
                     "--context-length", "4096", "--max-total-tokens", "8192")
    engine = engine_pid(server)

    async def scenario() -> tuple[list[Stream], httpx.Response, int, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            streams = [Stream() for _ in range(3)]
            tasks = []
            for s in streams:  # in order: the first one runs, the others wait
                tasks.append(asyncio.create_task(s.read(client, "/v1/completions",
                                                        LONG_STREAM)))
                await asyncio.wait_for(s.headers.wait(), 30)
            await asyncio.wait_for(streams[0].first_event.wait(), 30)  # it is decoding
            plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
            while await gauge(client, "kvserve:num_queue_reqs") < 3:
                await asyncio.sleep(0.02)
            code, seconds = await asyncio.to_thread(signal_and_wait, server, signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), 5)  # already over: no hang
            return streams, await asyncio.wait_for(plain, 5), code, seconds

    streams, plain, code, seconds = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert code == 0, server.logs()
    wait_gone(engine, 5.0)
    for s in streams:
        assert s.status == 200
        usage = s.payloads[-1]["usage"]
        assert s.finish_reason() in ("abort", "length"), s.events[-3:]
        if s.finish_reason() == "length":
            assert usage["completion_tokens"] == LONG["max_tokens"]
    assert [s.finish_reason() for s in streams[1:]] == ["abort", "abort"]
    assert all(s.payloads[-1]["usage"]["completion_tokens"] == 0 for s in streams[1:])
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "abort"
    print(f"\nSIGTERM with 4 open requests: exit 0 after {seconds:.1f} s, running stream "
          f"ended with {streams[0].finish_reason()!r}")


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith((name + " ", name + "{")))  # with the model_name label


def test_engine_death_answers_open_requests_and_then_503(model_dir, tmp_path_factory) -> None:
    server = started(model_dir, tmp_path_factory, "--context-length", "4096",
                     "--max-total-tokens", "16384")
    engine = engine_pid(server)

    async def scenario() -> tuple[Stream, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            stream = Stream()
            task = asyncio.create_task(stream.read(client, "/v1/completions", LONG_STREAM))
            await asyncio.wait_for(stream.first_event.wait(), 30)
            plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
            while await gauge(client, "kvserve:num_running_reqs") < 2:
                await asyncio.sleep(0.02)
            killed_at = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            await asyncio.wait_for(task, 10)
            reply = await asyncio.wait_for(plain, 10)
            return stream, reply, time.monotonic() - killed_at

    stream, reply, seconds = asyncio.run(asyncio.wait_for(scenario(), 90))
    error = stream.payloads[-1]["error"]
    assert error["code"] == 503 and error["type"] == "server_error", error
    assert "engine" in error["message"]
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == 503
    print(f"\nengine killed: both open requests answered within {seconds * 1000:.0f} ms")

    health = server.get("/health")
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    assert server.post("/v1/completions", json={**LONG, "max_tokens": 4}).status_code == 503
    assert server.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
        "stream": True}).status_code == 503
    assert server.post("/generate", json={"text": "hi"}).status_code == 503
    assert server.get("/metrics").status_code == 200  # the HTTP side still answers
    assert server.get("/v1/models").status_code == 200
    code, _ = signal_and_wait(server, signal.SIGTERM)
    assert code == 0, server.logs()


def test_http_process_killed_engine_exits_on_its_own(model_dir, tmp_path_factory) -> None:
    server = started(model_dir, tmp_path_factory, "--context-length", "4096",
                     "--max-total-tokens", "8192")
    engine = engine_pid(server)
    kids = children(server.proc.pid)  # the engine and the resource tracker
    left_behind = ipc_dirs(server.proc.pid)  # a SIGKILL leaves no time to remove them
    assert left_behind, "no kvserve-ipc-* sockets found"
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG_STREAM,
                      timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
        server.proc.kill()  # mid-stream: the engine is busy
        server.proc.wait(timeout=10)
    seconds = wait_gone(engine, 20.0)
    for pid in kids:
        wait_gone(pid, 10.0)
    for folder in left_behind:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nHTTP process killed: engine gone {seconds:.1f} s later")
