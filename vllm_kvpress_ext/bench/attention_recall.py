"""`kvpress bench recall`: how much of the full cache's future decode attention each policy's kept set serves.

For a real model and the natural-language tasks (served protocol: the policy compresses after the whole
prompt), per sample:

1. the prompt is prefilled once (`engine/prefix.py`) and the full cache answers greedily: the answer
   tokens a_1..a_m are what the model reads the cache for after compression;
2. an independent dense forward over prompt + answer (no pool, no policy: `RecordingContext`) records,
   per layer, the answer positions' queries and every prompt key and value; from them, for every layer
   l, query head h and answer position t, the full cache's attention A[l, h, t, j] over the prompt
   positions j (renormalised over the prompt, whose keys are the ones a policy can drop);
3. each policy compresses its own fork of the prefix; its kept set K[l, g] (per layer and KV head,
   read from the pool right after compression) is scored against that attention:
       recall  = sum_{j in K} A[l, h, t, j]                        (share of the attention mass kept)
       error   = || o - o_K || / || o ||,  o = sum_j A v_j,  o_K = sum_{j in K} A v_j / sum_{j in K} A
   (the relative change of the attention output if the step read only the kept entries), averaged over
   l, h and t. Recall is dominated by the attention sinks (which every policy keeps and whose values
   are small); the output error weighs each entry by what it contributes.

`--match POLICY` runs a budgeted policy on each sample at exactly the retention a budget-free policy
(GVote) chose on that sample, so the two are compared at equal memory.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.attention import causal_attention
from vllm_kvpress_ext.bench.budgets import budgets_for, make_policy, policy_label, with_ratio
from vllm_kvpress_ext.bench.report import format_table, markdown_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.prefix import PrefixSnapshot, add_forked_request, capture_prefix, merged_capture_spec
from vllm_kvpress_ext.engine.request import RequestOutput
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.policies import KVPolicy, create_policy
from vllm_kvpress_ext.policies.capture import CaptureSpec
from vllm_kvpress_ext.tasks.natural import HELD_OUT_SEED, NATURAL_TASKS, NaturalPrompt, render


@dataclass(frozen=True)
class RecallConfig:
    model: str
    policies: tuple[str, ...] = ("gvote", "adakv", "snapkv")
    budgets: tuple[float, ...] = (0.25,)
    match: tuple[str, ...] = ("adakv",)
    tasks: tuple[str, ...] = ("nl_passkey", "nl_niah_single", "nl_niah_multikey")
    context_lens: tuple[int, ...] = (2048,)
    samples: int = 8
    seed: int = HELD_OUT_SEED
    dtype: str = "float32"
    device: str = "cpu"
    out_dir: str = "runs/recall"


@dataclass
class RecallRun:
    """One policy's kept set on one sample, scored against that sample's future decode attention."""

    context_len: int
    task: str
    seed: int
    policy: str
    budget: str  # a ratio, "-" (budget-free) or "=POLICY" (at that policy's retention on this sample)
    retention: float
    recall: float
    error: float
    recall_per_layer: list[float] = field(default_factory=list)
    error_per_layer: list[float] = field(default_factory=list)


class RecordingContext:
    """A dense causal attention context for one sequence that keeps each layer's attention input, q, k and v."""

    def __init__(self) -> None:
        self.hidden: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pre_rope: torch.Tensor,
    ) -> torch.Tensor:
        self.hidden[layer_idx] = hidden
        self.queries[layer_idx], self.keys[layer_idx], self.values[layer_idx] = q.float(), k.float(), v.float()
        return causal_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), q.shape[-1] ** -0.5)[0]


@dataclass
class FutureAttention:
    """Per layer: the answer positions' attention over the prompt `[Hq, m, n]` and the prompt values `[Hq, n, d]`."""

    attention: list[torch.Tensor]
    values: list[torch.Tensor]


