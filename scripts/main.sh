#!/usr/bin/env bash
# Set up, then run the main job: start `kvserve serve` on its default model
# (SmolLM2-135M-Instruct), send the built-in multi-turn chats (24 real conversations x 4
# user turns under 4 shared system prompts, 12 at once, streaming, greedy, replies up to
# 64 tokens ending at end of turn or at the cap) through the official openai client,
# print the settings (date, commit, model, KV pool, page size, context, engine flags,
# machine), throughput, TTFT/ITL percentiles, prefix hit ratio, stop/length counts, the
# invariant checker's verdict and a few sample replies, write reports/chat-<time>/
# (summary.json, summary.md, timeline.png, timeline.csv, requests.jsonl with every
# request's text and reply, server.log), and stop the server. About 3-4 minutes on a
# 2-core CPU once set up. Arguments go to `kvserve bench chat` (--url, --model,
# --conversations, --turns, --concurrency, --max-tokens, --report-dir; see --help).
# Exit 0 only when no request failed and the checker was clean.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve bench chat "$@"
