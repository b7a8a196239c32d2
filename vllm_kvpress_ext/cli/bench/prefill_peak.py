"""`kvpress bench prefill-peak`: KV memory at the prefill peak, end-of-prefill against layer-wise compression
or admission during a chunked prefill."""

from __future__ import annotations

import argparse
import sys

from vllm_kvpress_ext.cli.common import Subparsers


def register(bench_sub: Subparsers) -> None:
    pp = bench_sub.add_parser(
        "prefill-peak",
        help="KV memory at the prefill peak vs after compression: end-of-prefill vs layer-wise compression",
        description="One prompt per row (full, xkv, xkv with a profile compressed layer by layer, lava one-shot, "
        "lava cascading), all at one ratio budget: the request's exact high-water mark of KV pages during prefill, "
        "what it holds after compression, what admission reserves, and how many requests a pool of four "
        "uncompressed prompts admits at once. Without --model, the random-weight bench "
        "model is used; without --profile, an XKV profile is measured first on two other prompts. "
        "--rows admission compares admission during a chunked prefill instead (full, snapkv, wgkv, wgkv with "
        "a cap): peak, reservation, the most requests held at once, and each prefill's wall and CPU time.",
    )
    pp.add_argument(
        "--model", default=None, help="model directory, .gguf file or catalog name (default: random bench model)"
    )
    pp.add_argument(
        "--rows",
        choices=("layerwise", "admission"),
        default="layerwise",
        help="layerwise: the rows above; admission: full, snapkv and wgkv (plain, and capped at ratio x "
        "context-len with a declared chunked prefill peak) with chunked prefill, and the most requests held "
        "at once (default: layerwise)",
    )
    pp.add_argument("--gates", default=None, help="admission rows: wgkv gate file (default: the model's own)")
    pp.add_argument(
        "--local-window", type=int, default=64, help="admission rows: W of the capped wgkv row (default: 64)"
    )
    pp.add_argument(
        "--waiting",
        type=int,
        default=8,
        help="admission rows: requests run for 'held at once'; 0 skips that column (default: 8)",
    )
    pp.add_argument(
        "--decode-tokens", type=int, default=8, help="admission rows: tokens each of them generates (default: 8)"
    )
    pp.add_argument("--context-len", type=int, default=2048, help="prompt tokens (default: 2048)")
    pp.add_argument("--ratio", type=float, default=0.25, help="mean fraction kept by xkv and lava (default: 0.25)")
    pp.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="prefill chunk size (default: the whole prompt in one chunk for the layerwise rows, where "
        "layer-wise compression only lowers the peak of the last chunk; 256 for the admission rows)",
    )
    pp.add_argument("--profile", default=None, help="XKV profile YAML (default: measure one first)")
    pp.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    pp.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    pp.add_argument("--seed", type=int, default=0, help="default: 0")
    pp.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.prefill_peak import PrefillPeakConfig, run_prefill_peak_bench
    from vllm_kvpress_ext.cli.models import resolve_model_arg

    args.model, ok = resolve_model_arg(args.model, "kvpress bench prefill-peak")
    if not ok:
        return 1

    try:
        run_prefill_peak_bench(
            PrefillPeakConfig(
                model=args.model,
                context_len=args.context_len,
                ratio=args.ratio,
                max_batched_tokens=args.max_batched_tokens,
                profile=args.profile,
                dtype=args.dtype,
                device=args.device,
                seed=args.seed,
                rows=args.rows,
                gates=args.gates,
                local_window=args.local_window,
                waiting=args.waiting,
                decode_tokens=args.decode_tokens,
            )
        )
    except ValueError as exc:
        print(f"kvpress bench prefill-peak: {exc}", file=sys.stderr)
        return 2
    return 0
