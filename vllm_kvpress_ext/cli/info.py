"""`kvpress info`, `kvpress demo` and `kvpress policies`: what the package has and what it does."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers


def register(sub: Subparsers) -> None:
    info = sub.add_parser(
        "info",
        aliases=["env"],
        help="print versions, devices, CPU features and the CPU paths chosen here (paste it into a bug report)",
        description="Versions (torch, triton, CUDA devices), this CPU's vector features, and the paths chosen "
        "for them once per process: ATen's kernels, oneDNN or F.linear per dtype for the projections, the C++ "
        "kernels' build, transparent huge pages; and the environment variables that change those choices.",
    )
    info.set_defaults(handler=run_info)

    demo = sub.add_parser(
        "demo",
        help="show a paged per-head cache freeing memory when a keep plan is applied",
        description="Fill the paged per-head KV pool with synthetic requests, apply a per-head keep plan, "
        "and print the pool's used pages before and after: the memory really comes back.",
    )
    demo.add_argument("--requests", type=int, default=4, help="number of synthetic requests (default: 4)")
    demo.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    demo.add_argument("--keep-ratio", type=float, default=0.25, help="mean fraction of tokens kept (default: 0.25)")
    demo.set_defaults(handler=run_demo)

    policies = sub.add_parser(
        "policies",
        help="list every registered compression policy with its defaults",
        description="Every policy is usable by name (e.g. --kv-policy snapkv), by a YAML preset path, or as "
        "{'name': ..., params} per request.",
    )
    policies.set_defaults(handler=run_policies)


def run_info(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.engine.environment import environment_report

    print(environment_report())
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.cache_demo import run_demo

    run_demo(num_requests=args.requests, prompt_len=args.prompt_len, keep_ratio=args.keep_ratio)
    return 0


def run_policies(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.policies import create_policy, policy_class, policy_names

    rows = []
    for name in policy_names():
        defaults = ", ".join(f"{k}={v}" for k, v in create_policy(name).params().items()) or "-"
        rows.append([name, policy_class(name).summary, defaults])
    print(format_table(["policy", "what it does", "defaults"], rows))
    return 0
