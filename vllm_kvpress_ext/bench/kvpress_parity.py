"""`kvpress bench kvpress-parity`: this project against NVIDIA kvpress 0.5.5 on the same prompts and weights.

For SnapKV, StreamingLLM, PyramidKV, AdaKV, Expected Attention and KVzip at matched settings (window,
kernel, pooling, budget, KVzip's reconstruction after the chat-template header),
both systems compress the same contexts of a real model and the bench reports, per policy and kept
ratio, how far their kept (layer, KV head, position) sets agree, and each system's accuracy on the
questions that follow.

kvpress pins an older transformers than this project, so it runs in a venv of its own (`make
kvpress-venv`, or `--kvpress-python`): the bench writes a JSON request, starts
`kvpress_parity_worker.py` with that venv's Python, and reads a JSON result; kvpress is never imported
here. Both systems load the same float32 weights: a GGUF model is written once as an HF directory
(config.json, model.safetensors, tokenizer) under the model cache, and the project's engine runs that
directory too.

Protocol (both sides): question-agnostic, as kvpress's pipeline runs it: the context is prefilled and
compressed, then the question is prefilled on the compressed cache at the positions that follow the
context, then greedy decoding. Here the context of each prompt is prefilled once and every
(policy, ratio) starts from its own copy (`engine/prefix.py`); the kept set is read from the cache
right after compression.

Matching the budgets: for a kept ratio r the bench asks kvpress for compression_ratio c = 1 - r, and
gives this project what kvpress keeps: `tokens = max(1, int(n * (1 - c)))` for SnapKV, StreamingLLM
and AdaKV (kvpress truncates where this project rounds, see `policies/base.py`), PyramidKV
`ratio = 1 - c` with `schedule: window_inside` (kvpress's layer schedule, computed from the
unrounded r n), and KVzip `tokens = n - int(n c)` with `skip_header` (kvpress keeps `N - int(N c)` of a
request's N entries, the same up to under one entry per (layer, KV head) on average).
Pooling is average pooling with the padding counted (`count_include_pad`), as
kvpress's SnapKV does. `--variants` adds rows with this project's other choices (the padding left
out of the average; PyramidKV's default window_outside schedule), compared with the same kvpress sets.

Overlap of a (policy, ratio), over every prompt, layer and KV head: `kept ∩` = |ours ∩ kvpress| /
|kvpress| (the share of kvpress's kept entries this project keeps too), `same sets` = the share of
(prompt, layer, head) whose two sets are identical, and the mean kept per head on each side.

A model with sliding-window layers (Gemma 3) is compared on its global layers only. This project holds
the sliding layers as rings of their window that no policy compresses; kvpress 0.5.5 skips them only for
`Gemma3ForConditionalGeneration` (`BasePress.__call__`) and compresses a text Gemma 3's like any layer.
For the same reason PyramidKV's schedule differs there by design (kvpress spreads it over every layer,
this project over the global ones). kvpress answers no question on such a model and runs neither Expected
Attention nor KVzip there (`KVPRESS_CANNOT_ON_SLIDING`): those columns and rows are left out, with a line
saying so.
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and numpy load lazily: the command line's --help must stay instant
    import torch

DEFAULT_KVPRESS_PYTHON = "build/kvpress-venv/bin/python"
KVPRESS_PYTHON_ENV = "KVPRESS_PARITY_PYTHON"
WORKER = Path(__file__).with_name("kvpress_parity_worker.py")
PARITY_POLICIES = ("snapkv", "streaming_llm", "pyramidkv", "adakv", "expected_attention", "kvzip")
DEFAULT_TASKS = ("nl_passkey", "nl_niah_single", "nl_niah_multikey", "nl_niah_multivalue")

#: The matched settings of each policy: kvpress's press fields -> the same value in this project's policy.
#: SnapKV and AdaKV take kvpress's SnapKV defaults (window 64, kernel 5); PyramidKV takes the paper's
#: window 8 and kernel 7 (with window 64 and beta 20, kvpress builds no pyramid below a 1,280-entry
#: budget and falls back to SnapKV), average pooling since kvpress's SnapKV scorer only averages.
SETTINGS: dict[str, dict[str, Any]] = {
    "snapkv": {"window_size": 64, "kernel_size": 5},
    "streaming_llm": {"n_sink": 4},
    "pyramidkv": {"window_size": 8, "kernel_size": 7, "beta": 20},
    "adakv": {"window_size": 64, "kernel_size": 5, "alpha_safeguard": 0.2},
    "expected_attention": {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True},
    "kvzip": {"n_sink": 4, "chunk_size": 2048},
}

#: Extra rows (`--variants`): this project's other choices, against the same kvpress sets.
VARIANTS: dict[str, dict[str, Any]] = {
    "snapkv": {"count_include_pad": False},
    "pyramidkv": {"schedule": "window_outside"},
    "adakv": {"count_include_pad": False},
}


class ParityError(RuntimeError):
    """The kvpress side could not run (no venv, the worker failed); the message says what to do."""


@dataclass(frozen=True)
class ParityConfig:
    model: str
    kvpress_python: str = DEFAULT_KVPRESS_PYTHON
    policies: tuple[str, ...] = PARITY_POLICIES
    ratios: tuple[float, ...] = (0.5, 0.25, 0.1)
    context_lens: tuple[int, ...] = (1024,)
    tasks: tuple[str, ...] = DEFAULT_TASKS
    samples: int = 2  # per task and length: 4 tasks x 2 = 8 prompts per length by default
    accuracy: bool = True
    kvpress_accuracy: bool = True  # whether kvpress answers too (not on a model with sliding-window layers)
    variants: bool = False
    out_dir: str = "runs/kvpress-parity"
    seed: int = 2_000_000


@dataclass
class ParityRow:
    context_len: int
    policy: str
    variant: str  # "matched" or the changed setting
    ratio: float | None
    prompts: int
    overlap: float  # |ours ∩ kvpress| / |kvpress|
    same_sets: float  # share of (prompt, layer, head) with identical sets
    kept_ours: float  # mean kept per (layer, head)
    kept_kvpress: float
    accuracy_ours: float
    accuracy_kvpress: float
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- pure parts (tested)


def overlap_stats(ours: torch.Tensor, ref: torch.Tensor, layers: list[int] | None = None) -> dict[str, float]:
    """Agreement of two kept masks `[L, H, n]` (bool), over `layers` (default: all): sums for
    `aggregate_overlap`, per (layer, head) pair."""
    if ours.shape != ref.shape:
        raise ValueError(f"kept masks differ in shape: {tuple(ours.shape)} vs {tuple(ref.shape)}")
    ours, ref = ours.bool(), ref.bool()
    if layers is not None:
        ours, ref = ours[layers], ref[layers]
    pairs = ours.shape[0] * ours.shape[1]
    return {
        "common": float((ours & ref).sum()),
        "ref_kept": float(ref.sum()),
        "ours_kept": float(ours.sum()),
        "same": float((ours == ref).all(dim=-1).sum()),
        "pairs": float(pairs),
    }


def aggregate_overlap(stats: list[dict[str, float]]) -> dict[str, float]:
    """Pool per-prompt `overlap_stats`: overlap, same-set share, mean kept per head on each side."""
    if not stats:
        return {"overlap": math.nan, "same_sets": math.nan, "kept_ours": math.nan, "kept_kvpress": math.nan}
    total = {key: sum(s[key] for s in stats) for key in stats[0]}
    return {
        "overlap": total["common"] / total["ref_kept"] if total["ref_kept"] else math.nan,
        "same_sets": total["same"] / total["pairs"],
        "kept_ours": total["ours_kept"] / total["pairs"],
        "kept_kvpress": total["ref_kept"] / total["pairs"],
    }


def pack_mask(mask: torch.Tensor) -> str:
    """A bool tensor as base64 of numpy `packbits` (little bit order), the worker's encoding."""
    import numpy as np

    bits = np.packbits(mask.cpu().numpy().astype(bool).reshape(-1), bitorder="little")
    return base64.b64encode(bits.tobytes()).decode("ascii")


