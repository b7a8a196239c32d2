"""`kvpress train-model` and `kvpress train-gate`: the suite model and WG-KV write gates."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers, int_list, task_params_arg, task_weights


def register(sub: Subparsers) -> None:
    _register_train_model(sub)
    _register_train_gate(sub)


def _register_train_model(sub: Subparsers) -> None:
    tm = sub.add_parser(
        "train-model",
        help="train a small GQA Llama on the synthetic suite (checkpoints, resume, held-out eval)",
        description="Trains a Llama-architecture model with grouped-query attention from scratch on a mixture of "
        "the synthetic suite's tasks, with a context-length curriculum, periodic held-out exact-match evaluation, "
        "checkpoints (--resume continues from OUT/checkpoint.pt) and a log (OUT/log.jsonl). The model is exported "
        "as an HF directory in OUT/model.",
    )
    tm.add_argument("--out", default="runs/model", help="output directory (default: runs/model)")
    tm.add_argument("--steps", type=int, default=20_000, help="optimizer steps (default: 20000)")
    tm.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this step, keeping the learning-rate and context schedule of --steps",
    )
    tm.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    tm.add_argument("--context-len", type=int, default=1024, help="final context length (default: 1024)")
    tm.add_argument(
        "--curriculum",
        type=int_list,
        default=(128, 256, 512),
        help="context lengths before the final one, equal shares of the steps outside --final-share "
        "(default: 128,256,512)",
    )
    tm.add_argument("--hidden-size", type=int, default=128, help="default: 128")
    tm.add_argument("--intermediate-size", type=int, default=384, help="default: 384")
    tm.add_argument("--layers", type=int, default=4, help="default: 4")
    tm.add_argument("--heads", type=int, default=4, help="query heads (default: 4)")
    tm.add_argument("--kv-heads", type=int, default=2, help="KV heads (default: 2)")
    tm.add_argument("--rope-theta", type=float, default=500_000.0, help="RoPE base (default: 500000)")
    tm.add_argument("--init-std", type=float, default=0.02, help="std of the normal weight init (default: 0.02)")
    tm.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    tm.add_argument("--warmup", type=int, default=200, help="warm-up steps (default: 200)")
    tm.add_argument(
        "--final-share",
        type=float,
        default=0.4,
        help="fraction of steps at --context-len; the curriculum shares the rest (default: 0.4)",
    )
    tm.add_argument("--eval-every", type=int, default=500, help="default: 500")
    tm.add_argument("--eval-samples", type=int, default=32, help="held-out samples per task (default: 32)")
    tm.add_argument("--checkpoint-every", type=int, default=500, help="default: 500")
    tm.add_argument("--seed", type=int, default=0, help="default: 0")
    tm.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    tm.add_argument(
        "--tasks",
        type=task_weights,
        default=None,
        help="task mixture as name:weight,... (default: associative_recall:2,niah_multikey:2, the other families 1)",
    )
    tm.add_argument(
        "--task-param",
        action="append",
        default=None,
        metavar="TASK.PARAM=VALUE",
        help="a task generator parameter, repeatable, e.g. associative_recall.num_records=8 "
        "(see vllm_kvpress_ext/tasks/synthetic)",
    )
    tm.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tm.add_argument(
        "--init-from",
        default=None,
        metavar="CHECKPOINT",
        help="start from the weights and optimizer moments of another run's checkpoint.pt (step and learning-rate "
        "schedule start afresh), e.g. to go "
        "on to longer contexts or another task mixture",
    )
    tm.set_defaults(handler=run_train_model)


def _register_train_gate(sub: Subparsers) -> None:
    tg = sub.add_parser(
        "train-gate",
        help="train WG-KV write gates for a frozen model (self-distillation)",
        description="Trains one write gate per (layer, KV head) of MODEL_DIR, the model frozen: the loss is the L2 "
        "distance of the final hidden states under write-gated attention to those under full attention, plus "
        "lambda * mean(g + g(1 - g)). Gates are saved as safetensors beside the model directory (default "
        "MODEL.wgkv.safetensors, which policy wgkv loads by default); on held-out samples the admitted fraction per "
        "layer and head is printed and drawn as a heatmap, with the next-token cross-entropy and top-1 agreement "
        "of the admission mask against full attention. --data text trains on natural text already installed "
        "on the machine (Python's docstrings, pip packages' READMEs, /usr/share/doc).",
    )
    tg.add_argument(
        "model_dir", metavar="MODEL", help="HF-format model directory, .gguf file or catalog name (smollm2-135m)"
    )
    tg.add_argument("--out", default=None, help="gate file (default: MODEL.wgkv.safetensors beside the model)")
    tg.add_argument(
        "--lambda", dest="lam", type=float, default=0.05, help="sparsity weight: higher admits less (default: 0.05)"
    )
    tg.add_argument("--local-window", type=int, default=64, help="W_local, tokens always kept (default: 64)")
    tg.add_argument("--tau", type=float, default=0.1, help="admission threshold for reporting (default: 0.1)")
    tg.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    tg.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    tg.add_argument("--context-len", type=int, default=512, help="training sequence length in tokens (default: 512)")
    tg.add_argument(
        "--data",
        choices=("suite", "text"),
        default="suite",
        help="training text: the synthetic suite (for the bundled model), or natural text installed on this "
        "machine: Python's docstrings, pip packages' READMEs, /usr/share/doc (default: suite)",
    )
    tg.add_argument(
        "--text-sources",
        default="python,pip,debian",
        help="with --data text: which of python, pip, debian (default: all three)",
    )
    tg.add_argument(
        "--hidden", type=int, default=None, help="gate MLP width (default: 4 x head_dim, the paper's share)"
    )
    tg.add_argument(
        "--save-dtype", choices=("float32", "float16"), default="float32", help="gate file precision (default: float32)"
    )
    tg.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: 1e-3)")
    tg.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay (default: 30)")
    tg.add_argument(
        "--init-bias", type=float, default=1.0, help="gates' initial output bias: sigmoid(1) = 0.73 open (default: 1)"
    )
    tg.add_argument(
        "--eval-samples",
        type=int,
        default=16,
        help="held-out samples for the admitted fraction and the gated-vs-full evaluation (default: 16)",
    )
    tg.add_argument("--seed", type=int, default=0, help="default: 0")
    tg.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    tg.add_argument("--tasks", type=task_weights, default=None, help="task mixture as name:weight,... (default: all)")
    tg.set_defaults(handler=run_train_gate)


def run_train_model(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.train.model import TrainConfig, train

    try:
        task_params = task_params_arg(args.task_param)
    except ValueError as err:
        print(f"kvpress train-model: {err}", file=sys.stderr)
        return 2
    config = TrainConfig(
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        context_len=args.context_len,
        curriculum=args.curriculum,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        rope_theta=args.rope_theta,
        init_std=args.init_std,
        lr=args.lr,
        warmup=args.warmup,
        final_share=args.final_share,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        threads=args.threads,
        init_from=args.init_from,
        stop_after=args.stop_after,
        task_params=task_params,
        **({"tasks": args.tasks} if args.tasks else {}),
    )
    try:
        model_dir = train(config, resume=args.resume)
    except ValueError as err:
        print(f"kvpress train-model: {err}", file=sys.stderr)
        return 2
    print(f"model written to {model_dir}")
    return 0


def run_train_gate(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.cli.models import resolve_model_arg
    from vllm_kvpress_ext.models.write_gate import default_gate_path
    from vllm_kvpress_ext.train.gate import GateTrainConfig, admitted_heatmap, train_gates

    model, ok = resolve_model_arg(args.model_dir, "kvpress train-gate")
    if not ok or model is None:
        return 1
    args.model_dir = model
    out = args.out if args.out is not None else str(default_gate_path(args.model_dir))
    config = GateTrainConfig(
        model_dir=args.model_dir,
        out=out,
        lam=args.lam,
        local_window=args.local_window,
        tau=args.tau,
        steps=args.steps,
        batch_size=args.batch_size,
        context_len=args.context_len,
        lr=args.lr,
        warmup=args.warmup,
        init_bias=args.init_bias,
        hidden=args.hidden,
        data=args.data,
        text_sources=tuple(s.strip() for s in args.text_sources.split(",") if s.strip()),
        save_dtype=args.save_dtype,
        eval_samples=args.eval_samples,
        seed=args.seed,
        threads=args.threads,
        **({"tasks": args.tasks} if args.tasks else {}),
    )
    try:
        path, summary = train_gates(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"kvpress train-gate: {err}", file=sys.stderr)
        return 2
    fractions = summary["admitted_per_layer_head"]
    headers = ["layer", *(f"head {h}" for h in range(len(fractions[0]))), "mean"]
    rows = [
        [str(layer), *(f"{x:.3f}" for x in row), f"{sum(row) / len(row):.3f}"] for layer, row in enumerate(fractions)
    ]
    print(format_table(headers, rows))
    held = summary["held_out"]
    print(
        f"held-out ({held['samples']} samples, {held['tokens']} tokens): next-token cross-entropy "
        f"{held['cross_entropy_full']:.4f} full vs {held['cross_entropy_gated']:.4f} admitted at tau {config.tau}, "
        f"top-1 agreement {held['top1_agreement']:.1%}"
    )
    print(
        f"gates written to {path}: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"admitted {summary['admitted_fraction']:.1%} at tau {config.tau} (held-out samples), "
        f"{summary['train_seconds']:.0f} s, {summary['parameters']} gate parameters"
    )
    plot = admitted_heatmap(
        fractions, Path(path).with_suffix(".png"), f"admitted fraction, lambda {config.lam}, W {config.local_window}"
    )
    if plot is not None:
        print(f"heatmap: {plot}")
    return 0
