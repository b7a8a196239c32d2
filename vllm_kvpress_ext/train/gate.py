"""`kvpress train-gate`: train WG-KV write gates for a frozen model by self-distillation.

The base model is frozen; only the gates (`models/write_gate.py`) learn. Per batch:

    teacher:  h_T = model(x) with full causal attention                       (no gradient)
    student:  h_S = model(x) with write-gated attention in every layer:
              softmax(q k^T / sqrt(d) + log m) v,  m[i, j] = 1 if i - j < W_local else g_j
    loss   =  mean over tokens of ||h_S - h_T||^2 / D   +   lambda * mean(g + g (1 - g))

(h = final hidden states after the final norm, D = hidden size, so the distillation term is a
per-element MSE; the penalty's g term pushes gates down, its g(1 - g) term pushes them to 0 or 1,
so a threshold tau loses little.) AdamW (lr 1e-3, weight decay 0.01), linear warm-up then cosine
decay. Data: the synthetic suite's task mixture (any token stream works; these are the sequences
the bundled model serves).

After training, the admitted fraction (g >= tau) per (layer, KV head) is measured on held-out
samples, printed, stored in the gate file's metadata and, with matplotlib, drawn as a heatmap.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_kvpress_ext.bench.tasks import TASKS, generate, training_example
from vllm_kvpress_ext.bench.tokenizer import PAD, VOCABULARY
from vllm_kvpress_ext.models import load_model
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.models.write_gate import WriteGates, write_gated_attention
from vllm_kvpress_ext.train.model import HELD_OUT_SEED, BatchedCausalContext

GATE_TRAIN_SEED_BASE = 500_000  # sample seeds for gate training: apart from the model's and the held-out ones


@dataclass
class GateTrainConfig:
    model_dir: str
    out: str
    lam: float = 0.05
    local_window: int = 64
    tau: float = 0.1
    steps: int = 300
    batch_size: int = 8
    context_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 30
    min_lr_ratio: float = 0.1
    eps: float = 1e-6
    hidden: int | None = None
    init_bias: float = 1.0  # gates start at sigmoid(1) = 0.73: mostly open, quick to move either way
    tasks: dict[str, float] = field(default_factory=lambda: {name: 1.0 for name in TASKS})
    eval_samples: int = 16
    seed: int = 0
    threads: int = 0

    def validate(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lambda must be >= 0, got {self.lam}")
        if self.local_window < 1:
            raise ValueError(f"local window must be >= 1, got {self.local_window}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must lie in [0, 1], got {self.tau}")
        if self.steps < 1 or self.batch_size < 1 or self.context_len < 16:
            raise ValueError("steps and batch size must be >= 1 and the context length >= 16")
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(sorted(TASKS))}")
        if not Path(self.model_dir).is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        out = Path(self.out)
        if out.resolve().parent == Path(self.model_dir).resolve() or out.is_dir():
            raise ValueError(f"--out must be a file beside the model directory, not inside it: {out}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class GatedTrainingContext:
    """Student attention: write-gated attention in every layer, gates recorded for the penalty."""

    def __init__(self, gates: WriteGates, batch: int, length: int, window: int, eps: float) -> None:
        self.gates, self.batch, self.length, self.window, self.eps = gates, batch, length, window, eps
        self.values: list[torch.Tensor] = []  # per layer g [B, T, H]

    def attend(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pre_rope: torch.Tensor,
    ) -> torch.Tensor:
        b, t = self.batch, self.length
        g = self.gates(layer_idx, k_pre_rope, k).view(b, t, -1)
        self.values.append(g)
        out = write_gated_attention(
            q.view(b, t, *q.shape[1:]),
            k.view(b, t, *k.shape[1:]),
            v.view(b, t, *v.shape[1:]),
            g,
            self.window,
            q.shape[-1] ** -0.5,
            self.eps,
        )
        return out.reshape(q.shape).to(q.dtype)


def sample_batch(
    config: GateTrainConfig, seeds: list[int], rng: random.Random, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[B, T]` and a validity mask `[B, T]` (False on padding)."""
    names = list(config.tasks)
    weights = [config.tasks[n] for n in names]
    rows = []
    for seed in seeds:
        task = rng.choices(names, weights)[0]
        params = {"context_length": config.context_len}
        rows.append(training_example(generate(task, seed, **params)).token_ids)
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(rows), length), dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        valid[b, : len(row)] = True
    return ids, valid


def _forward(model: LlamaFamilyForCausalLM, ids: torch.Tensor, context: Any) -> torch.Tensor:
    b, t = ids.shape
    return model(ids.reshape(-1), torch.arange(t).repeat(b), context).view(b, t, -1)


