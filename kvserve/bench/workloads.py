"""Benchmark workloads: Mooncake hash-id traces and a built-in synthetic multi-turn chat.

Prompt construction follows ``shared/bench/README.md`` (W1): hash id ``h`` expands
to the ``block`` tokens ``[h*block, h*block + block)``; a prompt is its blocks
concatenated, cut to ``ceil(input_length * block / 512)`` tokens (Mooncake blocks
are 512 tokens).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    timestamp_ms: int
    prompt_ids: list[int]
    output_length: int  # tokens, as in the trace


def read_mooncake(path: str | Path, block: int, limit: int = 0) -> list[MooncakeRequest]:
    """Rows of a Mooncake trace with their prompts expanded (``limit`` > 0: first rows).

    Raises FileNotFoundError, or ValueError naming the line for a malformed row.
    """
    out: list[MooncakeRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                length = -(-int(row["input_length"]) * block // MOONCAKE_BLOCK_TOKENS)
                tokens: list[int] = []
                for h in row["hash_ids"]:
                    tokens.extend(range(int(h) * block, int(h) * block + block))
                out.append(MooncakeRequest(int(row.get("timestamp", 0)), tokens[:length],
                                           int(row.get("output_length", 1))))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({err})") from err
    return out


def load_mooncake_prompts(path: str | Path, block: int, limit: int = 0) -> list[list[int]]:
    """Token-id prompts of a Mooncake trace (W1)."""
    return [r.prompt_ids for r in read_mooncake(path, block, limit)]


def synthetic_multiturn_prompts(
    num_conversations: int = 400,
    turns: int = 6,
    num_system_prompts: int = 8,
    seed: int = 0,
) -> list[list[int]]:
    """A built-in multi-turn chat workload with shared system prompts.

    Each conversation starts with one of ``num_system_prompts`` system prompts
    (300-1,200 tokens), then every turn re-sends the whole history plus a new
    user message (20-200 tokens) and the previous answer (30-300 tokens), as a
    chat client does. Conversations interleave in random order, keeping each
    one's turn order. Deterministic for a given seed.
    """
    rng = random.Random(seed)
    vocab = (1000, 30000)

    def run(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    systems = [run(rng.randrange(300, 1200)) for _ in range(num_system_prompts)]
    histories = [list(rng.choice(systems)) for _ in range(num_conversations)]
    remaining = [turns] * num_conversations
    prompts: list[list[int]] = []
    live = list(range(num_conversations))
    while live:
        conv = rng.choice(live)
        history = histories[conv]
        history += run(rng.randrange(20, 200))
        prompts.append(list(history))
        history += run(rng.randrange(30, 300))
        remaining[conv] -= 1
        if remaining[conv] == 0:
            live.remove(conv)
    return prompts
