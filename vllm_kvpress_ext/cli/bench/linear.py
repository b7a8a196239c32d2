"""`kvpress bench linear`: the model's projections through `F.linear` (MKL) and through oneDNN."""

from __future__ import annotations

import argparse
import sys

from vllm_kvpress_ext.cli.common import Subparsers, int_list


def register(bench_sub: Subparsers) -> None:
    lb = bench_sub.add_parser(
        "linear",
        help="the model's projections through F.linear vs oneDNN (what models/linear.py chose), per row count",
        description="One pass over every projection of every layer of the model, with its own weights, in "
        "forward order, per row count: torch's F.linear against the oneDNN path the engine uses on the CPU and, "
        "where oneDNN runs the dtype, oneDNN on the weights packed into its own layout (the path of vLLM's "
        "runner under the plugin), interleaved, median of --repeats; milliseconds, their ratios and GFLOP/s.",
    )
    lb.add_argument("--model", default="smollm2-135m", help="model directory, .gguf file or catalog name")
    lb.add_argument(
        "--rows", type=int_list, default=(1, 16, 64, 512, 2048), help="token rows per call (default: 1,16,64,512,2048)"
    )
    lb.add_argument("--repeats", type=int, default=5, help="timed passes per row count and op (default: 5)")
    lb.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    lb.add_argument("--head", action="store_true", help="the vocabulary head too (the embedding where it is tied)")
    lb.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.linear_bench import LinearBenchConfig, run_linear_bench
    from vllm_kvpress_ext.cli.models import resolve_model_arg

    args.model, ok = resolve_model_arg(args.model, "kvpress bench linear")
    if not ok:
        return 1
    try:
        run_linear_bench(
            LinearBenchConfig(model=args.model, rows=args.rows, repeats=args.repeats, dtype=args.dtype, head=args.head)
        )
    except ValueError as exc:
        print(f"kvpress bench linear: {exc}", file=sys.stderr)
        return 2
    return 0