def distillation_loss(
    model: LlamaFamilyForCausalLM, gates: WriteGates, ids: torch.Tensor, valid: torch.Tensor, config: GateTrainConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training objective and its parts (distillation, penalty, admitted fraction at tau)."""
    b, t = ids.shape
    with torch.no_grad():
        teacher = _forward(model, ids, BatchedCausalContext(b, t))
    context = GatedTrainingContext(gates, b, t, config.local_window, config.eps)
    student = _forward(model, ids, context)
    mask = valid.unsqueeze(-1).to(student.dtype)
    distill = ((student.float() - teacher.float()).pow(2) * mask).sum() / (mask.sum() * student.shape[-1])
    g = torch.stack(context.values)  # [L, B, T, H]
    token_mask = valid.view(1, b, t, 1).expand_as(g)
    g_valid = g[token_mask]
    penalty = (g_valid + g_valid * (1 - g_valid)).mean()
    loss = distill + config.lam * penalty
    parts = {
        "distill": float(distill.detach()),
        "penalty": float(penalty.detach()),
        "admitted": float((g_valid >= config.tau).float().mean()),
    }
    return loss, parts


@torch.no_grad()
def admitted_fraction(
    model: LlamaFamilyForCausalLM, gates: WriteGates, config: GateTrainConfig, pad_id: int
) -> torch.Tensor:
    """Share of held-out tokens admitted (g >= tau), per (layer, KV head): `[L, H]`."""
    counts = torch.zeros(gates.num_layers, gates.num_kv_heads)
    total = 0
    rng = random.Random(config.seed + 1)
    for start in range(0, config.eval_samples, config.batch_size):
        seeds = [HELD_OUT_SEED + start + i for i in range(min(config.batch_size, config.eval_samples - start))]
        ids, valid = sample_batch(config, seeds, rng, pad_id)
        b, t = ids.shape
        context = GatedTrainingContext(gates, b, t, config.local_window, config.eps)
        _forward(model, ids, context)
        g = torch.stack(context.values)  # [L, B, T, H]
        admitted = (g >= config.tau) & valid.view(1, b, t, 1)
        counts += admitted.sum(dim=(1, 2)).float()
        total += int(valid.sum())
    return counts / max(1, total)


def train_gates(config: GateTrainConfig, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Train gates for `config.model_dir`; save them to `config.out`; return the path and a summary."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model = load_model(config.model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    mc = model.config
    gates = WriteGates(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, config.hidden, config.init_bias)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    pad_id = list(VOCABULARY).index(PAD)
    rng = random.Random(config.seed)
    log_path = Path(config.out).with_suffix(".log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    history = []
    bar = tqdm(range(config.steps), disable=not progress, desc="train-gate", unit="step")
    with log_path.open("w") as log:
        for step in bar:
            seeds = [
                GATE_TRAIN_SEED_BASE + config.seed * 100_000 + step * config.batch_size + i
                for i in range(config.batch_size)
            ]
            ids, valid = sample_batch(config, seeds, rng, pad_id)
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            loss, parts = distillation_loss(model, gates, ids, valid, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            record = {"step": step + 1, "loss": float(loss.detach()), **parts, "lr": config.lr_at(step)}
            history.append(record)
            log.write(json.dumps(record) + "\n")
            bar.set_postfix(loss=f"{record['loss']:.4f}", admitted=f"{parts['admitted']:.2f}")
    seconds = time.perf_counter() - start
    fraction = admitted_fraction(model, gates, config, pad_id)
    summary = {
        "model": Path(config.model_dir).name,
        "local_window": config.local_window,
        "lambda": config.lam,
        "tau": config.tau,
        "steps": config.steps,
        "train_seconds": round(seconds, 1),
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "admitted_fraction": round(float(fraction.mean()), 4),
        "admitted_per_layer_head": [[round(float(x), 4) for x in row] for row in fraction],
        "parameters": sum(p.numel() for p in gates.parameters()),
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: v for k, v in asdict(config).items() if k not in ("model_dir", "out")},
    }
    path = gates.save(config.out, summary)
    return path, summary


def admitted_heatmap(fraction: list[list[float]], path: str | Path, title: str) -> Path | None:
    """Admitted fraction per (layer, KV head) as a heatmap PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    data = torch.tensor(fraction)
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * data.shape[1], 1.0 + 0.5 * data.shape[0]))
    image = ax.imshow(data.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for (layer, head), value in zip(
        [(i, j) for i in range(data.shape[0]) for j in range(data.shape[1])], data.reshape(-1), strict=True
    ):
        ax.text(head, layer, f"{float(value):.2f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="admitted fraction")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["GateTrainConfig", "GatedTrainingContext", "admitted_heatmap", "distillation_loss", "train_gates"]
