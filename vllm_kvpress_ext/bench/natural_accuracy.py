"""`kvpress bench accuracy` on a real pretrained model: natural-language tasks, every policy, KV bytes held.

For each context length, task and held-out sample, the part of the prompt every policy shares (the
context under the question-agnostic protocol, the whole prompt under the served one) is prefilled
ONCE (`engine/prefix.py`), recording the union of what the policies' prefill hooks read. Every
(policy, budget) then starts from its own copy of that cache, compresses it, prefills the question
and decodes the answer; the copies run as one continuous batch. This equals running each request
whole (tests/test_prefix_fork.py) at a fraction of the cost: on a CPU the prefill is nearly all
of it. A policy that gates writes during prefill (WG-KV) cannot share a prefill and runs whole; one
that cannot run on this model (WG-KV without trained gates) gets a row that says why.

Memory is what the page pool held for the request when it finished (whole pages, so partial pages
count); accuracy is RULER's string match (fraction of the reference answers found in the output).
Outputs: tables on stdout (overall, then per task), results.md/.csv/.json and accuracy_vs_memory.png.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_kvpress_ext.bench.budgets import budgets_for, make_policy, policy_label
from vllm_kvpress_ext.bench.report import format_table, markdown_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.prefix import PrefixSnapshot, add_forked_request, capture_prefix, merged_capture_spec
from vllm_kvpress_ext.engine.request import RequestOutput
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.policies import KVPolicy, policy_names
from vllm_kvpress_ext.policies.base import AdmissionPolicy
from vllm_kvpress_ext.tasks.natural import (
    FILLER_KINDS,
    HELD_OUT_SEED,
    NATURAL_PROTOCOLS,
    NATURAL_TASKS,
    QUESTIONS_PER_CONTEXT,
    NaturalPrompt,
    render_questions,
    score,
)

DEFAULT_BUDGETS = (0.5, 0.25, 0.1)


@dataclass(frozen=True)
class NaturalAccuracyConfig:
    model: str
    policies: tuple[str, ...] = field(
        default_factory=lambda: tuple(["full", *(p for p in policy_names() if p != "full")])
    )
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    tasks: tuple[str, ...] = tuple(NATURAL_TASKS)
    context_lens: tuple[int, ...] = (2048, 4096)
    samples: int = 4
    questions_per_context: int = 1  # tasks with several questions (QUESTIONS_PER_CONTEXT) ask up to this many
    protocol: str = "agnostic"
    filler: str = "noise"
    out_dir: str = "runs/accuracy-natural"
    seed: int = HELD_OUT_SEED
    dtype: str = "float32"
    device: str = "cpu"
    kv_memory: int | None = None  # default: room for the prefix copies of one sample's runs
    plot: bool = True


@dataclass
class Run:
    """One (policy, budget) on one sample."""

    context_len: int
    task: str
    policy: str
    budget: float | None
    seed: int
    score: float
    kv_bytes: int
    retention: float
    text: str
    question: int = 0  # which of the sample's questions (one context, several questions)


@dataclass
class NaturalRow:
    context_len: int
    task: str
    policy: str
    budget: float | None
    samples: int
    accuracy: float
    kv_bytes_mean: float
    retention: float
    note: str = ""


def run_natural_accuracy(config: NaturalAccuracyConfig) -> list[NaturalRow]:
    _validate(config)
    start = time.perf_counter()
    model_config = load_config(config.model)
    if max(config.context_lens) + 200 > model_config.max_position_embeddings:
        raise ValueError(f"context lengths up to {max(config.context_lens)} exceed the model's limit")
    runs_per_sample = [(p, b) for p in config.policies for b in budgets_for(p, config.budgets)]
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * 4
    # Room for the full prefix, the full-cache copy and every compressed copy of about two samples at once.
    copies = 2 * (3 + sum(b or 0.5 for _, b in runs_per_sample))
    kv_memory = config.kv_memory or int(per_token * (max(config.context_lens) + 256) * copies)
    engine = LLMEngine(
        config.model,
        dtype=config.dtype,
        device=config.device,
        kv_memory=kv_memory,
        max_num_seqs=2 * len(runs_per_sample) + 4,
        max_num_batched_tokens=max(config.context_lens) + 256,
    )
    if engine.tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer; natural-language tasks need one")
    policies: dict[tuple[str, float | None], KVPolicy | str | None] = {}
    for name, budget in runs_per_sample:
        try:
            policy = make_policy(name, budget)
            if isinstance(policy, AdmissionPolicy):
                # Fails here when it cannot run on this model (e.g. WG-KV without gates for it).
                policy.admission(engine.model_dir, engine.device, engine.runner.gate_store)
            policies[(name, budget)] = policy
        except (OSError, ValueError) as err:
            policies[(name, budget)] = f"not run: {err}"
    runnable = [p for p in policies.values() if isinstance(p, KVPolicy)]
    spec = merged_capture_spec([p for p in runnable if _shares_prefill(p, engine)])

    # Every sample's copies join one continuous batch: decode steps are shared by all pending requests.
    results: dict[str, RequestOutput] = {}
    pending: dict[str, tuple[NaturalPrompt, list[int], str, float | None, int]] = {}
    prefill_seconds = 0.0
    total = len(config.context_lens) * len(config.tasks) * config.samples
    with tqdm(total=total, desc="samples prefilled", unit="sample") as bar:
        for length in config.context_lens:
            for task in config.tasks:
                for i in range(config.samples):
                    prompts = render_questions(
                        task,
                        engine.tokenizer,
                        length,
                        config.seed + i,
                        min(config.questions_per_context, QUESTIONS_PER_CONTEXT.get(task, 1)),
                        config.protocol,  # type: ignore[arg-type]  # checked by _validate
                        config.filler,  # type: ignore[arg-type]
                    )
                    snapshot = None
                    for prompt in prompts:
                        # Question-agnostic: every question forks one prefill of the shared context, and each
                        # fork's policy compresses that context alone, so all of them read the same compressed
                        # cache, the one a reused prefix holds. Served: each question is its own prompt.
                        if snapshot is None or prompt.compress_after is None:
                            t0 = time.perf_counter()
                            split = prompt.compress_after or len(prompt.token_ids)
                            prefix_id = f"prefix-{length}-{task}-{i}-{prompt.question}"
                            snapshot = capture_prefix(
                                engine, prompt.token_ids[:split], spec, prefix_id, finished=results
                            )
                            prefill_seconds += time.perf_counter() - t0
                        pending |= _submit_sample(engine, prompt, snapshot, policies, length, results)
                    bar.update(1)
    _run_to_completion(engine, results)
    runs = []
    for rid, (prompt, first, name, budget, length) in pending.items():
        out = results[rid]
        text = engine.tokenizer.decode(first + list(out.output_token_ids), skip_special_tokens=True)
        label = policy_label(name)
        score_ = score(prompt, text)
        runs.append(
            Run(
                length,
                prompt.task,
                label,
                budget,
                prompt.seed,
                score_,
                out.kv.kv_bytes,
                out.kv.retention,
                text,
                prompt.question,
            )
        )
    rows = _aggregate(runs, policies, config)
    seconds = time.perf_counter() - start
    _report(rows, config, seconds, prefill_seconds, runs)
    return rows


def _validate(config: NaturalAccuracyConfig) -> None:
    if config.protocol not in NATURAL_PROTOCOLS:
        raise ValueError(f"protocol must be one of {NATURAL_PROTOCOLS} for natural tasks, got {config.protocol!r}")
    if config.filler not in FILLER_KINDS:
        raise ValueError(f"filler must be one of {FILLER_KINDS}, got {config.filler!r}")
    unknown = [t for t in config.tasks if t not in NATURAL_TASKS]
    if unknown:
        raise ValueError(f"unknown natural task(s) {', '.join(unknown)}; known: {', '.join(NATURAL_TASKS)}")
    if config.samples < 1:
        raise ValueError(f"samples must be >= 1, got {config.samples}")
    if config.questions_per_context < 1:
        raise ValueError(f"questions per context must be >= 1, got {config.questions_per_context}")


def _shares_prefill(policy: KVPolicy, engine: LLMEngine) -> bool:
    if not isinstance(policy, AdmissionPolicy):
        return True
    return policy.admission(engine.model_dir, engine.device, engine.runner.gate_store) is None


def _submit_sample(
    engine: LLMEngine,
    prompt: NaturalPrompt,
    snapshot: PrefixSnapshot,
    policies: dict[tuple[str, float | None], Any],
    length: int,
    results: dict[str, RequestOutput],
) -> dict[str, tuple[NaturalPrompt, list[int], str, float | None, int]]:
    """Queue every runnable (policy, budget) of one sample: forks of the prefix, whole runs for the others."""
    served = prompt.compress_after is None
    # Served: the first answer token comes from the full-cache prefill (the snapshot's), the rest from the
    # compressed cache, exactly as for a served request; the fork's prompt is the prompt plus that token.
    tokens = [*prompt.token_ids, snapshot.next_token] if served else prompt.token_ids
    first = [snapshot.next_token] if served else []
    pending = {}
    for (name, budget), policy in policies.items():
        if isinstance(policy, str):
            continue
        rid = f"{name}-{budget}-{length}-{prompt.task}-{prompt.seed}-{prompt.question}"
        params = SamplingParams(max_tokens=prompt.max_new_tokens - len(first), temperature=0.0)
        while True:
            try:
                if policy is None or _shares_prefill(policy, engine):
                    add_forked_request(engine, snapshot, tokens, params, rid, policy)
                else:
                    engine.add_request(
                        prompt.token_ids, params, rid, policy=policy, compress_after=prompt.compress_after
                    )
                break
            except RuntimeError:  # no room for another prefix copy: run the batch until some finish
                if not engine.has_unfinished_requests():
                    raise
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
        pending[rid] = (prompt, first, name, budget, length)
    return pending


def _run_to_completion(engine: LLMEngine, results: dict[str, RequestOutput]) -> None:
    with tqdm(desc="decode steps", unit="step") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
            bar.update(1)


def _aggregate(
    runs: list[Run], policies: dict[tuple[str, float | None], Any], config: NaturalAccuracyConfig
) -> list[NaturalRow]:
    groups: dict[tuple[int, str, str, float | None], list[Run]] = defaultdict(list)
    for r in runs:
        groups[(r.context_len, r.task, r.policy, r.budget)].append(r)
    rows = []
    for length in config.context_lens:
        for (name, budget), policy in policies.items():
            for task in config.tasks:
                group = groups.get((length, task, policy_label(name), budget), [])
                if isinstance(policy, str) or not group:
                    rows.append(
                        NaturalRow(
                            length,
                            task,
                            policy_label(name),
                            budget,
                            0,
                            math.nan,
                            math.nan,
                            math.nan,
                            policy if isinstance(policy, str) else "no runs",
                        )
                    )
                    continue
                rows.append(
                    NaturalRow(
                        length,
                        task,
                        policy_label(name),
                        budget,
                        len(group),
                        sum(r.score for r in group) / len(group),
                        sum(r.kv_bytes for r in group) / len(group),
                        sum(r.retention for r in group) / len(group),
                    )
                )
    return rows


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}"


def wilson_interval(mean: float, runs: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate `mean` over `runs` generations ((nan, nan) without runs).

    Exact for pass/fail scores; for multi-answer tasks (a score is the share of answers found) it treats the
    mean as a rate, which is what a reader compares across rows. Unlike mean +- 1.96 sd, it does not shrink
    to a point when every run scored the same (8 of 8 right is [0.68, 1], not [1, 1]).
    """
    if runs == 0 or math.isnan(mean):
        return math.nan, math.nan
    centre = (mean + z * z / (2 * runs)) / (1 + z * z / runs)
    half = z * math.sqrt(mean * (1 - mean) / runs + z * z / (4 * runs * runs)) / (1 + z * z / runs)
    return max(0.0, centre - half), min(1.0, centre + half)


