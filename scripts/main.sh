#!/usr/bin/env bash
# Set up, then run the main job on the embedded default workload: the W1
# prefix-cache replay of a built-in synthetic multi-turn chat (shared system
# prompts) through kvserve's RadixCache and paged allocator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve bench prefix-cache "$@"
