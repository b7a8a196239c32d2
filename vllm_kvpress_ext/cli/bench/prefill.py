"""`kvpress bench prefill`: prompt tokens/s of one long prompt's prefill through the engine."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers, int_list


def _modes(text: str) -> tuple[str, ...]:
    from vllm_kvpress_ext.bench.prefill_bench import MODES

    names = {"oracle": MODES[0], "fused": MODES[1], "dense": MODES[2]}
    picked = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in picked if s not in names]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from oracle, fused, dense")
    return tuple(names[s] for s in picked)


def register(bench_sub: Subparsers) -> None:
    bp = bench_sub.add_parser(
        "prefill",
        help="prompt tokens/s of a prefill through the engine: chunked (einsum oracle vs fused SDPA) and one chunk",
        description="One request per prompt length (random token ids, max_tokens 1), timed from admission to its "
        "first token. Modes: oracle = chunks of --chunk tokens whose later chunks attend to the cached prefix with "
        "the einsum oracle (the engine's path before the fused one); fused = the same chunks through torch's fused "
        "SDPA; dense = the whole prompt as one chunk (plain causal SDPA, as a dense forward attends).",
    )
    bp.add_argument("--model", default="smollm2-135m", help="model path or catalog name (default: smollm2-135m)")
    bp.add_argument(
        "--prompt-lens", type=int_list, default=(1024, 2048, 4096, 8000), help="default: 1024,2048,4096,8000"
    )
    bp.add_argument(
        "--chunk", type=int, default=2048, help="prefill chunk = engine max_num_batched_tokens (default: 2048)"
    )
    bp.add_argument("--modes", type=_modes, default=None, help="comma list of oracle,fused,dense (default: all)")
    bp.add_argument("--repeats", type=int, default=1, help="runs per point, fastest reported (default: 1)")
    bp.add_argument("--kv-policy", default=None, help="policy name or preset path (default: none)")
    bp.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    bp.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    bp.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bp.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.prefill_bench import MODES, PrefillBenchConfig, run_prefill_bench

    run_prefill_bench(
        PrefillBenchConfig(
            model=args.model,
            prompt_lens=args.prompt_lens,
            chunk=args.chunk,
            repeats=args.repeats,
            modes=args.modes or MODES,
            kv_policy=args.kv_policy,
            dtype=args.dtype,
            device=args.device,
            out=args.out,
        )
    )
    return 0
