"""The first five minutes of ``kvserve serve``: each step of the startup fails on its
own, in one line, with its exit status, before the next step starts; one ``ready``
line once ``/health`` answers; a stop says what it waits for.

    port in use        -> exit 3 before the model is even resolved
    no tokenizer       -> exit 4 naming the files, before the engine process starts
    no weights         -> exit 4, the engine's one-line reason, no traceback
    ready              -> one line with the URL, model, pool, page and context
    SIGTERM            -> "shutting down: N requests open, up to 4 s to finish ...", "stopped"
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvserve.server.launch import EXIT_ADDRESS, EXIT_MODEL
from kvserve.server.process import ServerProcess
from tests.server.conftest import MODEL_NAME
from tests.server.test_lifecycle import LONG_STREAM, Stream, children, wait_gone

EXIT_TIMEOUT_S = 60.0


def kvserve_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("kvserve: ")]


def run_serve(*flags: str, env: dict[str, str] | None = None,
              timeout_s: float = EXIT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``kvserve serve`` that is expected to exit on its own."""
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})


def wait_for_line(server: ServerProcess, prefix: str, timeout_s: float = 120.0) -> str:
    """The first log line starting with ``prefix``; fails if the server exits first."""
    deadline = time.monotonic() + timeout_s
    assert server.proc is not None
    while time.monotonic() < deadline:
        for line in server.log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        assert server.proc.poll() is None, server.log_path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"no line {prefix!r} after {timeout_s} s:\n"
                         f"{server.log_path.read_text()}")


@pytest.fixture
def listener():
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use_is_one_line_before_the_model_is_resolved(listener, tmp_path) -> None:
    # Without --model the default model would be resolved into KVSERVE_CACHE: that the
    # folder never appears shows the model was not touched, let alone the engine started.
    cache = tmp_path / "cache"
    proc = run_serve("--port", str(listener), env={"KVSERVE_CACHE": str(cache)})
    assert proc.returncode == EXIT_ADDRESS, proc.stderr
    assert proc.stderr == f"kvserve: port {listener} on 127.0.0.1 is in use\n"
    assert proc.stdout == ""
    assert not cache.exists()


def test_unknown_host_is_one_line() -> None:
    proc = run_serve("--host", "no-such-host.invalid", "--port", "0")
    assert proc.returncode == EXIT_ADDRESS, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("kvserve: cannot listen on no-such-host.invalid: ")


def test_folder_without_tokenizer_names_the_files_before_the_engine_starts(
        model_dir, tmp_path) -> None:
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, folder / name)
    proc = run_serve("--model", str(folder), "--port", "0")
    assert proc.returncode == EXIT_MODEL, proc.stderr
    assert proc.stderr.splitlines() == [
        f"kvserve: loading model no-tokenizer from {folder}",
        f"kvserve: cannot load model: no tokenizer in {folder}: expected tokenizer.json, or "
        "tokenizer_config.json with vocab.json+merges.txt or tokenizer.model (found: "
        "config.json, model.safetensors)"]


def test_folder_without_weights_is_one_line_without_traceback(model_dir, tmp_path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    proc = run_serve("--model", str(folder), "--port", "0")
    assert proc.returncode == EXIT_MODEL, proc.stderr
    assert proc.stderr.splitlines() == [
        f"kvserve: loading model no-weights from {folder}",
        f"kvserve: cannot load model: {folder} has no *.safetensors weights"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_engine_crash_at_startup_is_its_last_line_and_debug_adds_the_traceback(
        model_dir) -> None:
    # Not a ModelLoadError: the engine sends its traceback; the last line is the
    # message (without --log-level debug only that line is printed, as for no weights).
    proc = run_serve("--model", str(model_dir), "--port", "0", "--device", "cuda",
                     "--log-level", "debug")
    assert proc.returncode == EXIT_MODEL, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("kvserve: cannot load model: ") and "CUDA" in last, last


def test_signal_while_loading_stops_the_engine_and_exits_0(model_dir, tmp_path) -> None:
    server = ServerProcess(["--model", str(model_dir)], tmp_path / "server.log")
    server.launch()
    assert server.proc is not None
    wait_for_line(server, "kvserve: loading model")
    engines: list[int] = []
    while not engines:  # the engine process is spawned right after the tokenizer check
        engines = [c for c in children(server.proc.pid)
                   if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert server.proc.poll() is None, server.log_path.read_text()
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 0, server.log_path.read_text()
    wait_gone(engines[0], 5.0)
    assert kvserve_lines(server.log_path.read_text())[-2:] == [
        "kvserve: stopped while loading the model", "kvserve: stopped"]


@pytest.mark.parametrize("sig, times", [(signal.SIGINT, 1), (signal.SIGTERM, 1),
                                        (signal.SIGINT, 2)])
def test_signal_while_resolving_the_model_stops_cleanly_with_0(model_dir, tmp_path,
                                                               sig, times) -> None:
    """Before the engine starts (GGUF conversion, tokenizer check) SIGTERM stops as Ctrl-C
    does; it killed the process (status -15, no line, a conversion's half-written temporary
    folder left). A second Ctrl-C while the process exits killed it (status -2). The model
    folder's config.json is a FIFO: serve blocks reading it."""
    folder = tmp_path / "slow"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model",
                             str(folder), "--port", "0"], stderr=subprocess.PIPE, text=True)
    with open(folder / "config.json", "w"):  # returns once serve opened it to read
        proc.send_signal(sig)
        for _ in range(times - 1):
            time.sleep(0.2)
            proc.send_signal(sig)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert proc.stderr is not None and proc.stderr.read() == "kvserve: stopped\n"


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    """One request decodes at a time (so the others stay open); the port is checked
    as held while the model loads."""
    server = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL_NAME,
                            "--max-running-requests", "1", "--context-length", "4096",
                            "--max-total-tokens", "8192"],
                           tmp_path_factory.mktemp("logs") / "server.log")
    server.launch()
    wait_for_line(server, "kvserve: loading model")
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", server.port))
    assert taken.value.errno == errno.EADDRINUSE
    ready = wait_for_line(server, "kvserve: ready on ")
    health = httpx.get(server.url + "/health", timeout=5)  # at once: no retry
    yield server, ready, health
    server.stop()


