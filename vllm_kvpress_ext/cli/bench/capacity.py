"""`kvpress bench capacity`: requests held at once and tokens/s in one fixed KV pool, per policy."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, add_model_or_shape, at_least, size


def register(bench_sub: Subparsers) -> None:
    cap = bench_sub.add_parser(
        "capacity",
        help="requests held at once and output tokens/s in one fixed KV pool, per policy",
        description="Queue --requests prompts of --prompt-len random tokens at once on one engine with a fixed "
        "KV pool; per policy (at --ratio of the prompt where it has a budget): the most requests holding pages "
        "at once, output and decode tokens/s, retention, KV bytes per request and preemptions. Without --model, "
        "a random-weight model of --shape is written to a temporary directory.",
    )
    add_model_or_shape(cap)
    cap.add_argument("--policies", default="full,snapkv,gvote,wgkv", help="default: full,snapkv,gvote,wgkv")
    cap.add_argument("--ratio", type=float, default=0.25, help="fraction of the prompt kept (default: 0.25)")
    cap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens per request (default: 2048)")
    cap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per request (default: 32)")
    cap.add_argument("--requests", type=int, default=16, help="requests (prompts) queued at once (default: 16)")
    cap.add_argument(
        "--samples",
        type=at_least(1),
        default=1,
        help="sampled answers per prompt; with more than 1, each policy runs with the samples sharing the "
        "prompt's compressed pages and as separate requests (default: 1)",
    )
    cap.add_argument("--kv-memory", type=size, default=64 * 2**20, metavar="SIZE", help="KV pool (default: 64MiB)")
    cap.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="prompt tokens per prefill step (default: 8192)"
    )
    cap.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    cap.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    cap.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.capacity import CapacityConfig, run_capacity_bench

    run_capacity_bench(
        CapacityConfig(
            model=args.model,
            shape=args.shape,
            policies=tuple(args.policies.split(",")),
            ratio=args.ratio,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            requests=args.requests,
            kv_memory=args.kv_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
            samples=args.samples,
        )
    )
    return 0
