"""`kvpress bench gated-prefill`: WG-KV's vertical-slash prefill against the causal prefill, side by side."""

from __future__ import annotations

import argparse
import sys

from vllm_kvpress_ext.cli.common import Subparsers, int_list


def register(bench_sub: Subparsers) -> None:
    gp = bench_sub.add_parser(
        "gated-prefill",
        help="prefill time of WG-KV's vertical-slash attention path vs the causal path, per context length",
        description="Times one prompt's prefill (and first token) through the engine per context length in three "
        "rows: full (the causal path), wgkv with tau 0 (gates run, every key admitted, so the causal path "
        "attends) and wgkv (the vertical-slash path), with interleaved repetitions after a warm-up, and "
        "reports median wall and process CPU seconds and their ratio to full. A second table times one "
        "layer's attention alone over the whole prompt: causal SDPA, vertical_slash_attention (block-sparse) "
        "and its dense masked form. Without "
        "--model, the random-weight bench model with untrained gates is used (the path is timed, not a choice).",
    )
    gp.add_argument(
        "--model", default=None, help="model directory, .gguf file or catalog name (default: random bench model)"
    )
    gp.add_argument(
        "--context-lens", type=int_list, default=(2048, 4096, 8192), help="prompt tokens (default: 2048,4096,8192)"
    )
    gp.add_argument("--repeats", type=int, default=3, help="timed repetitions per row, interleaved (default: 3)")
    gp.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="prefill chunk size (default: the whole prompt in one chunk, as bench accuracy prefills; "
        "kvpress serve's default is 2048)",
    )
    gp.add_argument("--gates", default=None, help="wgkv gate file or shipped name (default: the model's own)")
    gp.add_argument("--tau", type=float, default=0.1, help="wgkv admission threshold of the gated row (default: 0.1)")
    gp.add_argument(
        "--op-admitted",
        type=float,
        default=0.25,
        help="attention-op table: share of keys admitted at random (default: 0.25)",
    )
    gp.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    gp.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    gp.add_argument("--seed", type=int, default=0, help="prompt start and op inputs (default: 0)")
    gp.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.gated_prefill import GatedPrefillConfig, run_gated_prefill_bench
    from vllm_kvpress_ext.cli.models import resolve_model_arg

    args.model, ok = resolve_model_arg(args.model, "kvpress bench gated-prefill")
    if not ok:
        return 1
    try:
        run_gated_prefill_bench(
            GatedPrefillConfig(
                model=args.model,
                context_lens=args.context_lens,
                repeats=args.repeats,
                max_batched_tokens=args.max_batched_tokens,
                gates=args.gates,
                tau=args.tau,
                op_admitted=args.op_admitted,
                device=args.device,
                dtype=args.dtype,
                seed=args.seed,
            )
        )
    except ValueError as exc:
        print(f"kvpress bench gated-prefill: {exc}", file=sys.stderr)
        return 2
    return 0