def test_ready_line_once_and_health_answers_at_once(live) -> None:
    server, ready, health = live
    assert ready == (f"kvserve: ready on {server.url} (model {MODEL_NAME} with random "
                     "weights, KV pool 8192 tokens, page 16, context 4096)")
    assert health.status_code == 200
    lines = kvserve_lines(server.log_path.read_text())
    assert [line for line in lines if "ready" in line] == [ready]
    assert lines.index(ready) > 0 and lines[0].startswith("kvserve: loading model tiny")


def test_random_weights_in_every_info_endpoint(live) -> None:
    server, _, _ = live
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["random_weights"] is True
    assert httpx.get(server.url + "/get_model_info").json()["random_weights"] is True
    assert httpx.get(server.url + "/get_server_info").json()["random_weights"] is True


def test_sigterm_with_open_requests_says_what_it_waits_for(live) -> None:
    server, _, _ = live
    proc = server.proc
    assert proc is not None

    async def scenario() -> tuple[list[Stream], int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            streams = [Stream() for _ in range(3)]
            tasks = [asyncio.create_task(s.read(client, "/v1/completions", LONG_STREAM))
                     for s in streams]
            while (await client.get("/get_server_info")).json()["http_inflight"] < 3:
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, EXIT_TIMEOUT_S)
            await asyncio.wait_for(asyncio.gather(*tasks), 5)
            return streams, code

    streams, code = asyncio.run(asyncio.wait_for(scenario(), 90))
    log = server.log_path.read_text()
    assert code == 0, log
    assert [s.finish_reason() for s in streams[1:]] == ["abort", "abort"]  # never ran
    assert kvserve_lines(log)[-2:] == [
        "kvserve: shutting down: 3 requests open, up to 4 s to finish (then aborted; a "
        "second Ctrl-C aborts now)",
        "kvserve: stopped"]


def test_second_ctrl_c_aborts_open_requests_at_once_without_a_traceback(
        model_dir, tmp_path) -> None:
    """uvicorn's force exit on a second SIGINT cancelled its tasks mid-reply and printed a
    starlette CancelledError traceback; now the open requests end with "abort" at once."""
    server = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL_NAME],
                           tmp_path / "server.log")
    server.start()
    proc = server.proc
    assert proc is not None

    async def scenario() -> tuple[Stream, int, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            stream = Stream()
            task = asyncio.create_task(stream.read(client, "/v1/completions", LONG_STREAM))
            await asyncio.wait_for(stream.first_event.wait(), 30)
            proc.send_signal(signal.SIGINT)
            await asyncio.to_thread(wait_for_line, server, "kvserve: shutting down")
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = await asyncio.to_thread(proc.wait, EXIT_TIMEOUT_S)
            await asyncio.wait_for(task, 5)
            return stream, code, time.monotonic() - start

    stream, code, seconds = asyncio.run(asyncio.wait_for(scenario(), 90))
    log = server.log_path.read_text()
    assert code == 0, log
    # the second signal's own path ran (its line), not the grace period's timer; no
    # wall-clock bound (a loaded machine stops the engine slowly)
    assert "Traceback" not in log, (seconds, log)
    assert stream.finish_reason() == "abort"
    assert kvserve_lines(log)[-3:] == [
        "kvserve: shutting down: 1 request open, up to 4 s to finish (then aborted; a "
        "second Ctrl-C aborts now)",
        "kvserve: aborting 1 request open now", "kvserve: stopped"]


def test_tokenizer_that_does_not_round_trip_is_refused(tmp_path) -> None:
    # A word-level vocabulary of one unknown token: "Hello, world" encodes, but to
    # nothing that decodes back (the probe the server runs before it starts the engine).
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvserve.model.errors import ModelLoadError
    from kvserve.model.loader import load_tokenizer

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value) == (f"the tokenizer in {tmp_path} decodes 'Hello, world' back as "
                              "'[UNK] [UNK] [UNK]' (files: tokenizer.json, "
                              "tokenizer_config.json)")
