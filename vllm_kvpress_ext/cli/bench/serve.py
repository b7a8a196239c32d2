"""`kvpress bench serve`: HTTP load on `kvpress serve` (requests/s, TTFT, inter-token latency), per policy."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, policy_list


def register(bench_sub: Subparsers) -> None:
    bs = bench_sub.add_parser(
        "serve",
        help="HTTP load test of kvpress serve: requests/s, TTFT, inter-token latency, requests held, per policy",
        description="Streams completions against a server it starts on 127.0.0.1 (one per policy, all with the same "
        "--kv-memory) or against --url. Per policy: requests/s, TTFT and inter-token latency p50/p90/p99 (client "
        "side), and the peak number of requests holding KV pages at once (from the server's metrics). The run is "
        "bounded by --num-requests and --duration. Without --model, a random-weight bench model with the suite "
        "tokenizer is written to a temporary directory.",
    )
    bs.add_argument("--url", default=None, help="base URL of a running server (default: start one per policy)")
    bs.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    bs.add_argument(
        "--policies",
        type=policy_list,
        default=("full", "snapkv", "streaming_llm"),
        help="default: full,snapkv,streaming_llm",
    )
    bs.add_argument("--kv-memory", default="16MiB", help="KV pool of the servers this bench starts (default: 16MiB)")
    bs.add_argument("--num-requests", type=int, default=64, help="requests per policy (default: 64)")
    bs.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default: 32)")
    bs.add_argument("--duration", type=float, default=60.0, help="seconds per policy at most (default: 60)")
    bs.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    bs.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    bs.add_argument("--max-num-seqs", type=int, default=64, help="server's --max-num-seqs (default: 64)")
    bs.add_argument("--page-size", type=int, default=16, help="server's --page-size (default: 16)")
    bs.add_argument("--device", default="cpu", help="server's torch device (default: cpu)")
    bs.add_argument("--dtype", default="float32", help="server's model dtype (default: float32)")
    bs.add_argument("--seed", type=int, default=0, help="prompt and model seed (default: 0)")
    bs.add_argument(
        "--compare-vllm",
        action="store_true",
        help="run the same load against `vllm serve` (plugin) and `kvpress serve`, one after the other per policy, "
        "both driven by `vllm bench serve` (chat, random prompts, --ignore-eos), and print them side by side with "
        "the kvpress / vllm ratio; --model defaults to smollm2-135m (needs the [vllm] extra)",
    )
    bs.add_argument(
        "--num-pages",
        type=int,
        default=52000,
        help="with --compare-vllm: both servers' KV pool in pages (default: 52000, 16 uncompressed SmolLM2-135M "
        "requests of 576 tokens)",
    )
    bs.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bs.add_argument(
        "--shared-contexts",
        type=int,
        default=0,
        help="shared-context workload: this many contexts of --prompt-len tokens, each asked several questions "
        "with kv_prefix_tokens, run with prefix caching off and on (default: 0 = off; docs/prefix_reuse.md)",
    )
    bs.add_argument("--questions-per-context", type=int, default=8, help="questions per shared context (default: 8)")
    bs.add_argument("--question-len", type=int, default=16, help="tokens per question (default: 16)")
    bs.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="multi-turn workload: this many conversations of --turns turns on a --prompt-len context, each turn "
        "sending the history with the answers the server gave, run with prefix caching off, on (named context) "
        "and on with --prefix-matching auto (default: 0 = off; docs/prefix_reuse.md)",
    )
    bs.add_argument("--turns", type=int, default=4, help="turns per conversation (default: 4)")
    bs.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.serve_bench import ServeBenchConfig, run_serve_bench

    run_serve_bench(
        ServeBenchConfig(
            url=args.url,
            model=args.model,
            policies=args.policies,
            kv_memory=args.kv_memory,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            duration=args.duration,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            max_num_seqs=args.max_num_seqs,
            page_size=args.page_size,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            out=args.out,
            compare_vllm=args.compare_vllm,
            num_pages=args.num_pages,
            shared_contexts=args.shared_contexts,
            questions_per_context=args.questions_per_context,
            question_len=args.question_len,
            sessions=args.sessions,
            turns=args.turns,
        )
    )
    return 0
