#!/usr/bin/env bash
# W1 and W2 for two checkouts, interleaved A B A B in one script (machine noise here is
# as large as the differences looked for). Usage, from the project root:
#   bash benchmarks/compare_commits.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]
# Each checkout is a work tree (git worktree add --detach /tmp/old <commit>); both run
# with this project's .venv and PYTHONPATH pointing at the checkout. Output: one line
# per run, prefixed with the checkout's commit. REPLAY=0 skips the full-trace replay
# (minutes per run; its counts are deterministic), for more rounds of the fast points.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
TRACE=$PWD/../shared/data/traces/mooncake_conversation_trace.jsonl
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); ROUNDS=${3:-2}
run() {  # checkout, bench args...
  local dir=$1; shift
  local commit; commit=$(git -C "$dir" rev-parse --short HEAD)
  (cd "$dir" && PYTHONPATH=$dir "$PY" -m kvserve.cli bench "$@" 2>/dev/null | grep -v '^#' \
     | sed "s/^/$commit $1 /")
}
for _ in $(seq "$ROUNDS"); do
  for dir in "$OLD" "$NEW"; do
    for point in "16 200000" "16 2000000" "24 200000" "24 2000000"; do
      set -- $point
      run "$dir" prefix-cache "$TRACE" --block "$1" --cap "$2"
    done
    run "$dir" decode-steady --batch 256
    run "$dir" decode-steady --batch 256 --cached-tokens 100000
    if [ "${REPLAY:-1}" != 0 ]; then
      run "$dir" replay "$TRACE" --model scripted --no-progress
    fi
  done
done
