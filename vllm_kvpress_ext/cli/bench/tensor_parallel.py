"""`kvpress bench tensor-parallel`: the plugin on vLLM's runner at several tensor-parallel sizes, side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, int_list


def register(bench_sub: Subparsers) -> None:
    bt = bench_sub.add_parser(
        "tensor-parallel",
        help="the vLLM plugin at several tensor-parallel sizes and pipeline stages: throughput, KV bytes per "
        "worker, exchange cost",
        description="Per worker count (and pipeline stage count), an offline vllm.LLM on vLLM's runner over the "
        "plugin's pool (more than one worker: vLLM's multiprocessing executor, gloo) runs the same random prompts "
        "under each policy and prints requests/s, output tokens/s, the KV the requests held, each worker's pool "
        "high-water mark, and the bytes and seconds the policies' cross-head exchange took per compressed request "
        "against one request's prefill. Without --model, a random-weight GQA Llama (4 layers, hidden 256, 8 heads, "
        "2 KV heads) is written to a temporary directory. Needs the [vllm] extra.",
    )
    bt.add_argument("--model", default=None, help="model directory (default: the random bench model)")
    bt.add_argument("--workers", type=int_list, default=(1, 2), help="tensor-parallel sizes (default: 1,2)")
    bt.add_argument(
        "--stages",
        type=int_list,
        default=(1,),
        help="pipeline-parallel sizes, each run with every --workers size (default: 1)",
    )
    bt.add_argument("--policies", default="full,snapkv,adakv", help="default: full,snapkv,adakv")
    bt.add_argument("--num-prompts", type=int, default=16, help="requests, all at once (default: 16)")
    bt.add_argument("--input-len", type=int, default=512, help="random prompt tokens (default: 512)")
    bt.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: 32)")
    bt.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once (default: 16)")
    bt.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="each worker's pool, in pages of 16 tokens (default: room for --max-num-seqs uncompressed requests on "
        "one worker, so every worker count runs the whole batch at once)",
    )
    bt.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    bt.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bt.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.tensor_parallel_bench import TensorParallelBenchConfig, run_tensor_parallel_bench

    rows = run_tensor_parallel_bench(
        TensorParallelBenchConfig(
            model=args.model,
            workers=tuple(args.workers),
            stages=tuple(args.stages),
            policies=tuple(p for p in args.policies.split(",") if p),
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            max_num_seqs=args.max_num_seqs,
            num_pages=args.num_pages,
            seed=args.seed,
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
