"""`kvpress bench decode-step`: a decode step of the engine against its floor, and where the rest goes."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, add_model_or_shape, at_least


def register(bench_sub: Subparsers) -> None:
    ds = bench_sub.add_parser(
        "decode-step",
        help="one decode step against its floor (weights + kept K/V over copy bandwidth), with a profile",
        description="Prefill --batch prompts of --prompt-len random tokens, compress them with each policy (at "
        "--ratio where it has a budget), then time --steps decode steps of the whole batch. The floor is the bytes "
        "a step must read (every weight, the embedding only for the batch's rows, every kept K and V entry) over "
        "the device's copy bandwidth. A profile of --profile-steps more steps says where the rest goes: device "
        "busy time, kernel launches and host syncs per step, and the host ops with most self time. Without "
        "--model, a random-weight model of --shape is written to a temporary directory.",
    )
    add_model_or_shape(ds)
    ds.add_argument("--policies", default="full,snapkv", help="default: full,snapkv")
    ds.add_argument("--ratio", type=float, default=0.25, help="fraction of the prompt kept (default: 0.25)")
    ds.add_argument("--batch", type=at_least(1), default=8, help="requests decoding together (default: 8)")
    ds.add_argument("--prompt-len", type=at_least(1), default=2048, help="prompt tokens per request (default: 2048)")
    ds.add_argument("--steps", type=at_least(1), default=16, help="timed decode steps, median (default: 16)")
    ds.add_argument("--profile-steps", type=at_least(0), default=3, help="profiled steps, 0 for none (default: 3)")
    ds.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="prompt tokens per prefill step (default: 8192)"
    )
    ds.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    ds.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    ds.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.decode_step import DecodeStepConfig, run_decode_step_bench

    run_decode_step_bench(
        DecodeStepConfig(
            model=args.model,
            shape=args.shape,
            policies=tuple(args.policies.split(",")),
            ratio=args.ratio,
            batch=args.batch,
            prompt_len=args.prompt_len,
            steps=args.steps,
            profile_steps=args.profile_steps,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0
