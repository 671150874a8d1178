#!/usr/bin/env bash
# Set up, then run lint, type check and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kvserve tests benchmarks
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest ran no test: failing" >&2
  exit 1
fi
exit "$rc"