@torch.no_grad()
def future_attention(model: LlamaFamilyForCausalLM, prompt: list[int], answer: list[int]) -> FutureAttention:
    """The full cache's attention of the answer tokens' decode steps over the prompt, per layer (dense, fp32)."""
    n, tokens = len(prompt), torch.tensor(prompt + answer)
    device = next(model.parameters()).device
    recorder = RecordingContext()
    model(tokens.to(device), torch.arange(len(tokens), device=device), recorder)
    attention, values = [], []
    for layer in range(len(model.layers)):
        q, k, v = recorder.queries[layer][n:], recorder.keys[layer], recorder.values[layer]
        group = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        # Rows are decode steps n..n+m-1; each sees the whole prompt and the answer tokens before it.
        logits = torch.einsum("thd,jhd->htj", q, k.repeat_interleave(group, dim=1)) * scale
        future = torch.arange(k.shape[0], device=device).view(1, -1) > torch.arange(n, k.shape[0], device=device).view(
            -1, 1
        )
        probs = torch.softmax(logits.masked_fill(future.unsqueeze(0), float("-inf")), dim=-1)[..., :n]
        attention.append((probs / probs.sum(-1, keepdim=True)).cpu())
        values.append(v[:n].repeat_interleave(group, dim=1).transpose(0, 1).cpu())
    return FutureAttention(attention, values)