def task_weighted_mean(runs: list[Run]) -> tuple[float, float]:
    """The mean over tasks of each task's mean score, and its effective number of runs (Kish's).

    Each run weighs 1 / (runs of its task), so a task asked more questions per context counts as much as
    one asked once, as the row's accuracy (the mean of the task columns) does; the interval is then taken
    over (sum w)^2 / sum w^2 runs. With the same number of runs per task that is the plain mean over runs.
    """
    if not runs:
        return math.nan, 0.0
    per_task: dict[str, int] = defaultdict(int)
    for run in runs:
        per_task[run.task] += 1
    weights = [1.0 / per_task[run.task] for run in runs]
    total = sum(weights)
    mean = sum(w * run.score for w, run in zip(weights, runs, strict=True)) / total
    return mean, total * total / sum(w * w for w in weights)


def _summary(rows: list[NaturalRow], runs: list[Run]) -> list[dict[str, Any]]:
    """Per (length, policy, budget): accuracy (with its 95% interval over all the row's generations) and KV
    bytes averaged over tasks, full cache first."""
    groups: dict[tuple[int, str, float | None], list[NaturalRow]] = defaultdict(list)
    for r in rows:
        groups[(r.context_len, r.policy, r.budget)].append(r)
    scores: dict[tuple[int, str, float | None], list[Run]] = defaultdict(list)
    for run in runs:
        scores[(run.context_len, run.policy, run.budget)].append(run)
    summary = []
    for (length, policy, budget), group in groups.items():
        mean, effective_runs = task_weighted_mean(scores.get((length, policy, budget), []))
        low, high = wilson_interval(mean, effective_runs)
        summary.append(
            {
                "context_len": length,
                "policy": policy,
                "budget": budget,
                "accuracy": _mean([r.accuracy for r in group]),
                "accuracy_interval": [low, high],
                "kv_bytes_mean": _mean([r.kv_bytes_mean for r in group]),
                "retention": _mean([r.retention for r in group]),
                "runs": sum(r.samples for r in group),
                "tasks": {r.task: r.accuracy for r in group},
                "note": next((r.note for r in group if r.note), ""),
            }
        )
    return summary


