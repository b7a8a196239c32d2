"""`kvpress bench policies`: compression time as a share of prefill, and retention, per policy."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, at_least, int_list


def register(bench_sub: Subparsers) -> None:
    pol = bench_sub.add_parser(
        "policies",
        help="compression time as a share of prefill, and retention, per policy",
        description="For each policy and prompt length: prefill time, compression time and its share of "
        "prefill, the whole cost over an uncompressed request (prefill + compression - full's prefill, over "
        "full's prefill; `full` always runs first as that baseline), decode-hook time per step, retention and KV "
        "bytes held (from the pool). Without --model, the random-weight bench model is used.",
    )
    pol.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    pol.add_argument("--policies", default=None, help="comma-separated policy names (default: all registered)")
    pol.add_argument("--prompt-lens", type=int_list, default=(2048, 8192), help="default: 2048,8192")
    pol.add_argument("--decode-steps", type=int, default=8, help="decode steps after prefill (default: 8)")
    pol.add_argument(
        "--repeats",
        type=at_least(1),
        default=1,
        help="runs per request; the fastest is reported, steadier on a busy machine (default: 1)",
    )
    pol.add_argument(
        "--profile",
        action="store_true",
        help="also profile each policy's compression at the longest prompt: device time, kernel launches, host "
        "syncs and the host ops with most self time",
    )
    pol.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    pol.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    pol.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.policies_bench import PoliciesBenchConfig, run_policies_bench

    run_policies_bench(
        PoliciesBenchConfig(
            model=args.model,
            policies=tuple(args.policies.split(",")) if args.policies else (),
            prompt_lens=args.prompt_lens,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            profile=args.profile,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0