def score_kept(future: FutureAttention, kept: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer (recall, output error) of a kept mask `[L, Hkv, n]` (see the module docstring)."""
    recalls, errors = [], []
    for layer, (attn, values) in enumerate(zip(future.attention, future.values, strict=True)):
        mask = kept[layer].repeat_interleave(attn.shape[0] // kept.shape[1], dim=0).to(attn.dtype).unsqueeze(1)
        held = attn * mask  # [Hq, m, n]
        mass = held.sum(-1)
        full_out = attn @ values
        kept_out = (held / mass.clamp_min(1e-30).unsqueeze(-1)) @ values
        error = (full_out - kept_out).norm(dim=-1) / full_out.norm(dim=-1).clamp_min(1e-30)
        recalls.append(float(mass.mean()))
        errors.append(float(error.mean()))
    return recalls, errors


def run_recall_bench(config: RecallConfig) -> list[RecallRun]:
    _validate(config)
    start = time.perf_counter()
    longest = max(config.context_lens) + 64
    engine = LLMEngine(
        config.model, dtype=config.dtype, device=config.device, max_num_batched_tokens=longest, max_num_seqs=8
    )
    if engine.tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer; natural-language tasks need one")
    fixed = [(p, b) for p in config.policies for b in budgets_for(p, config.budgets)]
    policies = {(p, b): make_policy(p, b) for p, b in fixed}
    matched = [create_policy(m) for m in config.match]
    spec = merged_capture_spec([*policies.values(), *matched])
    runs: list[RecallRun] = []
    for length in config.context_lens:
        for task in config.tasks:
            for i in range(config.samples):
                prompt = render(task, engine.tokenizer, length, config.seed + i, "served")
                runs += _score_sample(engine, prompt, length, spec, policies, matched, config.match)
                _print_progress(runs, length, task, i)
    _report(runs, config, time.perf_counter() - start)
    return runs


def _score_sample(
    engine: LLMEngine,
    prompt: NaturalPrompt,
    length: int,
    spec: CaptureSpec,
    policies: dict[tuple[str, float | None], KVPolicy],
    matched: list[KVPolicy],
    match_names: tuple[str, ...],
) -> list[RecallRun]:
    tag = f"{length}-{prompt.task}-{prompt.seed}"
    snapshot = capture_prefix(engine, prompt.token_ids, spec, f"prefix-{tag}")
    answer = _full_answer(engine, snapshot, prompt, tag)
    future = future_attention(engine.model, prompt.token_ids, answer)
    runs = []
    free_retention: list[tuple[str, float]] = []
    for (name, budget), policy in policies.items():
        kept = _kept_at_compression(engine, snapshot, policy, f"{name}-{budget}-{tag}")
        label = "-" if budget is None else f"{budget:g}"
        runs.append(_run(length, prompt, policy_label(name), label, kept, future))
        if budget is None and policy.name != "full":
            free_retention.append((policy_label(name), runs[-1].retention))
    for source, retention in free_retention:
        for name, base in zip(match_names, matched, strict=True):
            policy = with_ratio(base, max(retention, 1e-3))
            kept = _kept_at_compression(engine, snapshot, policy, f"{name}={source}-{tag}")
            runs.append(_run(length, prompt, name, f"={source}", kept, future))
    return runs


def _full_answer(engine: LLMEngine, snapshot: PrefixSnapshot, prompt: NaturalPrompt, tag: str) -> list[int]:
    """The full cache's greedy answer: the snapshot's next token, then the decode steps after it."""
    first = [snapshot.next_token]
    if prompt.max_new_tokens <= 1:
        return first
    params = SamplingParams(max_tokens=prompt.max_new_tokens - 1, temperature=0.0)
    rid = add_forked_request(engine, snapshot, [*prompt.token_ids, *first], params, f"full-answer-{tag}", None)
    return first + list(_run_to_completion(engine)[rid].output_token_ids)


def _kept_at_compression(
    engine: LLMEngine, snapshot: PrefixSnapshot, policy: KVPolicy | None, rid: str
) -> torch.Tensor:
    """`[L, Hkv, n]`: the prompt entries each (layer, KV head) of the policy's fork held right after compression."""
    n = snapshot.length
    params = SamplingParams(max_tokens=1, temperature=0.0, return_kept=True)
    add_forked_request(engine, snapshot, [*snapshot.token_ids, snapshot.next_token], params, rid, policy)
    out = _run_to_completion(engine)[rid]
    kept = out.kv.kept_at_compression or out.kv.kept
    assert kept is not None
    return kept.mask(n)


def _run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _run(
    length: int, prompt: NaturalPrompt, policy: str, budget: str, kept: torch.Tensor, future: FutureAttention
) -> RecallRun:
    recalls, errors = score_kept(future, kept)
    return RecallRun(
        length,
        prompt.task,
        prompt.seed,
        policy,
        budget,
        float(kept.float().mean()),
        sum(recalls) / len(recalls),
        sum(errors) / len(errors),
        recalls,
        errors,
    )


def _validate(config: RecallConfig) -> None:
    unknown = [t for t in config.tasks if t not in NATURAL_TASKS]
    if unknown:
        raise ValueError(f"unknown natural task(s) {', '.join(unknown)}; known: {', '.join(NATURAL_TASKS)}")
    if config.samples < 1:
        raise ValueError(f"samples must be >= 1, got {config.samples}")
    for name in config.match:
        if "ratio" not in getattr(create_policy(name), "__dataclass_fields__", {}):
            raise ValueError(f"--match takes policies with a ratio budget; {name!r} has none")


def _print_progress(runs: list[RecallRun], length: int, task: str, index: int) -> None:
    mine = [r for r in runs if r.context_len == length and r.task == task and r.seed == runs[-1].seed]
    cells = ", ".join(
        f"{r.policy}{'' if r.budget == '-' else ' ' + r.budget}: {r.retention:.2f}/{r.error:.3f}" for r in mine
    )
    print(f"[{length} {task} #{index}] retention/error: {cells}", flush=True)


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal interval (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, 1.96 * math.sqrt(var / len(values))


def summarise(runs: list[RecallRun]) -> list[dict[str, Any]]:
    """Per (context length, policy, budget): runs, retention, recall and output error (means, 95% intervals)."""
    groups: dict[tuple[int, str, str], list[RecallRun]] = defaultdict(list)
    for r in runs:
        groups[(r.context_len, r.policy, r.budget)].append(r)
    rows = []
    for (length, policy, budget), group in groups.items():
        retention, recall, error = (
            mean_interval([getattr(r, f) for r in group]) for f in ("retention", "recall", "error")
        )
        layers = len(group[0].error_per_layer)
        rows.append(
            {
                "context_len": length,
                "policy": policy,
                "budget": budget,
                "runs": len(group),
                "retention": retention,
                "recall": recall,
                "error": error,
                "error_per_layer": [sum(r.error_per_layer[i] for r in group) / len(group) for i in range(layers)],
            }
        )
    return rows


def _report(runs: list[RecallRun], config: RecallConfig, seconds: float) -> None:
    rows = summarise(runs)
    headers = ["ctx", "policy", "budget", "runs", "retention", "recall %", "output error"]
    table = [
        [
            r["context_len"],
            r["policy"],
            r["budget"],
            r["runs"],
            f"{r['retention'][0]:.3f} ± {r['retention'][1]:.3f}",
            f"{100 * r['recall'][0]:.1f} ± {100 * r['recall'][1]:.1f}",
            f"{r['error'][0]:.3f} ± {r['error'][1]:.3f}",
        ]
        for r in rows
    ]
    print(
        f"\nmodel {config.model}; served protocol; tasks {', '.join(config.tasks)}; {config.samples} samples each; "
        "recall = share of the full cache's future decode attention on kept entries; output error = relative change "
        "of the attention output; mean ± 95% interval over samples; budget '=P': at P's retention on each sample"
    )
    print(format_table(headers, table))
    print(f"({seconds:.0f} s)")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(markdown_table(headers, table)) + "\n")
    (out / "runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
