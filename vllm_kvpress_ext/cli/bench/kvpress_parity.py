"""`kvpress bench kvpress-parity`: kept sets and answers against NVIDIA kvpress 0.5.5, run from its own venv."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, float_list, int_list

PROG = "kvpress bench kvpress-parity"


def register(bench_sub: Subparsers) -> None:
    from vllm_kvpress_ext.bench.kvpress_parity import (
        DEFAULT_KVPRESS_PYTHON,
        DEFAULT_TASKS,
        KVPRESS_PYTHON_ENV,
        PARITY_POLICIES,
    )

    parity = bench_sub.add_parser(
        "kvpress-parity",
        help="kept-set overlap and accuracy against NVIDIA kvpress 0.5.5 (run from its own venv), same prompts",
        description="Runs NVIDIA kvpress 0.5.5 (in its own venv: `make kvpress-venv`) and this project on the same "
        "prompts and fp32 weights of a real model (default smollm2-135m), with SnapKV, StreamingLLM, PyramidKV, "
        "AdaKV, Expected Attention and KVzip at matched settings, and prints per policy and kept ratio the overlap of "
        "the kept (layer, KV head, position) sets and both systems' accuracy (question-agnostic protocol). "
        "See docs/parity.md.",
    )
    parity.add_argument("--model", default="smollm2-135m", help="GGUF file, HF directory or catalog name")
    parity.add_argument(
        "--kvpress-python",
        default=None,
        help=f"Python of a venv with kvpress==0.5.5 (default: ${KVPRESS_PYTHON_ENV}, else {DEFAULT_KVPRESS_PYTHON}, "
        "made by `make kvpress-venv`)",
    )
    parity.add_argument("--policies", default=",".join(PARITY_POLICIES), help="default: " + ",".join(PARITY_POLICIES))
    parity.add_argument(
        "--ratios", type=float_list, default=(0.5, 0.25, 0.1), help="kept ratios (default: 0.5,0.25,0.1)"
    )
    parity.add_argument("--context-lens", type=int_list, default=(1024,), help="context tokens (default: 1024)")
    parity.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="natural tasks (default: %(default)s)")
    parity.add_argument("--samples", type=int, default=2, help="prompts per task and length (default: 2)")
    parity.add_argument("--no-accuracy", action="store_true", help="kept-set overlap only: no question, no decoding")
    parity.add_argument(
        "--variants",
        action="store_true",
        help="also compare this project's other choices (count_include_pad=False; PyramidKV window_outside)",
    )
    parity.add_argument("--out", default="runs/kvpress-parity", help="output directory (default: %(default)s)")
    parity.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.kvpress_parity import (
        DEFAULT_KVPRESS_PYTHON,
        KVPRESS_PYTHON_ENV,
        ParityConfig,
        ParityError,
        run_parity,
        run_worker,
        validate_config,
    )
    from vllm_kvpress_ext.cli.models import resolve_model_arg

    model, ok = resolve_model_arg(args.model, PROG)
    if not ok or model is None:
        return 1
    python = args.kvpress_python or os.environ.get(KVPRESS_PYTHON_ENV) or DEFAULT_KVPRESS_PYTHON
    config = ParityConfig(
        model=model,
        kvpress_python=python,
        policies=tuple(p for p in args.policies.split(",") if p),
        ratios=args.ratios,
        context_lens=args.context_lens,
        tasks=tuple(t for t in args.tasks.split(",") if t),
        samples=args.samples,
        accuracy=not args.no_accuracy,
        variants=args.variants,
        out_dir=args.out,
    )
    try:
        validate_config(config)
        if not Path(python).is_file():  # before the model is loaded or written: say it at once
            run_worker(python, {}, Path(tempfile.gettempdir()))
        run_parity(config)
    except (ParityError, ValueError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    return 0
