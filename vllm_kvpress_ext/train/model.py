"""`kvpress train-model`: train a small GQA Llama on the synthetic suite, from scratch.

Training runs the project's own model code (`models/llama.py`) with a batched causal attention
context, so what is trained is exactly what the engine serves. Sequences are the suite's training
view (`tasks/synthetic/training.py`): every record-style question of a sample becomes a chat turn and
only answer tokens (and `<eos>`) are targets.

Curriculum: the context length grows in stages (by default 128 -> 256 -> 512 -> final) so that
retrieval is learned on short, cheap sequences before the haystack gets long.

Evaluation is teacher-forced exact match on held-out seeds: the greedy answer equals the target
exactly when the argmax at every answer position (answer tokens, then `<eos>`) is the target given
the target prefix, so one forward pass scores a batch without generating.

Checkpoints (`checkpoint.pt`: model, optimizer, step, RNG state, config) are written every
`checkpoint_every` steps and at the end; `--resume` continues from one. The model is also exported
as an HF directory (`model/`: config.json, model.safetensors, tokenizer, generation_config.json)
that loads in the engine and in transformers. `log.jsonl` records loss, learning rate, throughput
and evaluation accuracy over time.
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
import torch.nn.functional as F
from tqdm import tqdm

from vllm_kvpress_ext.attention import causal_attention
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.models.writer import llama_config, random_model, save_model
from vllm_kvpress_ext.tasks.synthetic import TASKS, generate, make, training_example
from vllm_kvpress_ext.tasks.synthetic.records import record
from vllm_kvpress_ext.tasks.synthetic.training import TrainingExample
from vllm_kvpress_ext.tasks.tokenizer import (
    BOS,
    EOS,
    FILLER_WORDS,
    KEY_WORDS,
    PAD,
    VALUE_WORDS,
    VOCABULARY,
    save_tokenizer,
)

HELD_OUT_SEED = 1_000_000  # evaluation seeds start here; training seeds stay below
IGNORE = -100


@dataclass
class TrainConfig:
    out: str = "runs/model"
    steps: int = 20_000
    batch_size: int = 16
    context_len: int = 1024
    curriculum: tuple[int, ...] = (128, 256, 512)  # context lengths before `context_len`, equal shares of steps
    final_share: float = 0.4  # fraction of steps spent at `context_len`
    tasks: dict[str, float] = field(
        default_factory=lambda: {
            "associative_recall": 2.0,
            "niah_multikey": 2.0,
            "niah_multivalue": 1.0,
            "niah_multiquery": 1.0,
            "variable_tracking": 1.0,
            "aggregation": 1.0,
        }
    )
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4  # head_dim 32: enough slowly-rotating RoPE pairs to match keys far apart
    num_kv_heads: int = 2
    rope_theta: float = 500_000.0
    init_std: float = 0.02
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 500
    eval_samples: int = 32
    checkpoint_every: int = 500
    seed: int = 0
    threads: int = 0  # 0: torch's default
    # Per-task generator parameters (e.g. {"associative_recall": {"num_records": 8, "num_queries": 4}}).
    task_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    # checkpoint.pt whose weights and Adam moments start this run (step and schedule start afresh)
    init_from: str | None = None
    # Stop after this step while keeping the schedule of `steps` (a stage cut short, reproducibly).
    stop_after: int | None = None

    @property
    def last_step(self) -> int:
        return self.steps if self.stop_after is None else min(self.steps, self.stop_after)

    def context_at(self, step: int) -> int:
        """The curriculum: context length used at `step`."""
        final_start = int(self.steps * (1.0 - self.final_share))
        if step >= final_start or not self.curriculum:
            return self.context_len
        stage = step * len(self.curriculum) // max(1, final_start)
        return min(self.curriculum[stage], self.context_len)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to `min_lr_ratio * lr`."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def hf_config(self) -> dict[str, Any]:
        vocab = list(VOCABULARY)
        return llama_config(
            vocab_size=len(vocab),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            max_position_embeddings=max(4096, 2 * self.context_len),
            rope_theta=self.rope_theta,
            bos_token_id=vocab.index("<bos>"),
            eos_token_id=vocab.index(EOS),
        )

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads or self.num_heads == self.num_kv_heads:
            raise ValueError("the model must use grouped-query attention: num_heads a multiple > 1 of num_kv_heads")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")
        if not 0.0 < self.final_share <= 1.0:
            raise ValueError(f"final_share must be in (0, 1], got {self.final_share}")
        if self.rope_theta <= 0 or self.init_std <= 0 or self.lr <= 0:
            raise ValueError("rope_theta, init_std and lr must be > 0")
        if not self.tasks or min(self.tasks.values()) < 0 or sum(self.tasks.values()) <= 0:
            raise ValueError("tasks must map task names to non-negative weights, not all zero")
        unknown = sorted((set(self.tasks) | set(self.task_params)) - set(TASKS) - set(TRAINING_ONLY_TASKS))
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(sorted(TASKS))}")
        for task, params in self.task_params.items():
            if task in TRAINING_ONLY_TASKS:
                continue
            make(task, **{"context_length": None if task == "associative_recall" else self.context_len, **params})


class BatchedCausalContext:
    """Attention context for training: B equal-length sequences flattened to [B*T]; one fused SDPA call.

    `layer_windows` (a model's `config.layer_windows`) makes its sliding-window layers attend within their
    window, as the engine serves them; `scale` is the model's softmax scale (default 1/sqrt(head_dim))."""

    def __init__(
        self, batch: int, length: int, layer_windows: tuple[int | None, ...] = (), scale: float | None = None
    ) -> None:
        self.batch, self.length = batch, length
        self.layer_windows, self.scale = layer_windows, scale

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

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
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        out = causal_attention(
            q.view(b, t, *q.shape[1:]),
            k.view(b, t, *k.shape[1:]),
            v.view(b, t, *v.shape[1:]),
            scale,
            self.window(layer_idx),
        )
        return out.reshape(q.shape)


def _task_params(config: TrainConfig, task: str, context_len: int) -> dict[str, Any]:
    base: dict[str, Any] = {"context_length": context_len}
    if task == "associative_recall":
        base = {"context_length": None}  # no filler: dense supervision, every record queried
    return {**base, **config.task_params.get(task, {})}


COPY_TASK = "copy"  # training-only: key/value words, filler, the same words again (induction)
REPEAT_TASK = "record_repeat"  # training-only: key/value records, then the same records in another order
TRAINING_ONLY_TASKS = (COPY_TASK, REPEAT_TASK)


def copy_example(seed: int, length: int, span: int = 24) -> TrainingExample:
    """`<bos>`, filler, `span` distinct key/value words, more filler, the same words again; the repeat supervised.

    The pure induction pattern: every repeated word after the first is the word that followed the
    current one the first time. The filler before and between the two copies has a random length,
    so the repeat sits at a different distance in every sample and cannot be found by position: the
    model must match the current word against the context (as a value is found from its key), and
    that dense signal (span - 1 targets per sample) is what makes the retrieval circuit form within
    minutes rather than hours (docs/model.md).
    """
    rng = random.Random(seed)
    words = [*KEY_WORDS, *VALUE_WORDS]
    span = max(2, min(span, len(words), (length - 1) // 2))
    spare = max(0, length - 1 - 2 * span)
    gap = rng.randint(0, spare)
    prefix = rng.randint(0, spare - gap)
    ids = [VOCABULARY.index(BOS), *(VOCABULARY.index(rng.choice(FILLER_WORDS)) for _ in range(prefix))]
    chosen = [VOCABULARY.index(w) for w in rng.sample(words, span)]
    ids += chosen
    ids += [VOCABULARY.index(rng.choice(FILLER_WORDS)) for _ in range(gap)]
    start = len(ids)
    ids += chosen
    return TrainingExample(token_ids=ids, answer_spans=[(start + 1, len(ids))])


def record_repeat_example(seed: int, num_records: int, num_keys: int) -> TrainingExample:
    """`<bos> key k1 v1 . ... key kn vn .`, then the same records shuffled; the repeated values supervised.

    The step between the copy task and the suite's questions: the suite's record format, every
    repeated record a retrieval target (a question supervises one).
    """
    rng = random.Random(seed)
    keys = rng.sample(KEY_WORDS[:num_keys], num_records)
    values = rng.sample(VALUE_WORDS, num_records)
    ids = [VOCABULARY.index(BOS)]
    for k, v in zip(keys, values, strict=True):
        ids += [VOCABULARY.index(w) for w in record((k,), (v,))]
    spans = []
    for i in rng.sample(range(num_records), num_records):
        ids += [VOCABULARY.index(w) for w in record((keys[i],), (values[i],))]
        spans.append((len(ids) - 2, len(ids) - 1))  # the value, just before the closing "."
    return TrainingExample(token_ids=ids, answer_spans=spans)


def make_batch(
    config: TrainConfig, step: int, context_len: int, seed_base: int, pad_id: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids [B, T]` and next-token `labels [B, T]` (IGNORE outside answers and padding)."""
    names = list(config.tasks)
    weights = [config.tasks[n] for n in names]
    rows = []
    for i in range(config.batch_size):
        task = rng.choices(names, weights)[0]
        seed = seed_base + step * config.batch_size + i
        if task == COPY_TASK:
            params = config.task_params.get(COPY_TASK, {})
            rows.append(copy_example(seed, int(params.get("length", context_len)), int(params.get("span", 24))))
            continue
        if task == REPEAT_TASK:
            params = config.task_params.get(REPEAT_TASK, {})
            records, keys = int(params.get("num_records", 8)), int(params.get("num_keys", len(KEY_WORDS)))
            rows.append(record_repeat_example(seed, records, keys))
            continue
        sample = generate(task, seed, **_task_params(config, task, context_len))
        rows.append(training_example(sample))
    length = max(len(r.token_ids) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        ids[b, :n] = torch.tensor(row.token_ids)
        mask = torch.tensor(row.loss_mask)
        target = torch.tensor(row.token_ids)
        # Position t predicts token t + 1: a target token at position p is the label of position p - 1.
        labels[b, : n - 1] = torch.where(mask[1:], target[1:], torch.full_like(target[1:], IGNORE))
    return ids, labels


def forward_loss(model: LlamaFamilyForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    positions = torch.arange(t).repeat(b)
    hidden = model(ids.reshape(-1), positions, BatchedCausalContext(b, t))
    picked = labels.reshape(-1) != IGNORE
    logits = model.compute_logits(hidden[picked])
    return F.cross_entropy(logits, labels.reshape(-1)[picked])


@torch.no_grad()
def evaluate(model: LlamaFamilyForCausalLM, config: TrainConfig, context_len: int, pad_id: int) -> dict[str, float]:
    """Teacher-forced exact match of the first question of held-out samples, per task."""
    model.eval()
    results: dict[str, float] = {}
    for task_index, task in enumerate(config.tasks):
        if task in TRAINING_ONLY_TASKS:
            continue
        correct = 0
        for start in range(0, config.eval_samples, config.batch_size):
            count = min(config.batch_size, config.eval_samples - start)
            rows = [
                training_example(
                    generate(
                        task,
                        HELD_OUT_SEED + task_index * 100_000 + start + i,
                        **_task_params(config, task, context_len),
                    ),
                    all_turns=False,
                )
                for i in range(count)
            ]
            length = max(len(r.token_ids) for r in rows)
            ids = torch.full((count, length), pad_id, dtype=torch.long)
            for b, row in enumerate(rows):
                ids[b, : len(row.token_ids)] = torch.tensor(row.token_ids)
            hidden = model(ids.reshape(-1), torch.arange(length).repeat(count), BatchedCausalContext(count, length))
            predicted = model.compute_logits(hidden).argmax(-1).view(count, length)
            for b, row in enumerate(rows):
                ((s, e),) = row.answer_spans
                correct += bool((predicted[b, s - 1 : e - 1] == ids[b, s:e]).all())
        results[task] = correct / config.eval_samples
    model.train()
    return results


def _export(model: LlamaFamilyForCausalLM, config: TrainConfig, out: Path) -> Path:
    directory = out / "model"
    hf = config.hf_config()
    save_model(model, hf, directory)
    save_tokenizer(directory)
    generation = {
        "bos_token_id": hf["bos_token_id"],
        "eos_token_id": hf["eos_token_id"],
        "pad_token_id": list(VOCABULARY).index(PAD),
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


def _save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config: TrainConfig,
    rng: random.Random,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "config": asdict(config),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp,
    )
    tmp.replace(path)


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> Path:
    """Train (or resume) and return the exported HF model directory."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    model = random_model(config.hf_config(), seed=config.seed, std=config.init_std)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    rng = random.Random(config.seed)
    step = 0
    if config.init_from is not None and not (resume and checkpoint_path.exists()):
        _init_from(config.init_from, model, optimizer)
    if resume and checkpoint_path.exists():
        step = _resume(checkpoint_path, config, model, optimizer, rng)
    (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    _train_steps(config, model, optimizer, rng, step, progress)
    return _export(model, config, out)


def _init_from(path: str, model: Any, optimizer: torch.optim.Optimizer) -> None:
    source = torch.load(path, weights_only=False)
    try:
        model.load_state_dict(source["model"])
    except RuntimeError as err:
        raise ValueError(f"--init-from {path}: the checkpoint's model has another shape ({err})") from err
    # Carry the Adam moments over too: stages started with fresh moments (and a lighter copy
    # share) undid a learned circuit within 400 steps; carried over, it survived (docs/model.md).
    optimizer.load_state_dict(source["optimizer"])


def _resume(
    checkpoint_path: Path, config: TrainConfig, model: Any, optimizer: torch.optim.Optimizer, rng: random.Random
) -> int:
    """Load the checkpoint (refusing one trained with other settings) and return its step."""
    state = torch.load(checkpoint_path, weights_only=False)
    saved = {
        k: v
        for k, v in state["config"].items()
        if k not in ("out", "steps", "stop_after", "eval_every", "checkpoint_every", "threads")
    }
    mismatched = [k for k, v in saved.items() if _as_json(getattr(config, k)) != _as_json(v)]
    if mismatched:
        raise ValueError(f"cannot resume: the checkpoint was trained with different {', '.join(mismatched)}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _train_steps(
    config: TrainConfig, model: Any, optimizer: torch.optim.Optimizer, rng: random.Random, step: int, progress: bool
) -> None:
    """Steps from `step` to the last one, logging evaluations and saving checkpoints as configured."""
    out = Path(config.out)
    pad_id = list(VOCABULARY).index(PAD)
    model.train()
    bar = tqdm(total=config.last_step, initial=step, disable=not progress, desc="train", unit="step")
    window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
    with (out / "log.jsonl").open("a") as log:
        while step < config.last_step:
            context_len = config.context_at(step)
            ids, labels = make_batch(config, step, context_len, config.seed * 10_000_000, pad_id, rng)
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = forward_loss(model, ids, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
            window_loss += float(loss.detach())
            window_steps += 1
            window_tokens += ids.numel()
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", ctx=context_len, lr=f"{lr:.1e}")
            if step % config.eval_every == 0 or step == config.last_step:
                elapsed = time.perf_counter() - window_start
                record: dict[str, Any] = {
                    "step": step,
                    "time": time.time(),
                    "context_len": context_len,
                    "lr": lr,
                    "loss": window_loss / window_steps,
                    "tokens_per_s": window_tokens / elapsed,
                    "eval": evaluate(model, config, context_len, pad_id),
                }
                if context_len != config.context_len:
                    record["eval_final_context"] = evaluate(model, config, config.context_len, pad_id)
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.write(
                    f"step {step}: loss {record['loss']:.3f}, eval@{context_len} "
                    + ", ".join(f"{k} {v:.0%}" for k, v in record["eval"].items())
                )
                window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
            if step % config.checkpoint_every == 0 or step == config.last_step:
                _save_checkpoint(out / "checkpoint.pt", model, optimizer, step, config, rng)
                _export(model, config, out)
    bar.close()


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


__all__ = ["BatchedCausalContext", "TrainConfig", "evaluate", "train"]
