"""`kvpress train-gate`: train WG-KV write gates for a frozen model by self-distillation.

The base model is frozen; only the gates (`models/write_gate.py`) learn. Per batch:

    teacher:  h_T = model(x) with full causal attention                       (no gradient)
    student:  h_S = model(x) with write-gated attention in every layer:
              softmax(q k^T / sqrt(d) + log m) v,  m[i, j] = 1 if i - j < W_local else g_j
    loss   =  mean over tokens of ||h_S - h_T||^2 / D   +   lambda * mean(g + g (1 - g))

(h = final hidden states after the final norm, D = hidden size, so the distillation term is a
per-element MSE; the penalty's g term pushes gates down, its g(1 - g) term pushes them to 0 or 1,
so a threshold tau loses little.) AdamW (lr 1e-3, weight decay 0.01), linear warm-up then cosine
decay. Data (`data`): the synthetic suite's task mixture (`suite`, the sequences the bundled model
serves), or natural text already installed on the machine (`text`, `train/text_corpus.py`: Python's
docstrings, pip packages' READMEs, Debian's docs) for a pretrained model such as SmolLM2.

After training, held-out samples (other seeds, or held-out documents) measure the admitted fraction
(g >= tau) per (layer, KV head) and what admission costs: next-token cross-entropy and top-1
agreement with hard gates (the mask the engine serves: admitted iff g >= tau) against full
attention. All of it is printed, stored in the gate file's metadata and, with matplotlib, the
admitted fraction is drawn as a heatmap.
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

from vllm_kvpress_ext.models import load_model
from vllm_kvpress_ext.models.gguf_file import is_gguf_path
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.models.write_gate import WriteGates, write_gated_attention
from vllm_kvpress_ext.tasks.synthetic import TASKS, generate, training_example
from vllm_kvpress_ext.tasks.tokenizer import PAD, VOCABULARY
from vllm_kvpress_ext.train.model import HELD_OUT_SEED, BatchedCausalContext
from vllm_kvpress_ext.train.text_corpus import TEXT_SOURCES, text_windows

GATE_TRAIN_SEED_BASE = 500_000  # sample seeds for gate training: apart from the model's and the held-out ones
DATA_KINDS = ("suite", "text")
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


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
    data: str = "suite"  # "suite": the synthetic task mixture; "text": natural text on this machine
    text_sources: tuple[str, ...] = TEXT_SOURCES
    eval_samples: int = 16
    save_dtype: str = "float32"  # float16 halves the file (what the package ships)
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
        if self.data not in DATA_KINDS:
            raise ValueError(f"data must be one of {', '.join(DATA_KINDS)}, got {self.data!r}")
        unknown_sources = sorted(set(self.text_sources) - set(TEXT_SOURCES))
        if unknown_sources or not self.text_sources:
            raise ValueError(f"unknown text source(s) {', '.join(unknown_sources)}; known: {', '.join(TEXT_SOURCES)}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.eval_samples < 1:
            raise ValueError(f"eval samples must be >= 1, got {self.eval_samples}")
        model = Path(self.model_dir)
        if not (model.is_dir() or (model.is_file() and is_gguf_path(model))):
            raise FileNotFoundError(f"model {self.model_dir} does not exist (as a model directory or a .gguf file)")
        out = Path(self.out)
        if out.resolve().parent == model.resolve() or out.is_dir():
            raise ValueError(f"--out must be a file beside the model directory, not inside it: {out}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class GatedTrainingContext(BatchedCausalContext):
    """Student attention: write-gated attention in every global layer, gates recorded for the penalty. A
    sliding-window layer (Gemma 3's local layers) attends within its window, ungated, as the engine serves it:
    WG-KV's gates and local ring apply to the global layers only. With `tau`, the engine's mask instead of
    the soft gates: a key outside the local window is visible iff its gate is >= tau (log 0 = -inf)."""

    def __init__(
        self,
        gates: WriteGates,
        batch: int,
        length: int,
        local_window: int,
        eps: float,
        layer_windows: tuple[int | None, ...] = (),
        scale: float | None = None,
        tau: float | None = None,
    ) -> None:
        super().__init__(batch, length, layer_windows, scale)
        self.gates, self.local_window, self.eps, self.tau = gates, local_window, eps, tau
        self.values: list[torch.Tensor] = []  # per global layer g [B, T, H]

    def attend(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pre_rope: torch.Tensor,
    ) -> torch.Tensor:
        if self.window(layer_idx) is not None:
            return super().attend(layer_idx, hidden, q, k, v, k_pre_rope)
        b, t = self.batch, self.length
        g = self.gates(layer_idx, k_pre_rope, k).view(b, t, -1)
        self.values.append(g)
        out = write_gated_attention(
            q.view(b, t, *q.shape[1:]),
            k.view(b, t, *k.shape[1:]),
            v.view(b, t, *v.shape[1:]),
            self.admission(g),
            self.local_window,
            self.scale if self.scale is not None else q.shape[-1] ** -0.5,
            self.eps,
        )
        return out.reshape(q.shape).to(q.dtype)

    def admission(self, g: torch.Tensor) -> torch.Tensor:
        """What the attention weighs keys outside the window by: the soft gates themselves while training, the
        hard admission (`g >= tau`) when measuring what the engine serves."""
        return g if self.tau is None else (g >= self.tau).float()


def sample_batch(
    config: GateTrainConfig, seeds: list[int], rng: random.Random, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[B, T]` and a validity mask `[B, T]` (False on padding) from the synthetic suite."""
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


class SuiteBatches:
    """Batches of the synthetic suite: training seeds apart from the model's, held-out seeds from HELD_OUT_SEED."""

    def __init__(self, config: GateTrainConfig) -> None:
        self.config = config
        self.pad_id = list(VOCABULARY).index(PAD)
        self.rng = random.Random(config.seed)
        self.facts: dict[str, Any] = {"data": "suite", "tasks": config.tasks}

    def train(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        seeds = [GATE_TRAIN_SEED_BASE + c.seed * 100_000 + step * c.batch_size + i for i in range(c.batch_size)]
        return sample_batch(c, seeds, self.rng, self.pad_id)

    def held_out(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        rng = random.Random(c.seed + 1)
        batches = []
        for start in range(0, c.eval_samples, c.batch_size):
            seeds = [HELD_OUT_SEED + start + i for i in range(min(c.batch_size, c.eval_samples - start))]
            batches.append(sample_batch(c, seeds, rng, self.pad_id))
        return batches


class TextBatches:
    """Windows of natural text on this machine (`text_corpus.py`): random training windows, fixed held-out ones."""

    def __init__(self, config: GateTrainConfig) -> None:
        from vllm_kvpress_ext.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.model_dir)
        if tokenizer is None:
            raise ValueError(f"{config.model_dir} has no tokenizer: --data text needs one (use --data suite)")
        self.config = config
        self.windows = text_windows(tokenizer, config.context_len, config.text_sources)
        if len(self.windows.held_out) < config.eval_samples:
            raise ValueError(
                f"only {len(self.windows.held_out)} held-out windows of {config.context_len} tokens; "
                f"lower --eval-samples"
            )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.facts: dict[str, Any] = {"data": "text", **self.windows.facts}

    def train(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        del step  # windows are drawn at random, each step from the same generator
        index = torch.randint(0, len(self.windows.train), (self.config.batch_size,), generator=self.generator)
        ids = self.windows.train[index]
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def held_out(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        # Spread over the held-out documents rather than the first few.
        index = torch.linspace(0, len(self.windows.held_out) - 1, c.eval_samples).round().long()
        windows = self.windows.held_out[index]
        return [
            (windows[i : i + c.batch_size], torch.ones_like(windows[i : i + c.batch_size], dtype=torch.bool))
            for i in range(0, c.eval_samples, c.batch_size)
        ]


def gated_layers(model: LlamaFamilyForCausalLM) -> list[int]:
    """The layers whose keys the gates admit: the global ones (a sliding-window layer keeps its window)."""
    return [layer for layer, window in enumerate(model.config.layer_windows) if window is None]


def _forward(model: LlamaFamilyForCausalLM, ids: torch.Tensor, context: Any) -> torch.Tensor:
    b, t = ids.shape
    return model(ids.reshape(-1), torch.arange(t).repeat(b), context).view(b, t, -1)


def distillation_loss(
    model: LlamaFamilyForCausalLM, gates: WriteGates, ids: torch.Tensor, valid: torch.Tensor, config: GateTrainConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training objective and its parts (distillation, penalty, admitted fraction at tau)."""
    b, t = ids.shape
    windows, scale = model.config.layer_windows, model.config.attention_scale
    with torch.no_grad():
        teacher = _forward(model, ids, BatchedCausalContext(b, t, windows, scale))
    context = GatedTrainingContext(gates, b, t, config.local_window, config.eps, windows, scale)
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
def evaluate_held_out(
    model: LlamaFamilyForCausalLM,
    gates: WriteGates,
    config: GateTrainConfig,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Any]:
    """On held-out batches: admitted share per (layer, KV head) `[L, H]`, and hard-gated vs full attention.

    Next-token cross-entropy (nats) under full attention and under the hard admission mask, and the
    share of positions whose greedy next token is the same under both (padding and each sequence's
    last position left out). A sliding-window layer is not gated (it keeps its window): its row is 1.
    """
    windows, scale = model.config.layer_windows, model.config.attention_scale
    gated = gated_layers(model)
    counts = torch.zeros(gates.num_layers, gates.num_kv_heads)
    total = 0
    ce_full = ce_gated = agree = 0.0
    predicted = 0
    for ids, valid in batches:
        b, t = ids.shape
        full_hidden = _forward(model, ids, BatchedCausalContext(b, t, windows, scale))
        context = GatedTrainingContext(gates, b, t, config.local_window, 0.0, windows, scale, tau=config.tau)
        gated_hidden = _forward(model, ids, context)
        g = torch.stack(context.values)  # [global layers, B, T, H]
        counts[gated] += ((g >= config.tau) & valid.view(1, b, t, 1)).sum(dim=(1, 2)).float()
        total += int(valid.sum())
        scored = (valid[:, :-1] & valid[:, 1:]).reshape(-1)
        targets = ids[:, 1:].reshape(-1)[scored]
        for row in range(b):  # one row's logits at a time: [T, vocab] fp32 is 100 MB at SmolLM2's vocabulary
            keep = (valid[row, :-1] & valid[row, 1:]).nonzero().view(-1)
            if keep.numel() == 0:
                continue
            target = ids[row, 1:][keep]
            full_logits = model.compute_logits(full_hidden[row, keep])
            gated_logits = model.compute_logits(gated_hidden[row, keep])
            ce_full += float(torch.nn.functional.cross_entropy(full_logits, target, reduction="sum"))
            ce_gated += float(torch.nn.functional.cross_entropy(gated_logits, target, reduction="sum"))
            agree += float((full_logits.argmax(-1) == gated_logits.argmax(-1)).sum())
        predicted += int(targets.numel())
    fraction = counts / max(1, total)
    fraction[[layer for layer in range(gates.num_layers) if layer not in gated]] = 1.0
    return {
        "admitted_per_layer_head": fraction,
        "tokens": total,
        "cross_entropy_full": ce_full / max(1, predicted),
        "cross_entropy_gated": ce_gated / max(1, predicted),
        "top1_agreement": agree / max(1, predicted),
    }


@torch.no_grad()
def admitted_fraction(
    model: LlamaFamilyForCausalLM, gates: WriteGates, config: GateTrainConfig, pad_id: int
) -> torch.Tensor:
    """Share of held-out suite tokens admitted (g >= tau), per (layer, KV head): `[L, H]`."""
    del pad_id  # the suite's own
    evaluation = evaluate_held_out(model, gates, config, SuiteBatches(config).held_out())
    return torch.as_tensor(evaluation["admitted_per_layer_head"])


def train_gates(config: GateTrainConfig, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Train gates for `config.model_dir`; save them to `config.out`; return the path and a summary."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model = load_model(config.model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    mc = model.config
    if not gated_layers(model):
        raise ValueError(f"{config.model_dir}: every layer slides over a window, so no layer has keys to gate")
    gates = WriteGates(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, config.hidden, config.init_bias)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    batches: SuiteBatches | TextBatches = SuiteBatches(config) if config.data == "suite" else TextBatches(config)
    log_path = Path(config.out).with_suffix(".log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    history = []
    bar = tqdm(range(config.steps), disable=not progress, desc="train-gate", unit="step")
    with log_path.open("w") as log:
        for step in bar:
            ids, valid = batches.train(step)
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            loss, parts = distillation_loss(model, gates, ids, valid, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            record = {"step": step + 1, "loss": float(loss.detach()), **parts, "lr": config.lr_at(step)}
            history.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.4f}", admitted=f"{parts['admitted']:.2f}")
    seconds = time.perf_counter() - start
    eval_start = time.perf_counter()
    evaluation = evaluate_held_out(model, gates, config, batches.held_out())
    fraction = evaluation.pop("admitted_per_layer_head")
    summary = {
        "model": Path(config.model_dir).name,
        "local_window": config.local_window,
        "lambda": config.lam,
        "tau": config.tau,
        "steps": config.steps,
        "train_seconds": round(seconds, 1),
        "eval_seconds": round(time.perf_counter() - eval_start, 1),
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "admitted_fraction": round(float(fraction[gated_layers(model)].mean()), 4),
        "gated_layers": gated_layers(model),
        "admitted_per_layer_head": [[round(float(x), 4) for x in row] for row in fraction],
        "held_out": {
            "samples": config.eval_samples,
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in evaluation.items()},
        },
        "data": batches.facts,
        "parameters": sum(p.numel() for p in gates.parameters()),
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: v for k, v in asdict(config).items() if k not in ("model_dir", "out")},
    }
    path = gates.save(config.out, summary, dtype=SAVE_DTYPES[config.save_dtype])
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


__all__ = [
    "GateTrainConfig",
    "GatedTrainingContext",
    "admitted_heatmap",
    "distillation_loss",
    "evaluate_held_out",
    "train_gates",
]
