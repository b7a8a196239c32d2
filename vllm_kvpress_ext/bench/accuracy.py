"""`kvpress bench accuracy`: every policy's accuracy against the KV memory it actually held.

Each (policy, budget) runs the same held-out samples of each task through the engine with real
compression: pages are freed, and the memory figures are the pool's (whole pages held by the
request when it finished, so partial pages count). The protocol says where compression happens
(see `tasks/synthetic/prompt.py`): `served` after the prompt, `strict` before the answer cue so every
answer token comes from the compressed cache, `agnostic` before the question.

Coverage (K-VEC's Table 6 measure, `policies/kvec.py`): when a request finishes, which prompt
positions does the cache still hold? `coverage` is the fraction of prompt positions held by at least
one (layer, KV head) -- unique-token coverage across heads and layers; `head_coverage` is, per layer,
the fraction held by at least one KV head of that layer, averaged over layers. Both are means over a
cell's requests. Retention counts entries, so a policy that keeps the same tokens in every head and
one that spreads its budget over different tokens retain the same; coverage tells them apart. Prompt
tokens prefilled after compression (the strict and agnostic protocols) count as kept when still
held, generated tokens never count.

Outputs: a markdown table on stdout, `results.csv` and `results.json`, and `accuracy_vs_memory.png`
(one panel per task family, one line per policy, accuracy against mean KV MiB per request).
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from vllm_kvpress_ext.bench.budgets import budgets_for, make_policy, policy_label
from vllm_kvpress_ext.bench.report import format_table, markdown_table
from vllm_kvpress_ext.engine import KeptEntries, LLMEngine, SamplingParams
from vllm_kvpress_ext.policies.kvec import head_coverage, unique_token_coverage
from vllm_kvpress_ext.tasks.synthetic import TASKS, PromptSpec, build_prompt, generate, score
from vllm_kvpress_ext.tasks.synthetic.prompt import PROTOCOLS, Protocol

HELD_OUT_SEED = 1_000_000  # training draws seeds below this; evaluation samples start here
DEFAULT_POLICIES = ("full", "streaming_llm", "snapkv", "pyramidkv", "adakv", "h2o")
DEFAULT_BUDGETS = (0.5, 0.25, 0.1, 0.05)
DEFAULT_TASKS = ("niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "aggregation")


@dataclass(frozen=True)
class AccuracyConfig:
    model: str
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    tasks: tuple[str, ...] = DEFAULT_TASKS
    protocol: str = "strict"
    samples: int = 20
    context_len: int = 1024
    out_dir: str = "runs/accuracy"
    seed: int = HELD_OUT_SEED
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 16
    plot: bool = True
    task_params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls, model: str, out_dir: str = "runs/accuracy-quick") -> AccuracyConfig:
        """A run that finishes in well under a minute on a 2-core CPU."""
        return cls(
            model=model,
            policies=("full", "streaming_llm", "snapkv"),
            budgets=(0.25,),
            tasks=("niah_multikey", "variable_tracking"),
            samples=4,
            context_len=256,
            out_dir=out_dir,
        )


@dataclass
class Row:
    task: str
    policy: str
    budget: float | None
    protocol: str
    samples: int
    accuracy: float
    kv_bytes_mean: float
    kv_bytes_p90: float
    retention: float
    seconds: float
    coverage: float  # prompt positions held by >= 1 (layer, KV head), mean over requests
    head_coverage: float  # per layer: prompt positions held by >= 1 of its heads; mean over layers, requests


def prompt_coverage(kept: KeptEntries, prompt_len: int) -> tuple[float, float]:
    """(unique-token coverage, mean per-layer head coverage) of the prompt positions a finished request held.

    `kept` comes from the cache itself (global region and local ring, read as the request finished),
    not from a policy's plan, so decode-time evictions and protocol tails count as they really are.
    """
    held = kept.mask(prompt_len)
    return unique_token_coverage(held), head_coverage(held)


def _p90(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)])


def run_accuracy_bench(config: AccuracyConfig) -> list[Row]:
    if config.protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {config.protocol!r}")
    for task in config.tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(sorted(TASKS))}")
    engine = LLMEngine(
        config.model,
        dtype=config.dtype,
        device=config.device,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max(2048, config.context_len + 64),
    )
    if engine.tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer; the accuracy bench needs the suite's tokenizer")
    specs: dict[str, list[PromptSpec]] = {}
    for task in config.tasks:
        params = {"context_length": config.context_len, **config.task_params.get(task, {})}
        specs[task] = [
            build_prompt(generate(task, config.seed + i, **params), engine.tokenizer, cast(Protocol, config.protocol))
            for i in range(config.samples)
        ]
    runs = [(p, b) for p in config.policies for b in budgets_for(p, config.budgets)]
    for name, budget in runs:  # validate every policy before spending time
        make_policy(name, budget)
    rows: list[Row] = []
    total = len(runs) * len(config.tasks) * config.samples
    with tqdm(total=total, desc="accuracy", unit="sample") as bar:
        for name, budget in runs:
            policy = make_policy(name, budget)
            for task in config.tasks:
                rows.append(
                    _run_cell(engine, policy, policy_label(name), budget, task, specs[task], config.protocol, bar)
                )
    _report(rows, config)
    return rows


def _run_cell(
    engine: LLMEngine,
    policy: Any,
    name: str,
    budget: float | None,
    task: str,
    specs: list[PromptSpec],
    protocol: str,
    bar: tqdm,
) -> Row:
    start = time.perf_counter()
    pending: dict[str, PromptSpec] = {}
    for i, spec in enumerate(specs):
        params = SamplingParams(
            max_tokens=spec.max_new_tokens, temperature=0.0, stop_token_ids=spec.stop_ids, return_kept=True
        )
        rid = f"{name}-{budget}-{task}-{i}"
        compress_after = spec.compress_after if spec.compress_after < len(spec.token_ids) else None
        engine.add_request(spec.token_ids, params, request_id=rid, policy=policy, compress_after=compress_after)
        pending[rid] = spec
    correct, kv_bytes, retention, coverage = 0, [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in pending:
                if out.finish_reason == "error":  # the engine isolates a policy failure; a bench must not
                    raise RuntimeError(f"the policy failed on a request: {out.error}")
                correct += score(pending[out.request_id], out.output_token_ids)
                kv_bytes.append(out.kv.kv_bytes)
                retention.append(out.kv.retention)
                assert out.kv.kept is not None  # asked for with `return_kept`
                coverage.append(prompt_coverage(out.kv.kept, len(out.prompt_token_ids)))
                bar.update(1)
    return Row(
        task=task,
        policy=name,
        budget=budget,
        protocol=protocol,
        samples=len(specs),
        accuracy=correct / len(specs),
        kv_bytes_mean=sum(kv_bytes) / len(kv_bytes),
        kv_bytes_p90=_p90(kv_bytes),
        retention=sum(retention) / len(retention),
        seconds=time.perf_counter() - start,
        coverage=sum(c for c, _ in coverage) / len(coverage),
        head_coverage=sum(h for _, h in coverage) / len(coverage),
    )


def _report(rows: list[Row], config: AccuracyConfig) -> None:
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    headers = [
        *("task", "policy", "budget", "protocol", "n", "accuracy", "KV KiB mean", "KV KiB p90", "retention"),
        *("coverage", "head cov"),
    ]
    table = [
        [
            r.task,
            r.policy,
            "-" if r.budget is None else f"{r.budget:g}",
            r.protocol,
            r.samples,
            f"{100 * r.accuracy:.1f}%",
            f"{r.kv_bytes_mean / 1024:.1f}",
            f"{r.kv_bytes_p90 / 1024:.1f}",
            f"{r.retention:.3f}",
            f"{r.coverage:.3f}",
            f"{r.head_coverage:.3f}",
        ]
        for r in rows
    ]
    print(
        f"\nprotocol: {config.protocol} (compression "
        + {
            "served": "after the whole prompt",
            "strict": "before the answer cue: every answer token decoded from the compressed cache",
            "agnostic": "before the question",
        }.get(config.protocol, "?")
        + ")"
    )
    print(format_table(headers, table))
    md = markdown_table(headers, table)
    (out / "results.md").write_text("\n".join(md) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / "results.json").write_text(
        json.dumps({"config": asdict(config), "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    if config.plot:
        _plot(rows, out / "accuracy_vs_memory.png", config)
    print(f"wrote {out}/results.md, results.csv, results.json" + (", accuracy_vs_memory.png" if config.plot else ""))


def _plot(rows: list[Row], path: Path, config: AccuracyConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in rows))
    cols = min(3, len(tasks))
    rows_n = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for policy in dict.fromkeys(r.policy for r in rows):
            pts = sorted(
                (r.kv_bytes_mean / 2**20, 100 * r.accuracy) for r in rows if r.task == task and r.policy == policy
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=policy)
        ax.set_title(task)
        ax.set_xlabel("KV MiB held per request (pool)")
        ax.set_ylabel("exact match %")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"accuracy vs KV memory, {config.protocol} protocol, context {config.context_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["AccuracyConfig", "Row", "prompt_coverage", "run_accuracy_bench"]
