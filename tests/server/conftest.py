"""A live ``kvserve serve`` in a subprocess, on a free loopback port, for HTTP tests.

    def test_x(server):                   # module-scoped default server (strict checks)
        r = server.post("/v1/completions", json={...})
        server.assert_clean()             # /debug/check: idle, zero violations, pools full

``start_server(model_dir, *flags)`` starts one with other flags; ``stop()`` sends
SIGTERM and asserts a clean exit of both processes.
"""

from __future__ import annotations

import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve.model.init import init_model
from kvserve.server.process import ServerProcess, ServerStartError

MODEL_NAME = "tiny"  # --served-model-name of the test servers
_SERVER_NUMBERS = itertools.count()  # names the log files


@dataclass
class LiveServer:
    process: ServerProcess
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.process.proc is not None
        return self.process.proc

    @property
    def log(self) -> Path:
        return self.process.log_path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kw)  # type: ignore[arg-type]

    def post(self, path: str, **kw: object) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers, timeout=60, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with labels: value} for the kvserve: samples,
        without the ``model_name`` label every series has (its value is MODEL_NAME)."""
        text = self.get("/metrics").text
        label = f'model_name="{MODEL_NAME}"'
        samples = (line.rsplit(" ", 1) for line in text.splitlines()
                   if line.startswith("kvserve:"))
        return {name.replace("{" + label + "}", "").replace(label + ",", ""): float(value)
                for name, value in samples}

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
        code = self.process.stop(timeout)
        if self.process.killed:
            raise AssertionError(f"server did not exit on SIGTERM:\n{self.logs()}")
        assert code is not None
        return code


def start_server(model_dir: Path, log_dir: Path, *flags: str, api_key: str | None = None,
                 startup_timeout: float = 120) -> LiveServer:
    flags = ("--model", str(model_dir), "--served-model-name", MODEL_NAME,
             "--enable-debug-endpoints", *flags, *(("--api-key", api_key) if api_key else ()))
    process = ServerProcess(list(flags), log_dir / f"server-{next(_SERVER_NUMBERS)}.log")
    try:
        process.start(startup_timeout)
    except ServerStartError as err:
        raise AssertionError(str(err)) from None
    return LiveServer(process, api_key)


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