def _report(
    rows: list[NaturalRow], config: NaturalAccuracyConfig, seconds: float, prefill_seconds: float, runs: list[Run]
) -> None:
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = _summary(rows, runs)
    tasks = list(config.tasks)
    headers = ["ctx", "policy", "budget", "runs", "accuracy %", "95% interval", "KV MiB held", "retention", *tasks]
    table = []
    for s in summary:
        mib = "-" if math.isnan(s["kv_bytes_mean"]) else f"{s['kv_bytes_mean'] / 2**20:.2f}"
        retention = "-" if math.isnan(s["retention"]) else f"{s['retention']:.3f}"
        budget = "-" if s["budget"] is None else f"{s['budget']:g}"
        cells = [_pct(s["tasks"].get(t, math.nan)) for t in tasks]
        runs_ = s["runs"] or "-"
        low, high = s["accuracy_interval"]
        interval = "-" if math.isnan(low) else f"{_pct(low)}-{_pct(high)}"
        table.append(
            [s["context_len"], s["policy"], budget, runs_, _pct(s["accuracy"]), interval, mib, retention, *cells]
        )
    protocol = {"agnostic": "context compressed, question prefilled after", "served": "after the whole prompt"}
    print(
        f"\nmodel {config.model}; protocol {config.protocol} ({protocol[config.protocol]}); filler {config.filler}; "
        f"up to {config.samples} samples per task and length, up to {config.questions_per_context} question(s) "
        "per sample's context (runs: the generations a row averages); "
        "accuracy = RULER string match, mean over tasks, per task in the last columns"
    )
    print(format_table(headers, table))
    notes = sorted({s["note"] for s in summary if s["note"]})
    for note in notes:
        print(f"  {note}")
    print(f"wall time {seconds:.0f} s, of which shared prefills {prefill_seconds:.0f} s")
    md = markdown_table(headers, table)
    md += [f"\n{n}" for n in notes] + [f"\nwall time {seconds:.0f} s (shared prefills {prefill_seconds:.0f} s)"]
    (out / "results.md").write_text("\n".join(md) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    with (out / "runs.jsonl").open("w") as f:  # every generation, to read what the model answered
        f.writelines(json.dumps(asdict(r)) + "\n" for r in runs)
    payload = {
        "config": asdict(config),
        "seconds": seconds,
        "prefill_seconds": prefill_seconds,
        "rows": [asdict(r) for r in rows],
        "summary": summary,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if config.plot:
        _plot(summary, out / "accuracy_vs_memory.png", config)
    print(f"wrote {out}/results.md, results.csv, results.json" + (", accuracy_vs_memory.png" if config.plot else ""))


def _plot(summary: list[dict[str, Any]], path: Path, config: NaturalAccuracyConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(config.context_lens)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4.0), squeeze=False)
    # Matplotlib cycles ten colours; past ten policies the line and marker change too, so no two look alike.
    styles = [("-", "o"), ("--", "s"), (":", "^")]
    for ax, length in zip(axes.flat, lengths, strict=True):
        for index, policy in enumerate(dict.fromkeys(s["policy"] for s in summary)):
            pts = sorted(
                (s["kv_bytes_mean"] / 2**20, 100 * s["accuracy"])
                for s in summary
                if s["context_len"] == length and s["policy"] == policy and not math.isnan(s["accuracy"])
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                line, marker = styles[(index // 10) % len(styles)]
                marker = "*" if policy == "full" else marker
                ax.plot(xs, ys, linestyle=line, marker=marker, color=f"C{index % 10}", label=policy)
        ax.set_title(f"{length} tokens")
        ax.set_xlabel("KV MiB held per request (pool)")
        ax.set_ylabel("accuracy % (mean over tasks)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{Path(config.model).stem}\naccuracy vs KV memory, {config.protocol} protocol", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_results(result_dirs: list[Path], out_dir: Path, plot: bool = True) -> list[NaturalRow]:
    """One report (tables, per-task columns, plot) from several runs' output directories.

    A long table is cheapest to run as one `bench accuracy` per (task, length), so every finished run
    is on disk whatever happens to the later ones; this puts their runs.jsonl back together. The runs
    must share model and protocol. A (length, task) no run covered shows as "-" in its column, and the
    mean over tasks of a length covers the tasks run at that length.
    """
    if not result_dirs:
        raise ValueError("no result directories to merge")
    configs, runs = [], []
    seconds = prefill_seconds = 0.0
    policies: dict[tuple[str, float | None], KVPolicy | str | None] = {}
    for directory in result_dirs:
        results, lines = Path(directory) / "results.json", Path(directory) / "runs.jsonl"
        if not results.is_file() or not lines.is_file():
            raise ValueError(f"{directory} holds no finished `bench accuracy` run (results.json, runs.jsonl)")
        payload = json.loads(results.read_text())
        configs.append(payload["config"])
        seconds += payload["seconds"]
        prefill_seconds += payload["prefill_seconds"]
        for row in payload["rows"]:
            key = (row["policy"], row["budget"])
            if row["note"].startswith("not run"):
                policies[key] = row["note"]
            else:
                policies.setdefault(key, None)
        runs += [Run(**json.loads(line)) for line in lines.read_text().splitlines() if line.strip()]
    for field_name in ("model", "protocol", "filler"):
        values = sorted({c[field_name] for c in configs})
        if len(values) > 1:
            raise ValueError(f"cannot merge runs with different {field_name}s: {values}")
    first = configs[0]
    config = NaturalAccuracyConfig(
        model=first["model"],
        policies=tuple(dict.fromkeys(name for name, _ in policies)),
        tasks=tuple(dict.fromkeys(t for c in configs for t in c["tasks"])),
        context_lens=tuple(sorted({n for c in configs for n in c["context_lens"]})),
        samples=max(c["samples"] for c in configs),
        questions_per_context=max(c.get("questions_per_context", 1) for c in configs),
        protocol=first["protocol"],
        filler=first["filler"],
        out_dir=str(out_dir),
        plot=plot,
    )
    rows = [r for r in _aggregate(runs, policies, config) if r.note != "no runs"]
    _report(rows, config, seconds, prefill_seconds, runs)
    return rows


__all__ = ["NaturalAccuracyConfig", "NaturalRow", "merge_results", "run_natural_accuracy"]


def uses_suite_tokenizer(model: str) -> bool:
    """True for a model directory whose tokenizer is the synthetic suite's (word-level) one."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return False
    from tokenizers import Tokenizer

    from vllm_kvpress_ext.tasks.tokenizer import default_tokenizer

    return bool(Tokenizer.from_file(str(path)).get_vocab() == default_tokenizer().get_vocab())


def natural_config(model: str, args: Any) -> NaturalAccuracyConfig:
    """The config `kvpress bench accuracy` builds from its flags for a real model (None: the default)."""
    config = NaturalAccuracyConfig(model=model, out_dir=args.out or "runs/accuracy-natural")
    overrides: dict[str, Any] = {
        "policies": tuple(args.policies.split(",")) if args.policies else None,
        "budgets": args.budgets,
        "tasks": tuple(args.tasks.split(",")) if args.tasks else None,
        "protocol": args.protocol,
        "samples": args.samples,
        "questions_per_context": args.questions_per_context,
        "context_lens": args.context_lens or ((args.context_len,) if args.context_len else None),
        "filler": args.filler,
    }
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
