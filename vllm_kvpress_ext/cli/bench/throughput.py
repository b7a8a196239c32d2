"""`kvpress bench throughput`: prefill and decode tokens/s of the embedded engine."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, int_list


def register(bench_sub: Subparsers) -> None:
    throughput = bench_sub.add_parser(
        "throughput",
        help="prefill and decode tokens/s of the embedded engine",
        description="Prefill and decode tokens/s of the embedded engine at several batch sizes and prompt "
        "lengths. Without --model, a random-weight GQA Llama (4 layers, hidden 256, 8 heads, 2 KV heads) is "
        "written to a temporary directory and used.",
    )
    throughput.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    throughput.add_argument("--batch-sizes", type=int_list, default=(1, 4, 16), help="default: 1,4,16")
    throughput.add_argument("--prompt-lens", type=int_list, default=(128, 512), help="default: 128,512")
    throughput.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (default: 32)")
    throughput.add_argument("--repeats", type=int, default=2, help="runs per point, median reported (default: 2)")
    throughput.add_argument("--kv-policy", default=None, help="policy name or preset path (default: none)")
    throughput.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    throughput.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    throughput.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.throughput import ThroughputConfig, run_throughput_bench

    run_throughput_bench(
        ThroughputConfig(
            model=args.model,
            batch_sizes=args.batch_sizes,
            prompt_lens=args.prompt_lens,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            kv_policy=args.kv_policy,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0
