#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: start `kvserve serve` on the
# tiny default model, send a built-in multi-turn chat workload with shared system
# prompts through the official openai client (128 conversations x 6 turns, 16 at once,
# streaming), print throughput, TTFT/ITL percentiles, prefix hit ratio and the
# invariant checker's verdict, write reports/chat-<time>/ (summary.json, summary.md,
# timeline.png, timeline.csv, requests.jsonl, server.log), and stop the server. Arguments go to
# `kvserve bench chat` (--url, --model, --conversations, --turns, --concurrency,
# --max-tokens, --report-dir; see --help). Exit 0 only when no request failed and
# the checker was clean.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve bench chat "$@"
