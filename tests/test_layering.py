"""The one-way import rule: ``mem`` <- ``kv`` <- ``cache`` <- ``sched``, and ``model``
beside ``sched``; both meet only in ``kvserve.forward``. Each case imports a package in
a fresh interpreter and lists the kvserve packages that came with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_packages(module: str) -> set[str]:
    code = (f"import json, sys\nimport {module}\n"
            "print(json.dumps(sorted({m.split('.')[1] for m in sys.modules "
            "if m.startswith('kvserve.') and m.count('.') >= 1})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return set(json.loads(done.stdout))


@pytest.mark.parametrize(("module", "forbidden"), [
    ("kvserve.model.runner", {"sched", "engine", "server", "cache"}),
    ("kvserve.model.cuda_graph", {"sched", "engine", "server", "cache"}),
    ("kvserve.forward", {"sched", "model", "cache", "kv", "mem", "engine", "server"}),
    ("kvserve.mem", {"sched", "model", "cache", "kv", "engine", "server"}),
    ("kvserve.kv", {"sched", "model", "cache", "engine", "server"}),
    ("kvserve.cache", {"sched", "model", "engine", "server"}),
])
def test_import_does_not_pull_in_higher_layers(module: str, forbidden: set[str]):
    loaded = _loaded_packages(module)
    assert not loaded & forbidden, f"{module} imports {sorted(loaded & forbidden)}"
