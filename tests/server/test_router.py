"""Two ``kvserve serve`` workers behind sglang-router 0.3.2 (``--policy cache_aware``).

The router registers a worker after ``GET /health`` and reads ``/server_info`` and
``/model_info``; it forwards ``/v1/chat/completions``, ``/v1/completions`` and
``/generate`` to the same path (re-serializing bodies: ``max_tokens`` becomes
``max_completion_tokens`` for chat, defaults such as ``skip_special_tokens`` are added).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvserve.server.process import free_port
from tests.server.conftest import MODEL_NAME, start_server

pytest.importorskip("sglang_router", reason="sglang-router==0.3.2 is not installed "
                    "(pip install sglang-router==0.3.2 setproctitle)")


def _finished(worker) -> float:
    text = worker.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("kvserve:finished_reqs_total"))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def routed(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    workers = [start_server(model_dir, logs, "--max-total-tokens", "4096",
                            "--context-length", "512") for _ in range(2)]
    port = free_port()
    log = (logs / "router.log").open("wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
         *(w.url for w in workers), "--policy", "cache_aware", "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()),
         "--worker-startup-timeout-secs", "60"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # /readiness: 503 until a worker is healthy
            try:
                if httpx.get(url + "/readiness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, \
                (logs / "router.log").read_text()
            time.sleep(0.3)
        yield url, workers
    finally:
        router.terminate()
        router.wait(timeout=15)
        log.close()
        for w in workers:
            assert w.stop() == 0, w.logs()


def test_chat_completions_route_through_the_router_to_both_workers(routed):
    url, workers = routed
    before = [_finished(w) for w in workers]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def chat(i: int) -> tuple[str, int]:
        reply = client.chat.completions.create(
            model=MODEL_NAME, temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": f"conversation {i}: " + "tell me " * (i + 1)}])
        return reply.choices[0].finish_reason, reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(chat, range(16)))
    assert results == [("length", 8)] * 16
    stream = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=5, stream=True,
        messages=[{"role": "user", "content": "stream please"}])
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    done = client.completions.create(model=MODEL_NAME, prompt="plain completion",
                                     max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    native = httpx.post(url + "/generate", timeout=60,
                        json={"text": "native", "sampling_params": {"max_new_tokens": 3}})
    assert native.status_code == 200, native.text
    assert native.json()["meta_info"]["completion_tokens"] == 3
    served = [_finished(w) - b for w, b in zip(workers, before, strict=True)]
    assert sum(served) == 16 + 1 + 1 + 1
    assert all(n > 0 for n in served), served  # concurrent traffic spread over both
    for w in workers:
        w.assert_clean()
