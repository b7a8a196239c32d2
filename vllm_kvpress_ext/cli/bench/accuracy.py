"""`kvpress bench accuracy`: accuracy and prompt coverage against the KV memory held, per policy and budget."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, float_list, int_list, task_params_arg
from vllm_kvpress_ext.cli.models import resolve_model_arg


def register(bench_sub: Subparsers) -> None:
    acc = bench_sub.add_parser(
        "accuracy",
        help="accuracy and prompt coverage vs KV memory actually held, per policy x budget x task",
        description="Runs the synthetic long-context suite through the engine with real compression and reports, "
        "per policy x budget x task, exact-match accuracy, the KV bytes the pool held (mean, p90), retention, and "
        "coverage: the share of prompt positions still held by at least one (layer, KV head) when a request "
        "finishes (and per layer by at least one of its heads, averaged over layers: head cov). Output: a table on "
        "stdout, results.md/.csv/.json and accuracy_vs_memory.png in --out. A real pretrained model (any other "
        "tokenizer, e.g. --model smollm2-135m) gets the natural-language tasks instead (RULER-style needles, "
        "variable tracking, word counting, pass key; every registered policy at 50/25/10% by default, 2K and 4K "
        "tokens, each sample's shared prefix prefilled once; see vllm_kvpress_ext/bench/natural_accuracy.py).",
    )
    acc.add_argument(
        "--model",
        default=None,
        help="model directory, .gguf file or catalog name (default: the bundled model)",
    )
    acc.add_argument(
        "--suite",
        choices=("auto", "synthetic", "natural"),
        default="auto",
        help="task suite: synthetic (the suite's word-level tasks), natural (English tasks for any tokenizer); "
        "auto: synthetic for models with the suite's tokenizer, natural otherwise",
    )
    acc.add_argument(
        "--context-lens", type=int_list, default=None, help="natural suite: prompt lengths (default: 2048,4096)"
    )
    acc.add_argument(
        "--filler", choices=("noise", "prose"), default=None, help="natural suite: haystack text (default: noise)"
    )
    acc.add_argument("--policies", default=None, help="comma-separated policies (default: full and the baselines)")
    acc.add_argument("--budgets", type=float_list, default=None, help="ratios (default: 0.5,0.25,0.1,0.05)")
    acc.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task families (default: the needle, tracking and aggregation tasks)",
    )
    acc.add_argument(
        "--protocol",
        choices=("served", "strict", "agnostic"),
        default=None,
        help="where compression happens (default: strict; natural suite: agnostic, or served)",
    )
    acc.add_argument("--samples", type=int, default=None, help="held-out samples per task (default: 20)")
    acc.add_argument(
        "--questions-per-context",
        type=int,
        default=None,
        help="natural suite: ask each sample's context up to this many distinct questions, one request each "
        "(nl_niah_multikey has 4: one per key); question-agnostic, every question reads the one compressed "
        "context a reused prefix would hold (default: 1)",
    )
    acc.add_argument(
        "--task-param",
        action="append",
        default=None,
        metavar="TASK.PARAM=VALUE",
        help="a task generator parameter, repeatable, e.g. associative_recall.num_records=8",
    )
    acc.add_argument("--context-len", type=int, default=None, help="context tokens per sample (default: 1024)")
    acc.add_argument("--out", default=None, help="output directory (default: runs/accuracy)")
    acc.add_argument(
        "--quick", action="store_true", help="small run: 3 policies, budget 0.25, 2 tasks, 4 samples, context 256"
    )
    acc.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.accuracy import AccuracyConfig, run_accuracy_bench

    if args.model is None:
        from vllm_kvpress_ext.assets import default_model_dir

        try:
            args.model = str(default_model_dir())
        except FileNotFoundError as err:
            print(f"kvpress bench accuracy: {err}", file=sys.stderr)
            return 2
    else:
        args.model, ok = resolve_model_arg(args.model, "kvpress bench accuracy")
        if not ok:
            return 1
        if not (Path(args.model) / "config.json").is_file() and Path(args.model).suffix.lower() != ".gguf":
            print(
                f"kvpress bench accuracy: {args.model} is not a model directory (no config.json) nor a .gguf file",
                file=sys.stderr,
            )
            return 2
    from vllm_kvpress_ext.bench.natural_accuracy import natural_config, run_natural_accuracy, uses_suite_tokenizer

    if args.suite == "natural" or (args.suite == "auto" and not uses_suite_tokenizer(args.model)):
        try:
            run_natural_accuracy(natural_config(args.model, args))
        except ValueError as err:
            print(f"kvpress bench accuracy: {err}", file=sys.stderr)
            return 2
        return 0
    if args.questions_per_context is not None:
        print("kvpress bench accuracy: --questions-per-context is for the natural suite", file=sys.stderr)
        return 2
    if args.quick:
        config = AccuracyConfig.quick(args.model, out_dir=args.out or "runs/accuracy-quick")
    else:
        config = AccuracyConfig(model=args.model, out_dir=args.out or "runs/accuracy")
    overrides = {
        "policies": tuple(args.policies.split(",")) if args.policies else None,
        "budgets": args.budgets,
        "tasks": tuple(args.tasks.split(",")) if args.tasks else None,
        "protocol": args.protocol,
        "samples": args.samples,
        "context_len": args.context_len,
    }
    try:
        overrides["task_params"] = task_params_arg(args.task_param) or None
    except ValueError as err:
        print(f"kvpress bench accuracy: {err}", file=sys.stderr)
        return 2
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    try:
        run_accuracy_bench(config)
    except ValueError as err:
        print(f"kvpress bench accuracy: {err}", file=sys.stderr)
        return 2
    return 0