def unpack_mask(data: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Inverse of `pack_mask` (and of the worker's encoding)."""
    import numpy as np
    import torch

    count = math.prod(shape)
    bits = np.unpackbits(np.frombuffer(base64.b64decode(data), dtype=np.uint8), bitorder="little")
    if bits.size < count:
        raise ValueError(f"kept mask holds {bits.size} bits, shape {list(shape)} needs {count}")
    return torch.from_numpy(bits[:count].astype(bool).reshape(shape))


def kvpress_kept(n: int, ratio: float) -> int:
    """Entries kvpress keeps per head at kept fraction `ratio` (compression_ratio = 1 - ratio)."""
    compression_ratio = 1 - ratio
    return max(1, int(n * (1 - compression_ratio)))


def project_policy(name: str, ratio: float, n: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """This project's policy spec matching kvpress's press `name` at kept `ratio` on an `n`-entry context."""
    s = SETTINGS[name]
    spec: dict[str, Any]
    if name == "streaming_llm":
        spec = {"name": name, "tokens": kvpress_kept(n, ratio), "sink_tokens": s["n_sink"]}
    elif name == "kvzip":
        # kvpress prunes int(N c) of a request's N entries in all (keeping the rest, N (1 - c) rounded up) and
        # reconstructs the context after its chat-template header only (`skip_header`).
        compression_ratio = 1 - ratio
        spec = {"name": name, "tokens": max(1, n - int(n * compression_ratio)), "sink_tokens": s["n_sink"]}
        spec |= {"chunk_size": s["chunk_size"], "allocation": "global", "skip_header": True}
    elif name == "expected_attention":
        spec = {"name": name, "tokens": kvpress_kept(n, ratio), "future_positions": s["n_future_positions"]}
        spec |= {"sink_tokens": s["n_sink"], "use_covariance": s["use_covariance"], "use_vnorm": s["use_vnorm"]}
    else:
        common = {"window": s["window_size"], "kernel_size": s["kernel_size"], "pooling": "avgpool"}
        common |= {"gqa_reduction": "mean", "count_include_pad": True}
        if name == "pyramidkv":
            compression_ratio = 1 - ratio
            spec = {"name": name, "ratio": 1 - compression_ratio, "beta": float(s["beta"])}
            spec |= {"schedule": "window_inside", **common}
        elif name == "adakv":
            spec = {"name": name, "tokens": kvpress_kept(n, ratio), "alpha": s["alpha_safeguard"], **common}
        else:
            spec = {"name": name, "tokens": kvpress_kept(n, ratio), **common}
    return {**spec, **(overrides or {})}


def kvpress_run(name: str, ratio: float | None) -> dict[str, Any]:
    """One run of the worker's request: the press and its settings (`full`: no press)."""
    if ratio is None:
        return {"id": "full", "press": "full", "compression_ratio": 0.0}
    return {"id": f"{name}-{ratio:g}", "press": name, "compression_ratio": 1 - ratio, **SETTINGS[name]}


def run_worker(python: str, request: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run the kvpress worker on `request` with `python`; raise ParityError with one line on failure."""
    exe = Path(python)
    if not exe.is_file() or not os.access(exe, os.X_OK):
        raise ParityError(
            f"no kvpress venv: {python} is not an executable; create it with `make kvpress-venv` "
            f"(or pass --kvpress-python / set {KVPRESS_PYTHON_ENV})"
        )
    request_path, result_path = workdir / "request.json", workdir / "result.json"
    request_path.write_text(json.dumps(request))
    proc = subprocess.run(
        [str(exe), str(WORKER), str(request_path), str(result_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not result_path.is_file():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ParityError(f"the kvpress worker failed ({python}): {last}")
    try:
        result: dict[str, Any] = json.loads(result_path.read_text())
    except json.JSONDecodeError as err:
        raise ParityError(f"the kvpress worker wrote no valid JSON: {err}") from None
    if not isinstance(result.get("results"), list):
        raise ParityError("the kvpress worker's result has no `results` list")
    return result


# ----------------------------------------------------------------------------- model and prompts


def hf_directory(model: str) -> Path:
    """An HF directory holding `model`'s float32 weights and tokenizer (a GGUF file is written out once)."""
    from vllm_kvpress_ext.models.gguf_file import is_gguf_path

    path = Path(model)
    if not is_gguf_path(path):
        return path
    stat = path.stat()
    out = path.parent / f"{path.stem}-hf-fp32-{stat.st_size}-{stat.st_mtime_ns}"
    if (out / "done").is_file():
        return out
    import torch

    from vllm_kvpress_ext.models import load_config, load_model
    from vllm_kvpress_ext.models.gguf_config import hf_config_from_gguf
    from vllm_kvpress_ext.models.gguf_file import open_gguf
    from vllm_kvpress_ext.models.tokenizer import load_tokenizer
    from vllm_kvpress_ext.models.writer import save_model

    gguf = open_gguf(path)
    config = hf_config_from_gguf(gguf.metadata, set(gguf.tensor_names()), str(path))
    # transformers picks the model class from `model_type`; this project reads `architectures`.
    families = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Gemma3ForCausalLM": "gemma3_text",
    }
    config.setdefault("model_type", families.get(config["architectures"][0], "llama"))
    save_model(load_model(path, dtype=torch.float32), config, out)
    stops = list(load_config(path).eos_token_ids)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}) + "\n")
    tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    (out / "done").write_text("")
    return out


