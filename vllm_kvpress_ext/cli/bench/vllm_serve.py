"""`kvpress bench vllm-serve`: vLLM's serving bench against `vllm serve` with the plugin and `kvpress serve`."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers


def register(bench_sub: Subparsers) -> None:
    bv = bench_sub.add_parser(
        "vllm-serve",
        help="vLLM's `vllm bench serve` (random dataset) against `vllm serve` with the plugin and `kvpress serve`",
        description="Per server and policy: starts the server on 127.0.0.1 with --num-pages KV pages, runs "
        "`vllm bench serve --dataset-name random` (chat, --ignore-eos) against it, and prints requests/s, TTFT, "
        "ITL and the peak number of requests the pool let run at once (kvpress_requests_running_peak). Needs the "
        "[vllm] extra.",
    )
    bv.add_argument("--servers", default="vllm,kvpress", help="default: vllm,kvpress")
    bv.add_argument("--policies", default="full,snapkv,gvote", help="default: full,snapkv,gvote")
    bv.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    bv.add_argument("--num-pages", type=int, default=1320, help="KV pool of every server, in pages (default: 1320)")
    bv.add_argument("--num-prompts", type=int, default=24, help="requests per run (default: 24)")
    bv.add_argument("--input-len", type=int, default=512, help="random prompt tokens (default: 512)")
    bv.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    bv.add_argument("--max-concurrency", type=int, default=24, help="requests in flight at once (default: 24)")
    bv.add_argument("--max-num-seqs", type=int, default=32, help="servers' --max-num-seqs (default: 32)")
    bv.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    bv.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bv.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.vllm_serve_bench import VllmServeBenchConfig, run_vllm_serve_bench

    run_vllm_serve_bench(
        VllmServeBenchConfig(
            servers=tuple(s for s in args.servers.split(",") if s),
            policies=tuple(p for p in args.policies.split(",") if p),
            model=args.model,
            num_pages=args.num_pages,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            out=args.out,
        )
    )
    return 0
