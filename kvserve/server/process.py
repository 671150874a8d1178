"""``kvserve serve`` as a child process: free loopback port, log file, wait for
``/health``, stop with SIGTERM. Used by the main job (``kvserve bench chat``), the wire
benchmark and the HTTP tests. Imports nothing of the server itself (httpx lazily)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LOG_TAIL_LINES = 30  # lines of the server log quoted when it fails to start


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message quotes its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(text[-lines:]) or "(server log is empty)"


class ServerProcess:
    """``python -m kvserve.cli serve --port <free> *flags``, stdout and stderr to
    ``log_path``.

    Args:
        flags: further ``kvserve serve`` flags (``--model``, ``--enable-debug-endpoints``...).
        env: extra environment variables for the server.
        own_session: start it in a session of its own, so a terminal's Ctrl-C reaches
            only the caller (which then stops it).
    """

    def __init__(self, flags: list[str], log_path: Path, env: dict[str, str] | None = None,
                 own_session: bool = False) -> None:
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(self.port),
                    *flags]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.own_session = own_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False  # stop() had to SIGKILL it

    def start(self, timeout_s: float = 300.0) -> None:
        """``launch`` then ``wait_healthy``."""
        self.launch()
        self.wait_healthy(timeout_s)

    def launch(self) -> None:
        """Start the process and return at once (load something else meanwhile)."""
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=self.own_session)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Wait for GET /health == 200 (the server prints its ``ready`` line then; until
        the model is loaded the port refuses connections). Raises ServerStartError (after
        stopping it) when it exits first or is not healthy within ``timeout_s``."""
        import httpx

        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"the server exited with status {self.proc.returncode} before it was "
                    f"healthy; last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"the server was not healthy after {timeout_s:.0f} s; last "
                               f"lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait ``timeout_s`` (then SIGKILL, setting ``killed``); the exit
        status, None if never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
