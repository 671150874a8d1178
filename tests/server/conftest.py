"""A live ``kvserve serve`` in a subprocess, on a free loopback port, for HTTP tests.

    def test_x(server):                   # module-scoped default server (strict checks)
        r = server.post("/v1/completions", json={...})
        server.assert_clean()             # /debug/check: idle, zero violations, pools full

``start_server(model_dir, *flags)`` starts one with other flags; ``stop()`` sends
SIGTERM and asserts a clean exit of both processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve.model.init import init_model

MODEL_NAME = "tiny"  # --served-model-name of the test servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kw)  # type: ignore[arg-type]

    def post(self, path: str, **kw: object) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers, timeout=60, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with labels: value} for the kvserve: samples."""
        text = self.get("/metrics").text
        return {name: float(value) for name, value in
                (line.rsplit(" ", 1) for line in text.splitlines()
                 if line.startswith("kvserve:"))}

    def check(self) -> dict:
        r = self.get("/debug/check")
        assert r.status_code == 200, r.text
        return r.json()

    def assert_clean(self) -> dict:
        """Idle, zero violations, every KV token free or in the evictable cache."""
        report = self.check()
        assert report["ok"], report["violations"]
        assert report["idle"], report
        kv = report["pools"]["kv_tokens"]
        assert kv["available"] + kv["evictable"] == kv["total"], kv
        assert report["pools"]["rows"]["free"] == report["pools"]["rows"]["size"]
        return report

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, wait; returns the exit code (both processes must be gone)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not exit on SIGTERM:\n{self.logs()}") from None


def start_server(model_dir: Path, log_dir: Path, *flags: str, api_key: str | None = None,
                 startup_timeout: float = 120) -> LiveServer:
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--served-model-name", MODEL_NAME, "--enable-debug-endpoints",
           *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log, api_key)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.logs()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"server not healthy after {startup_timeout} s:\n{server.logs()}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("server-ckpt") / "tiny-llama", "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Strict checks after every step, a 4,096-token pool, context 512."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs"), "--strict-checks",
                       "--max-total-tokens", "4096", "--context-length", "512",
                       "--chunked-prefill-size", "64")
    yield srv
    code = srv.stop()
    assert code == 0, srv.logs()
