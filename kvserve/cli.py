"""The ``kvserve`` command line: ``kvserve bench prefix-cache [TRACE] ...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    w1 = bench.add_parser(
        "prefix-cache",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="W1: replay prompts through the RadixCache and paged allocator",
        description="W1 prefix-cache replay. Without TRACE, a built-in synthetic "
        "multi-turn chat workload with shared system prompts is used.",
    )
    w1.add_argument("trace", nargs="?", help="Mooncake hash-id trace (.jsonl)")
    w1.add_argument("--block", type=_positive, default=16, help="tokens per trace hash id")
    w1.add_argument("--page", type=_positive, default=16, help="KV page size in tokens")
    w1.add_argument("--cap", type=_positive, default=200_000, help="KV pool capacity in tokens")
    w1.add_argument("--limit", type=_non_negative, default=0, help="only the first N rows")
    w1.add_argument("--repeat", type=_positive, default=1, help="runs (one line each)")
    return parser


def _bench_prefix_cache(args: argparse.Namespace) -> int:
    from kvserve.bench.prefix_cache import build_cache, replay
    from kvserve.bench.workloads import load_mooncake_prompts, synthetic_multiturn_prompts

    if args.trace:
        try:
            prompts = load_mooncake_prompts(args.trace, args.block, args.limit)
        except (OSError, ValueError) as err:
            print(f"kvserve: cannot read trace: {err}", file=sys.stderr)
            return 2
        source = args.trace
    else:
        prompts = synthetic_multiturn_prompts()
        if args.limit:
            prompts = prompts[: args.limit]
        source = "built-in synthetic multi-turn chat (8 system prompts, 400 conversations)"
    if args.cap < args.page:
        print(f"kvserve: --cap {args.cap} holds no page of {args.page} tokens", file=sys.stderr)
        return 2
    tree = build_cache(args.cap, args.page)
    print(
        f"workload: {source}; cache={type(tree).__name__} "
        f"allocator={type(tree.pools.allocator).__name__} page={args.page} cap={args.cap}",
        file=sys.stderr,
    )
    for _ in range(args.repeat):
        print(replay(prompts, args.page, args.cap).line(), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "prefix-cache":
        return _bench_prefix_cache(args)
    return 2  # unreachable: argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
