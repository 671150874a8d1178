#!/usr/bin/env bash
# Create .venv (if missing) and install kvserve with its test tools.
# CPU torch comes first, from the pinned CPU build (torch==2.13.0), so that pip
# never pulls a multi-GB CUDA build; a machine that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" -m pip install -q -e ".[test]"
