"""`kvpress bench recall`: the share of the full cache's future decode attention each policy's kept set serves."""

from __future__ import annotations

import argparse
import sys

from vllm_kvpress_ext.cli.common import Subparsers, float_list, int_list
from vllm_kvpress_ext.cli.models import resolve_model_arg


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def register(bench_sub: Subparsers) -> None:
    rec = bench_sub.add_parser(
        "recall",
        help="future decode attention recovered by each policy's kept set, at equal memory (real model)",
        description="On a real model and the natural-language tasks (served protocol), the full cache answers "
        "each sample greedily; a dense forward over prompt + answer records the answer steps' attention over the "
        "prompt. Each policy compresses its own fork of the sample's prefill, and its kept set is scored against "
        "that attention: recall (share of the attention mass on kept entries) and output error (relative change "
        "of the attention output when only kept entries are read), mean and 95%% interval over samples. --match "
        "runs a ratio-budgeted policy at exactly the retention each budget-free policy chose on each sample. "
        "Output: a table on stdout, results.md, summary.json and runs.json (per layer) in --out.",
    )
    rec.add_argument(
        "--model", default="smollm2-135m", help="model directory, .gguf or catalog name (default: smollm2-135m)"
    )
    rec.add_argument(
        "--policies",
        type=_names,
        default=("gvote", "adakv", "snapkv"),
        help="comma-separated names or YAML presets (default: gvote,adakv,snapkv)",
    )
    rec.add_argument("--budgets", type=float_list, default=(0.25,), help="ratios for budgeted policies (default: 0.25)")
    rec.add_argument(
        "--match",
        type=_names,
        default=("adakv",),
        help="budgeted policies run at each budget-free policy's retention, per sample (default: adakv; '' for none)",
    )
    rec.add_argument(
        "--tasks",
        type=_names,
        default=("nl_passkey", "nl_niah_single", "nl_niah_multikey"),
        help="natural-language tasks (default: nl_passkey,nl_niah_single,nl_niah_multikey)",
    )
    rec.add_argument("--context-lens", type=int_list, default=(2048,), help="prompt tokens (default: 2048)")
    rec.add_argument("--samples", type=int, default=8, help="held-out samples per task and length (default: 8)")
    rec.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    rec.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    rec.add_argument("--out", default="runs/recall", help="output directory (default: runs/recall)")
    rec.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.attention_recall import RecallConfig, run_recall_bench
    from vllm_kvpress_ext.policies import PolicyConfigError

    model, ok = resolve_model_arg(args.model, "kvpress bench recall")
    if not ok or model is None:
        return 2
    try:
        run_recall_bench(
            RecallConfig(
                model=model,
                policies=args.policies,
                budgets=args.budgets,
                match=args.match,
                tasks=args.tasks,
                context_lens=args.context_lens,
                samples=args.samples,
                device=args.device,
                dtype=args.dtype,
                out_dir=args.out,
            )
        )
    except (ValueError, PolicyConfigError) as exc:
        print(f"kvpress bench recall: {exc}", file=sys.stderr)
        return 2
    return 0
