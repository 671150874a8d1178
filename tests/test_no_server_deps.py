"""The GPU machine has torch and transformers but no FastAPI, uvicorn, pyzmq or
prometheus-client: ``import kvserve``, ``Engine`` and the CLI (all but ``serve``) must
work without them, and ``serve`` must say what is missing."""

from __future__ import annotations

import subprocess
import sys

_BLOCK = ("import sys\n"
          "for name in ('fastapi', 'uvicorn', 'zmq', 'prometheus_client', 'starlette', "
          "'openai', 'httpx', 'matplotlib'):\n"
          "    sys.modules[name] = None  # import raises ImportError\n")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True,
                          text=True, timeout=120)


def test_engine_and_cli_import_without_server_libraries():
    done = _run("import kvserve\nfrom kvserve import Engine, SamplingParams\n"
                "import kvserve.engine, kvserve.engine.messages, kvserve.engine.router\n"
                "import kvserve.cli\n"
                "kvserve.cli.build_parser().parse_args(['generate', 'hi'])\nprint('ok')\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_serve_without_server_libraries_names_the_missing_extra():
    done = _run("from kvserve.cli import main\nraise SystemExit(main(['serve']))\n")
    assert done.returncode == 2, done.stderr
    assert "kvserve[server]" in done.stderr and "Traceback" not in done.stderr
