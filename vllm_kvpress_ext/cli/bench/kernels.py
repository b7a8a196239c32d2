"""`kvpress bench kernels`: GPU kernel bandwidth and speedups over dense attention; `--compile-only`, every
GPU kernel compiled and its resources checked on a machine without a GPU."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, float_list, int_list


def register(bench_sub: Subparsers) -> None:
    bk = bench_sub.add_parser(
        "kernels",
        help="GPU only: decode bandwidth vs device copy, speedups over dense SDPA, each kernel against its floor",
        description="Needs a CUDA device and triton (exits with status 2 otherwise). Measures the device copy "
        "bandwidth, the Triton decode kernel's effective bandwidth (kept K/V bytes / time) as a share of it, decode "
        "speedup over dense SDPA on the unpruned cache at several retentions, vertical-slash prefill speedup "
        "over dense causal SDPA, and decode, KV write, compaction and window scores each against its floor "
        "(max of bytes / copy bandwidth and FLOPs / measured matmul peak). CUDA-event timing, warm-up, medians.",
    )
    bk.add_argument("--requests", type=int, default=32, help="decode batch (default: 32)")
    bk.add_argument("--kept-tokens", type=int, default=8192, help="mean kept tokens per head (default: 8192)")
    bk.add_argument("--full-context", type=int, default=16384, help="unpruned tokens per head (default: 16384)")
    bk.add_argument("--retentions", type=float_list, default=(0.1, 0.25, 0.5), help="default: 0.1,0.25,0.5")
    bk.add_argument("--prefill-lens", type=int_list, default=(32768, 65536, 131072), help="default: 32768,65536,131072")
    bk.add_argument("--admission", type=float, default=0.25, help="admitted fraction in prefill (default: 0.25)")
    bk.add_argument("--window", type=int, default=1024, help="vertical-slash local band (default: 1024)")
    bk.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"), help="default: float16")
    bk.add_argument("--repeats", type=int, default=10, help="timed calls per decode point, median (default: 10)")
    bk.add_argument("--heads", default="32/8", help="query heads / KV heads (default: 32/8, Llama-3-8B)")
    bk.add_argument("--head-dim", type=int, default=128, help="default: 128")
    bk.add_argument(
        "--floor-lens",
        type=int_list,
        default=(8192, 32768),
        help="tokens per head for the kernels-against-their-floor table (default: 8192,32768)",
    )
    bk.add_argument("--cuda-ext", action="store_true", help="also build and time the CUDA decode kernel in csrc/")
    build = bk.add_argument_group(
        "compile only (no GPU needed)",
        "--compile-only compiles every Triton kernel for --arch at the shapes and dtypes the engine launches, and "
        "the CUDA extension for --cuda-arches with nvcc, and prints each kernel's registers, spills and shared "
        "memory; exit status 1 if one fails to compile, spills or exceeds a limit (bench/kernel_build.py).",
    )
    build.add_argument("--compile-only", action="store_true", help="compile and report; run nothing")
    build.add_argument("--arch", type=int, default=90, help="Triton target compute capability (default: 90)")
    build.add_argument("--cuda-arches", type=int_list, default=(80, 90), help="nvcc targets for csrc/ (default: 80,90)")
    build.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: the CPU count)"
    )
    build.add_argument("--out", type=Path, default=None, help="also write kernel_build.json and .md here")
    bk.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.compile_only:
        from vllm_kvpress_ext.bench.kernel_build import run_kernel_build

        if args.jobs < 1:
            print("kvpress bench kernels: --jobs must be >= 1", file=sys.stderr)
            return 2
        return run_kernel_build(args.arch, tuple(args.cuda_arches), jobs=args.jobs, out=args.out)
    from vllm_kvpress_ext.bench.kernels_bench import (
        KernelsBenchConfig,
        KernelsBenchUnavailableError,
        run_kernels_bench,
    )

    try:
        num_q_heads, num_kv_heads = (int(x) for x in args.heads.split("/"))
        if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError
    except ValueError:
        print(f"kvpress bench kernels: --heads must be Q/KV with KV dividing Q, got {args.heads!r}", file=sys.stderr)
        return 2
    config = KernelsBenchConfig(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=args.head_dim,
        floor_lens=args.floor_lens,
        requests=args.requests,
        kept_tokens=args.kept_tokens,
        full_context=args.full_context,
        retentions=args.retentions,
        prefill_lens=args.prefill_lens,
        admission=args.admission,
        window=args.window,
        dtype=args.dtype,
        repeats=args.repeats,
        cuda_ext=args.cuda_ext,
    )
    try:
        run_kernels_bench(config)
    except KernelsBenchUnavailableError as exc:
        print(f"kvpress bench kernels: {exc}", file=sys.stderr)
        return 2
    return 0