# ----------------------------------------------------------------------------- the bench


#: One run of this project on every prompt: (job id, policy name, variant, kept ratio, setting overrides);
#: overrides None is the uncompressed `full` job.
Job = tuple[str, str, str, float | None, dict[str, Any] | None]
#: The figures of one row: (context length, policy, variant, kept ratio).
RowKey = tuple[int, str, str, float | None]


@dataclass
class _ProjectSide:
    """What this project's engine produced: finished outputs, the forks still answering (request id ->
    prompt id, job, policy, variant, ratio) and each fork's kept mask `[L, H, n]` right after compression."""

    results: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, tuple[str, str, str, str, float | None]] = field(default_factory=dict)
    kept: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def run_parity(config: ParityConfig) -> list[ParityRow]:
    from vllm_kvpress_ext.models import load_config
    from vllm_kvpress_ext.tasks.natural import render

    validate_config(config)
    start = time.perf_counter()
    model_dir = hf_directory(config.model)
    if any(load_config(model_dir).layer_windows):
        config = _sliding_window_config(config)
    runs = [(p, r) for p in config.policies for r in config.ratios]
    variant_runs = [(p, r) for p, r in runs if config.variants and p in VARIANTS]
    engine = _parity_engine(model_dir, config, len(runs) + len(variant_runs))
    if engine.tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer; the natural-language prompts need one")
    prompts = [
        (length, render(task, engine.tokenizer, length, config.seed + i, "agnostic"))
        for length in config.context_lens
        for task in config.tasks
        for i in range(config.samples)
    ]
    prompt_ids = {f"{length}-{p.task}-{p.seed}": (length, p) for length, p in prompts}
    jobs = _parity_jobs(runs, variant_runs)
    ours = _run_project(engine, config, prompt_ids, jobs)
    request = _kvpress_request(model_dir, engine, config, prompt_ids, runs)
    print(f"kvpress side: {len(request['prompts'])} prompts x {len(request['runs'])} runs ...", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpress-parity-") as tmp:
        result = run_worker(config.kvpress_python, request, Path(tmp))
    kvpress_seconds = time.perf_counter() - t0
    ref = {(item["prompt"], item["run"]): item for item in result["results"]}
    # Sliding-window layers are rings here and no policy's; kvpress 0.5.5 compresses them in a text Gemma 3
    # like any layer (it skips them for Gemma3ForConditionalGeneration only): the global layers are compared.
    compared = engine.cache.global_layers.tolist()
    stats: dict[RowKey, list[dict[str, float]]] = defaultdict(list)
    for pid, (length, _) in prompt_ids.items():
        for job, name, variant, ratio, _ in jobs:
            if (pid, job) in ours.kept:
                item = ref[(pid, kvpress_run(name, ratio)["id"])]
                theirs = unpack_mask(item["kept"], item["shape"])
                stats[(length, name, variant, ratio)].append(overlap_stats(ours.kept[(pid, job)], theirs, compared))
    scores_ours, scores_ref, answers = (
        _accuracy(engine, prompt_ids, ours, ref) if config.accuracy else (defaultdict(list), defaultdict(list), [])
    )
    rows = _parity_rows(config, stats, scores_ours, scores_ref)
    seconds = time.perf_counter() - start
    layers = None if len(compared) == engine.cache.num_layers else (compared, engine.cache.num_layers)
    _report(rows, config, result.get("versions", {}), seconds, kvpress_seconds, ours.seconds, answers, layers)
    return rows


#: What kvpress 0.5.5 cannot do on a text Gemma 3 (sliding-window layers), found by running it: its KVzipPress
#: refuses Gemma 3 by name, its ExpectedAttentionPress calls the model's RoPE without the layer type Gemma 3's
#: needs (an AttributeError), and after compression transformers builds sliding-window masks wider than the
#: compressed layers for the question (a shape error in SDPA), so kvpress answers no question there.
KVPRESS_CANNOT_ON_SLIDING = ("expected_attention", "kvzip")


def _sliding_window_config(config: ParityConfig) -> ParityConfig:
    """`config` for a model with sliding-window layers: without the policies kvpress cannot run there, and with
    this project's answers only (kvpress's accuracy is not measured), each said on one line."""
    from dataclasses import replace

    dropped = [p for p in config.policies if p in KVPRESS_CANNOT_ON_SLIDING]
    if dropped:
        print(f"left out on a model with sliding-window layers (kvpress 0.5.5 fails there): {', '.join(dropped)}")
    if config.accuracy:
        print("kvpress's answers are not measured on a model with sliding-window layers (its question fails)")
    policies = tuple(p for p in config.policies if p not in dropped)
    if not policies:
        raise ValueError(f"kvpress 0.5.5 runs none of {', '.join(dropped)} on a model with sliding-window layers")
    return replace(config, policies=policies, kvpress_accuracy=False)


def _parity_engine(model_dir: Path, config: ParityConfig, num_runs: int) -> Any:
    """An engine with room for every fork of one prompt at once (float32, as the kvpress side loads it)."""
    from vllm_kvpress_ext.engine import LLMEngine
    from vllm_kvpress_ext.models import load_config

    model_config = load_config(model_dir)
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * 4
    copies = 2 * (3 + num_runs)
    return LLMEngine(
        model_dir,
        dtype="float32",
        kv_memory=int(per_token * (max(config.context_lens) + 256) * copies),
        max_num_seqs=2 * num_runs + 4,
        max_num_batched_tokens=max(config.context_lens) + 256,
    )


def _parity_jobs(runs: list[tuple[str, float]], variant_runs: list[tuple[str, float]]) -> list[Job]:
    jobs: list[Job] = [("full", "full", "matched", None, None)]
    for policy_name, kept in runs:
        jobs.append((f"{policy_name}-{kept:g}", policy_name, "matched", kept, {}))
        if (policy_name, kept) in variant_runs:
            setting = ", ".join(f"{k}={v}" for k, v in VARIANTS[policy_name].items())
            jobs.append((f"{policy_name}-{kept:g}-variant", policy_name, setting, kept, VARIANTS[policy_name]))
    return jobs


def _run_project(engine: Any, config: ParityConfig, prompt_ids: dict[str, Any], jobs: list[Job]) -> _ProjectSide:
    """This project: one shared context prefill per prompt, one fork per job, run to the end."""
    import torch

    from vllm_kvpress_ext.engine import SamplingParams
    from vllm_kvpress_ext.engine.prefix import add_forked_request, capture_prefix, merged_capture_spec
    from vllm_kvpress_ext.policies import load_policy

    print(f"this project: {len(prompt_ids)} prompts ...", flush=True)
    t0 = time.perf_counter()
    side = _ProjectSide()
    for pid, (_, prompt) in prompt_ids.items():
        n = prompt.compress_after
        assert n is not None
        specs = {
            job: None if overrides is None else load_policy(project_policy(name, ratio or 1.0, n, overrides))
            for job, name, _, ratio, overrides in jobs
        }
        spec = merged_capture_spec([p for p in specs.values() if p is not None])
        snapshot = capture_prefix(engine, prompt.token_ids[:n], spec, f"prefix-{pid}", finished=side.results)
        for job, name, variant, ratio, _ in jobs:
            if job == "full" and not config.accuracy:
                continue
            rid = f"{job}@{pid}"
            params = SamplingParams(max_tokens=prompt.max_new_tokens if config.accuracy else 1, temperature=0.0)
            _fork(engine, snapshot, prompt.token_ids, params, rid, specs[job], side.results, add_forked_request)
            if specs[job] is not None:
                positions, _ = engine.cache.entry_positions(rid)  # [L, H, N] right after compression, -1 padding
                kept = torch.zeros(positions.shape[0], positions.shape[1], n + 1, dtype=torch.bool)
                kept.scatter_(-1, torch.where(positions >= 0, positions, n).to(torch.int64), True)
                side.kept[(pid, job)] = kept[..., :n].clone()
            if config.accuracy:
                side.pending[rid] = (pid, job, name, variant, ratio)
            else:
                engine.abort(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                side.results[out.request_id] = out
    side.seconds = time.perf_counter() - t0
    return side


def _kvpress_request(
    model_dir: Path, engine: Any, config: ParityConfig, prompt_ids: dict[str, Any], runs: list[tuple[str, float]]
) -> dict[str, Any]:
    """kvpress's side in one subprocess request for everything; its kept sets are compared with this project's."""
    return {
        "model_dir": str(model_dir.resolve()),
        "stop_ids": sorted(engine.eos_token_ids),
        "accuracy": config.accuracy and config.kvpress_accuracy,
        "prompts": [
            {
                "id": pid,
                "context_ids": p.token_ids[: p.compress_after],
                "question_ids": p.token_ids[p.compress_after :],
                "max_new_tokens": p.max_new_tokens,
            }
            for pid, (_, p) in prompt_ids.items()
        ],
        "runs": ([kvpress_run("full", None)] if config.accuracy and config.kvpress_accuracy else [])
        + [kvpress_run(p, r) for p, r in runs],
    }


def _accuracy(
    engine: Any, prompt_ids: dict[str, Any], ours: _ProjectSide, ref: dict[tuple[str, str], Any]
) -> tuple[dict[RowKey, list[float]], dict[tuple[int, str, float | None], list[float]], list[dict[str, Any]]]:
    """Both systems' scores per row, and every answer."""
    from vllm_kvpress_ext.tasks.natural import score

    scores_ours: dict[RowKey, list[float]] = defaultdict(list)
    scores_ref: dict[tuple[int, str, float | None], list[float]] = defaultdict(list)
    answers: list[dict[str, Any]] = []
    for rid, (pid, _, name, variant, ratio) in ours.pending.items():
        length, prompt = prompt_ids[pid]
        text = engine.tokenizer.decode(list(ours.results[rid].output_token_ids), skip_special_tokens=True)
        scores_ours[(length, name, variant, ratio)].append(score(prompt, text))
        answers.append({"prompt": pid, "policy": name, "variant": variant, "ratio": ratio, "ours": text})
    for (pid, run_id), item in ref.items():
        if item["answer"] is None:  # kvpress answered nothing (`kvpress_accuracy` off)
            continue
        length, prompt = prompt_ids[pid]
        name = "full" if run_id == "full" else item_policy(run_id)
        ratio = None if run_id == "full" else float(run_id.rsplit("-", 1)[1])
        scores_ref[(length, name, ratio)].append(score(prompt, item["answer"] or ""))
        answers.append({"prompt": pid, "policy": name, "ratio": ratio, "kvpress": item["answer"]})
    return scores_ours, scores_ref, answers


def _parity_rows(
    config: ParityConfig,
    stats: dict[RowKey, list[dict[str, float]]],
    scores_ours: dict[RowKey, list[float]],
    scores_ref: dict[tuple[int, str, float | None], list[float]],
) -> list[ParityRow]:
    rows = []
    for length in config.context_lens:
        if config.accuracy:
            rows.append(
                ParityRow(
                    length, "full", "matched", None, config.samples * len(config.tasks), math.nan, math.nan,
                    math.nan, math.nan, _mean(scores_ours[(length, "full", "matched", None)]),
                    _mean(scores_ref[(length, "full", None)]),
                )
            )  # fmt: skip
        for (row_len, name, variant, ratio), group in stats.items():
            if row_len != length:
                continue
            agg = aggregate_overlap(group)
            rows.append(
                ParityRow(
                    length,
                    name,
                    variant,
                    ratio,
                    len(group),
                    agg["overlap"],
                    agg["same_sets"],
                    agg["kept_ours"],
                    agg["kept_kvpress"],
                    _mean(scores_ours.get((length, name, variant, ratio), [])),
                    _mean(scores_ref.get((length, name, ratio), [])) if variant == "matched" else math.nan,
                )
            )
    return rows


def item_policy(run_id: str) -> str:
    """`snapkv-0.25` -> `snapkv` (a run id of `kvpress_run`)."""
    return run_id.rsplit("-", 1)[0]


def _fork(
    engine: Any, snapshot: Any, tokens: list[int], params: Any, rid: str, policy: Any, results: Any, fork: Any
) -> None:
    """Start a fork of the snapshot; when the pool is full, step the batch until some request finishes."""
    while True:
        try:
            fork(engine, snapshot, tokens, params, rid, policy)
            return
        except RuntimeError:
            if not engine.has_unfinished_requests():
                raise
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out


def validate_config(config: ParityConfig) -> None:
    from vllm_kvpress_ext.tasks.natural import NATURAL_TASKS

    unknown = [p for p in config.policies if p not in PARITY_POLICIES]
    if unknown:
        raise ValueError(f"unknown parity policy {', '.join(unknown)}; choose from {', '.join(PARITY_POLICIES)}")
    bad = [r for r in config.ratios if not 0.0 < r < 1.0]
    if bad:
        raise ValueError(f"kept ratios must lie in (0, 1) (kvpress compresses by 1 - ratio), got {bad}")
    tasks = [t for t in config.tasks if t not in NATURAL_TASKS]
    if tasks:
        raise ValueError(f"unknown natural task(s) {', '.join(tasks)}; known: {', '.join(NATURAL_TASKS)}")
    if config.samples < 1:
        raise ValueError(f"samples must be >= 1, got {config.samples}")
    if not config.context_lens or min(config.context_lens) < 128:
        raise ValueError("context lengths must be >= 128 tokens (the windows and sinks need room)")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}"


def _num(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _report(
    rows: list[ParityRow],
    config: ParityConfig,
    versions: dict[str, str],
    seconds: float,
    kvpress_seconds: float,
    project_seconds: float,
    answers: list[dict[str, Any]],
    layers: tuple[list[int], int] | None = None,
) -> None:
    from vllm_kvpress_ext.bench.report import format_table, markdown_table

    headers = ["ctx", "policy", "setting", "ratio", "prompts", "kept ∩ %", "same sets %", "kept/head ours"]
    headers += ["kept/head kvpress", "acc ours %", "acc kvpress %"]
    table = [
        [
            r.context_len, r.policy, r.variant, "-" if r.ratio is None else f"{r.ratio:g}", r.prompts,
            _pct(r.overlap), _pct(r.same_sets), _num(r.kept_ours), _num(r.kept_kvpress),
            _pct(r.accuracy_ours), _pct(r.accuracy_kvpress),
        ]
        for r in rows
    ]  # fmt: skip
    shown = ", ".join(f"{k} {v}" for k, v in versions.items())
    print(f"\nmodel {config.model}; kvpress side: {shown}; question-agnostic protocol, greedy")
    scope = ""
    if layers is not None:
        scope = (
            f"kept sets compared on the {len(layers[0])} global layers of {layers[1]} ({layers[0]}): the "
            "sliding-window layers are rings here, while kvpress compresses them too"
        )
        print(scope)
    print(format_table(headers, table))
    print(f"wall time {seconds:.0f} s (kvpress side {kvpress_seconds:.0f} s, this project {project_seconds:.0f} s)")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown_table(headers, table)
    notes = [scope] if scope else []
    (out / "results.md").write_text("\n\n".join(["\n".join(md), *notes, f"wall time {seconds:.0f} s"]) + "\n")
    payload = {
        "config": asdict(config),
        "versions": versions,
        "seconds": seconds,
        "rows": [asdict(r) for r in rows],
        "answers": answers,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {out}/results.md, results.json")


__all__ = [
    "ParityConfig",
    "ParityError",
    "ParityRow",
    "aggregate_overlap",
    "overlap_stats",
    "pack_mask",
    "project_policy",
    "run_parity",
    "run_worker",
    "unpack_mask",
    "validate_config",
]
