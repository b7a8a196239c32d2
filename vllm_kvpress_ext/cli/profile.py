"""`kvpress profile xkv`: XKV's per-layer cache fractions, measured offline and saved as YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, show_usage_when_bare


def register(sub: Subparsers) -> None:
    profile = sub.add_parser(
        "profile",
        help="offline profiles for policies that can use one (xkv)",
        description="Measure a policy's per-model settings offline on sampled prompts and save them as YAML.",
    )
    profile_sub = profile.add_subparsers(dest="profile_command", metavar="POLICY")
    show_usage_when_bare(profile)

    xkv = profile_sub.add_parser(
        "xkv",
        help="XKV's sampling-based profile: mean per-layer cache fractions, saved as YAML",
        description="Runs --samples prompts per task of the synthetic suite (training seeds, never the held-out "
        "evaluation seeds) through the model once each with XKV's R_avg mode (target --budget), averages each "
        "layer's kept fraction m_l / P (entries kept beyond the window / entries ranked) and saves them, with how "
        "they were measured, to --out. Each fraction lies in [0, 1]; their mean is the share of the ranked prompt "
        "the profile keeps when applied with no budget. Apply it with the xkv policy's `profile` field, e.g. "
        'kv_policy {"name": "xkv", "profile": "PROFILE.yaml"}; with a ratio/tokens budget only the '
        "proportions between layers are used. Without --model, the random-weight suite bench model is profiled.",
    )
    xkv.add_argument(
        "--model",
        default=None,
        help="HF-format model directory with the suite's tokenizer (default: the random-weight suite bench model)",
    )
    xkv.add_argument("--out", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    xkv.add_argument("--samples", type=int, default=8, help="prompts per task (default: 8)")
    xkv.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task families (default: those `kvpress bench accuracy` runs: the needle, tracking and "
        "aggregation tasks)",
    )
    xkv.add_argument("--context-len", type=int, default=1024, help="context tokens per prompt (default: 1024)")
    xkv.add_argument(
        "--budget",
        type=float,
        default=0.9,
        metavar="R",
        help="R_avg coverage target in (0, 1] each profiled request is sized for (xkv's target_ratio; default: 0.9)",
    )
    xkv.add_argument(
        "--protocol",
        choices=("served", "strict", "agnostic"),
        default="strict",
        help="compression point profiled: prompts are cut where this protocol compresses (default: strict, as "
        "kvpress bench accuracy)",
    )
    xkv.add_argument("--seed", type=int, default=0, help="first training seed; seeds SEED..SEED+samples-1 (default: 0)")
    xkv.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    xkv.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    xkv.set_defaults(handler=run_xkv)


def _profile_error(message: str) -> int:
    print(f"kvpress profile xkv: {message}", file=sys.stderr)
    return 2


def run_xkv(args: argparse.Namespace) -> int:
    """Sample suite prompts (training seeds), run XKV's R_avg mode on each, save the mean per-layer fractions.

    Arguments are checked before any model is loaded so that a typo costs nothing. Without --model
    the random-weight suite bench model is profiled (loudly: its fractions describe noise).
    """
    import tempfile

    from vllm_kvpress_ext.bench.accuracy import DEFAULT_TASKS, HELD_OUT_SEED
    from vllm_kvpress_ext.tasks.synthetic import TASKS

    tasks = DEFAULT_TASKS if args.tasks is None else tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        return _profile_error(
            f"unknown task(s) {', '.join(unknown) or repr(args.tasks)}; known: {', '.join(sorted(TASKS))}"
        )
    if args.samples < 1:
        return _profile_error(f"--samples must be >= 1, got {args.samples}")
    if args.context_len < 1:
        return _profile_error(f"--context-len must be >= 1, got {args.context_len}")
    if not 0.0 < args.budget <= 1.0:
        return _profile_error(f"--budget (the R_avg coverage target) must lie in (0, 1], got {args.budget}")
    if args.seed < 0 or args.seed + args.samples > HELD_OUT_SEED:
        return _profile_error(
            f"seeds {args.seed}..{args.seed + args.samples - 1} are not all training seeds: profiles must not "
            f"see the held-out evaluation samples (seeds >= {HELD_OUT_SEED})"
        )
    if Path(args.out).is_dir():
        return _profile_error(
            f"--out {args.out} is a directory; give the profile's file name, e.g. {args.out}/xkv.yaml"
        )
    if args.model is not None:
        return _profile_xkv(args, Path(args.model), tasks, str(args.model))
    from vllm_kvpress_ext.bench.models import suite_bench_model_dir

    print(
        "kvpress profile xkv: no --model: profiling the RANDOM-WEIGHT suite bench model (seed 0); its fractions "
        "describe noise, use them only to try the command (or with `kvpress serve --random-model`).",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="kvpress-profile-model-") as tmp:
        return _profile_xkv(args, suite_bench_model_dir(tmp), tasks, "random suite bench model (seed 0)")


def _profile_xkv(args: argparse.Namespace, model_dir: Path, tasks: tuple[str, ...], model_label: str) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.bench.xkv_profile import profile_xkv
    from vllm_kvpress_ext.models.loader import load_config
    from vllm_kvpress_ext.tasks.synthetic import build_prompt, generate
    from vllm_kvpress_ext.tasks.tokenizer import load_tokenizer

    try:
        config = load_config(model_dir)
    except (ValueError, OSError) as exc:
        return _profile_error(f"--model: {exc}")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return _profile_error(
            f"--model: {model_dir} has no tokenizer; profiling samples the synthetic suite and needs its tokenizer"
        )
    tokenizer = load_tokenizer(model_dir)
    prompts: list[list[int]] = []
    try:
        for task in tasks:
            for i in range(args.samples):
                sample = generate(task, args.seed + i, context_length=args.context_len)
                spec = build_prompt(sample, tokenizer, args.protocol)
                # What the policy sees under this protocol: the tokens prefilled before compression.
                prompts.append(spec.token_ids[: spec.compress_after])
    except ValueError as exc:
        return _profile_error(f"cannot build the prompts: {exc}")
    longest = max(len(p) for p in prompts)
    if longest >= config.max_position_embeddings:
        return _profile_error(
            f"prompts reach {longest} tokens but the model takes {config.max_position_embeddings} positions; "
            "lower --context-len"
        )
    # A pool for the requests run at once, not the engine's 1 GiB default (profiling runs beside other jobs).
    max_seqs = min(len(prompts), 16)
    page_size = 16
    pages = config.num_hidden_layers * config.num_key_value_heads * -(-(longest + 1) // page_size)
    print(f"profiling XKV on {len(prompts)} prompts ({', '.join(tasks)}) of {model_label}...", file=sys.stderr)
    try:
        profile = profile_xkv(
            model_dir,
            prompts,
            target_ratio=args.budget,
            dtype=args.dtype,
            device=args.device,
            num_pages=pages * max_seqs,
            page_size=page_size,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, longest + 64),
        )
    except ValueError as exc:
        return _profile_error(str(exc))
    profile.metadata.update(
        {
            "model": model_label,
            "tasks": list(tasks),
            "samples_per_task": args.samples,
            "seeds": [args.seed, args.seed + args.samples - 1],
            "context_len": args.context_len,
            "protocol": args.protocol,
            "mean_fraction": sum(profile.fractions) / profile.num_layers,
        }
    )
    path = profile.save(args.out)
    total = sum(profile.fractions)
    rows = [
        [layer, f"{f:.4f}", f"{100 * f / total:.1f}%" if total else "-"] for layer, f in enumerate(profile.fractions)
    ]
    print(format_table(["layer", "fraction kept", "share of kept"], rows))
    print(
        f"mean fraction {total / profile.num_layers:.4f} over {profile.metadata['requests']} request(s) "
        f"(R_avg target {args.budget:g}, protocol {args.protocol})"
    )
    print(f"wrote {path}")
    print(f'use it: kv_policy {{"name": "xkv", "profile": "{path.resolve()}"}}, or a preset YAML with those two keys')
    return 0
