"""`kvpress bench prefill-peak`: KV memory held at the prefill peak vs after compression.

End-of-prefill compression holds the whole prompt in every layer before the policy runs, so the
pool must have room for it even when the request ends up keeping a quarter of it. Layer-wise
prefill compression (XKV with a saved profile, LAVa's cascading form) compresses each layer right
after its attention during the forward pass, so the peak is about one layer's full prompt KV plus
the compressed earlier layers. This bench runs one prompt per row and reports both figures from
the pool's own accounting:

- prefill peak: the request's high-water mark of pages held (`KVStats.kv_bytes_peak`; exact, the
  cache updates it at every allocation) with `max_tokens=1`, so no decode step adds to it;
- after prefill: what the request holds once compression is done;
- reserved at admission (the scheduler's start, in the column's established name): what the scheduler
  sets aside for the request when it starts: the uncompressed prompt,
  or, for a layer-wise policy whose prompt is one prefill chunk, the peak the policy declares
  (`KVPolicy.prefill_peak_pages`, a bound valid for any prompt of this length);
- admitted at once: with a pool of `CAPACITY_POOL_PROMPTS` uncompressed prompts and 16 copies of the
  request waiting, how many the scheduler starts in its first step, each then prefilled and
  compressed without error (whole-prompt chunks; not measured with `--max-batched-tokens`, where a
  step's token budget, not the pool, limits how many start).

Rows (`rows="layerwise"`, the default): full (no compression); XKV with its per-request allocation
(Algorithm 1 ranks every layer's scores together, so it compresses at the end of prefill); XKV with
a saved profile, layer-wise; LAVa one-shot (end of prefill); LAVa cascading (layer-wise, earlier
layers re-compressed to their shrinking budgets). XKV and LAVa share one `ratio` budget, so their
final memory is comparable; the profile row uses the same budget, the profile only sets the per-
layer proportions. Without `--profile`, a profile is measured first (`profile_xkv`) on prompts other
than the bench prompt.

Rows `rows="admission"` (`--rows admission`): admission during a chunked prefill (WG-KV drops what its
gates reject after each chunk of `--max-batched-tokens`, default 256 here) against full and SnapKV
(end of prefill) at the same `ratio`: full; SnapKV; WG-KV with the model's gates (its default ones, or
`--gates`); WG-KV with a cap of `ratio x context_len` global entries per head and an explicit window,
whose chunked prefill peak is declared and reserved. The prompt is English prose (the language
reference's sentences, `tasks/natural/filler.py`) when the model has a tokenizer, since what a
gate admits depends on the text; random token ids otherwise. Instead of the one-step "admitted at once"
column, "held at once" runs `waiting` copies of the request (each generating `decode_tokens`
tokens) through the scheduler with a pool of `CAPACITY_POOL_PROMPTS` uncompressed prompts and
reports the most requests it held at once (prefilling or decoding) and how many it preempted
(`waiting=0` skips it). "prefill s" is the wall time of the single request's prefill (first token
included; one untimed warm-up request first), "prefill CPU s" the process CPU time it took (on a
shared machine the steadier figure): on the CPU, the vertical-slash prefill of the WG-KV rows against
the causal prefill of full and SnapKV on the same prompt.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.bench.harness import run_alone
from vllm_kvpress_ext.bench.models import model_or_bench_model, write_untrained_gates
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.bench.xkv_profile import profile_xkv
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.layerwise import prefill_reservation
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.policies import load_policy

PAGE_SIZE = 16
CAPACITY_POOL_PROMPTS = 4  # the "admitted at once" column's pool, in uncompressed prompts


@dataclass(frozen=True)
class PrefillPeakConfig:
    model: str | None = None
    context_len: int = 2048
    ratio: float = 0.25
    max_batched_tokens: int | None = None  # None: the whole prompt in one prefill chunk
    profile: str | None = None  # an XKV profile; None: measure one on two other prompts first
    profile_target: float = 0.9  # R_avg target of that measurement
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    rows: str = "layerwise"  # or "admission"
    gates: str | None = None  # admission rows: WG-KV's gates (default: the model's own, beside it or shipped)
    local_window: int = 64  # admission rows: W of the capped WG-KV row (explicit, so its peak can be declared)
    waiting: int = 8  # admission rows: requests run through the scheduler for "held at once"
    decode_tokens: int = 8  # admission rows: tokens each of them generates


ADMISSION_CHUNK = 256  # the admission rows' default prefill chunk


def run_prefill_peak_bench(config: PrefillPeakConfig) -> list[dict[str, Any]]:
    """Print the table and return its rows as dicts (byte figures as ints)."""
    if config.context_len < 2:
        raise ValueError(f"context_len must be >= 2, got {config.context_len}")
    if not 0.0 < config.ratio <= 1.0:
        raise ValueError(f"ratio must lie in (0, 1], got {config.ratio}")
    if config.max_batched_tokens is not None and config.max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be >= 1, got {config.max_batched_tokens}")
    if config.rows not in ("layerwise", "admission"):
        raise ValueError(f"rows must be 'layerwise' or 'admission', got {config.rows!r}")
    if config.local_window < 1 or config.local_window % PAGE_SIZE:
        raise ValueError(f"local_window must be a positive multiple of {PAGE_SIZE}, got {config.local_window}")
    if config.waiting < 0 or config.decode_tokens < 1:
        raise ValueError("waiting must be >= 0 and decode_tokens >= 1")
    with model_or_bench_model(config.model, config.seed) as model_dir, tempfile.TemporaryDirectory() as tmp:
        if config.rows == "admission":
            return _run_admission(config, model_dir)
        return _run(config, model_dir, Path(tmp))


def _engine_kwargs(config: PrefillPeakConfig, layers: int, kv_heads: int) -> dict[str, Any]:
    """A pool that holds one uncompressed prompt (plus a page per head), not the engine's 1 GiB default."""
    return {
        "dtype": config.dtype,
        "device": config.device,
        "num_pages": layers * kv_heads * (-(-(config.context_len + 1) // PAGE_SIZE) + 1),
        "page_size": PAGE_SIZE,
        "max_num_seqs": 1,
        "max_num_batched_tokens": config.max_batched_tokens or config.context_len,
        "max_model_len": config.context_len + 2,
    }


def _run(config: PrefillPeakConfig, model_dir: Path, tmp: Path) -> list[dict[str, Any]]:
    model_config = load_config(model_dir)
    positions = model_config.max_position_embeddings
    if config.context_len + 2 > positions:
        raise ValueError(f"context_len {config.context_len} (+2) exceeds the model's {positions} positions")
    layers, kv_heads = model_config.num_hidden_layers, model_config.num_key_value_heads
    kwargs = _engine_kwargs(config, layers, kv_heads)
    g = torch.Generator().manual_seed(config.seed)
    prompt = torch.randint(0, model_config.vocab_size, (config.context_len,), generator=g).tolist()
    profile = config.profile
    profile_note = profile
    if profile is None:
        others = [torch.randint(0, model_config.vocab_size, (config.context_len,), generator=g).tolist()]
        others.append(torch.randint(0, model_config.vocab_size, (config.context_len,), generator=g).tolist())
        measured = profile_xkv(model_dir, others, target_ratio=config.profile_target, **kwargs)
        profile = str(measured.save(tmp / "xkv-profile.yaml"))
        profile_note = f"measured on 2 other prompts (R_avg target {config.profile_target:g})"
    r = config.ratio
    rows_spec: list[tuple[str, str, Any]] = [
        ("full", "none", "full"),
        ("xkv", "end of prefill (per-request allocation)", {"name": "xkv", "ratio": r}),
        ("xkv + profile", "layer-wise", {"name": "xkv", "ratio": r, "profile": profile}),
        ("lava", "end of prefill (one-shot)", {"name": "lava", "ratio": r}),
        ("lava cascading", "layer-wise (cascade)", {"name": "lava", "ratio": r, "cascading": True}),
    ]
    engine = LLMEngine(model_dir, **kwargs)
    page_bytes = engine.stats().page_bytes
    whole_prompt = config.max_batched_tokens is None or config.max_batched_tokens >= config.context_len
    print(f"config: {asdict(config)}")
    print(
        f"model: {model_dir} ({layers} layers, {kv_heads} KV heads, head_dim {model_config.head_dim}), "
        f"page {PAGE_SIZE} tokens = {page_bytes} B; XKV profile: {profile_note}"
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results: list[dict[str, Any]] = []
    for label, form, policy in rows_spec:
        engine.add_request(prompt, params, policy=policy)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        kv = outputs[0].kv
        reserved = prefill_reservation(
            load_policy(policy), config.context_len, whole_prompt, layers, kv_heads, PAGE_SIZE
        )
        results.append(
            {
                "policy": label,
                "compression": form,
                "prefill_peak_bytes": kv.kv_bytes_peak,
                "final_bytes": kv.kv_bytes,
                "reserved_bytes": reserved * page_bytes,
                "admitted_at_once": _started_in_first_step(model_dir, kwargs, prompt, policy) if whole_prompt else None,
            }
        )
    full_peak = results[0]["prefill_peak_bytes"]
    rows = [
        [
            r["policy"],
            r["compression"],
            _mib(r["prefill_peak_bytes"]),
            _mib(r["final_bytes"]),
            f"{r['prefill_peak_bytes'] / full_peak:.3f}",
            _mib(r["reserved_bytes"]),
            "-" if r["admitted_at_once"] is None else str(r["admitted_at_once"]),
        ]
        for r in results
    ]
    headers = [
        "policy",
        "compression",
        "prefill peak",
        "after prefill",
        "peak / full",
        "reserved at admission",
        f"admitted at once (pool of {CAPACITY_POOL_PROMPTS} prompts)",
    ]
    print(format_table(headers, rows))
    return results


def _started_in_first_step(model_dir: Path, kwargs: dict[str, Any], prompt: list[int], policy: Any) -> int:
    """Requests the scheduler takes into its first step from 16 waiting, pool = `CAPACITY_POOL_PROMPTS` prompts.

    Each of them must finish that step (prefill, compression, first token) without error to count.
    """
    waiting = 16
    layers_heads_pages = kwargs["num_pages"] // (-(-(len(prompt) + 1) // PAGE_SIZE) + 1)  # layers x KV heads
    engine = LLMEngine(
        model_dir,
        **{
            **kwargs,
            "num_pages": CAPACITY_POOL_PROMPTS * layers_heads_pages * -(-len(prompt) // PAGE_SIZE),
            "max_num_seqs": waiting,
            "max_num_batched_tokens": waiting * len(prompt),
        },
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(waiting):
        engine.add_request(prompt, params, policy=policy)
    return sum(1 for o in engine.step() if o.finished and o.finish_reason != "error")


def _prose_prompt(model_dir: Path, length: int, seed: int) -> list[int] | None:
    """`length` tokens of the language reference's prose, from a seeded starting sentence; None without a tokenizer."""
    import random

    from vllm_kvpress_ext.models.tokenizer import load_tokenizer
    from vllm_kvpress_ext.tasks.natural.filler import prose_sentences

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        return None
    sentences = prose_sentences()
    start = random.Random(seed).randrange(len(sentences))
    ids: list[int] = []
    index = start
    while len(ids) < length:
        ids += tokenizer(" " + sentences[index % len(sentences)], add_special_tokens=False)["input_ids"]
        index += 1
    return ids[:length]


def _run_admission(config: PrefillPeakConfig, model_dir: Path) -> list[dict[str, Any]]:
    model_config = load_config(model_dir)
    if config.context_len + config.decode_tokens + 1 > model_config.max_position_embeddings:
        raise ValueError(
            f"context_len {config.context_len} (+{config.decode_tokens + 1}) exceeds the model's "
            f"{model_config.max_position_embeddings} positions"
        )
    layers, kv_heads = model_config.num_hidden_layers, model_config.num_key_value_heads
    chunk = config.max_batched_tokens or ADMISSION_CHUNK
    kwargs = {
        **_engine_kwargs(config, layers, kv_heads),
        "max_num_batched_tokens": chunk,
        "max_model_len": config.context_len + config.decode_tokens + 1,
    }
    prompt, prompt_kind = _admission_prompt(model_dir, config, model_config.vocab_size)
    rows_spec = _admission_rows(config, model_dir)
    engine = LLMEngine(model_dir, **kwargs)
    page_bytes = engine.stats().page_bytes
    print(f"config: {asdict(config)}")
    print(
        f"model: {model_dir} ({layers} layers, {kv_heads} KV heads, head_dim {model_config.head_dim}), "
        f"page {PAGE_SIZE} tokens = {page_bytes} B; prompt: {config.context_len} tokens of {prompt_kind}; "
        f"prefill chunks of {chunk} tokens"
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt[: min(len(prompt), chunk)], params)  # warm-up: first-call allocations stay out
    while engine.has_unfinished_requests():
        engine.step()
    results: list[dict[str, Any]] = []
    for label, form, policy in rows_spec:
        output, seconds, cpu_seconds = run_alone(engine, prompt, params, policy)
        kv = output.kv
        reserved = prefill_reservation(
            load_policy(policy), config.context_len, False, layers, kv_heads, PAGE_SIZE, label != "full", chunk
        )
        held, preempted = _held_at_once(model_dir, kwargs, prompt, policy, config) if config.waiting else (None, None)
        results.append(
            {
                "policy": label,
                "compression": form,
                "prefill_seconds": seconds,
                "prefill_cpu_seconds": cpu_seconds,
                "prefill_peak_bytes": kv.kv_bytes_peak,
                "final_bytes": kv.kv_bytes,
                "reserved_bytes": reserved * page_bytes,
                "held_at_once": held,
                "preempted": preempted,
            }
        )
    _print_admission_table(results, config)
    return results


def _admission_prompt(model_dir: Path, config: PrefillPeakConfig, vocab_size: int) -> tuple[list[int], str]:
    """English prose when the model has a tokenizer (what a gate admits depends on the text), else random ids."""
    prompt = _prose_prompt(model_dir, config.context_len, config.seed)
    prompt_kind = "English prose"
    if prompt is None:
        g = torch.Generator().manual_seed(config.seed)
        prompt = torch.randint(0, vocab_size, (config.context_len,), generator=g).tolist()
        prompt_kind = "random token ids"
    return prompt, prompt_kind


def _admission_rows(config: PrefillPeakConfig, model_dir: Path) -> list[tuple[str, str, Any]]:
    """(label, compression, policy spec) of each row: full, SnapKV, WG-KV, and WG-KV with a declared cap."""
    cap = max(1, round(config.ratio * config.context_len))
    gates = {"gates": config.gates} if config.gates is not None else {}
    if config.model is None and config.gates is None:
        write_untrained_gates(model_dir)  # the random bench model: WG-KV's layout, not a trained choice
    return [
        ("full", "none", "full"),
        ("snapkv", f"end of prefill (ratio {config.ratio:g})", {"name": "snapkv", "ratio": config.ratio}),
        ("wgkv", "admission after each chunk", {"name": "wgkv", **gates}),
        (
            f"wgkv + cap {cap}",
            f"admission after each chunk, cap {cap}, W {config.local_window}",
            {"name": "wgkv", "cap": cap, "local_window": config.local_window, **gates},
        ),
    ]


def _print_admission_table(results: list[dict[str, Any]], config: PrefillPeakConfig) -> None:
    full_peak = results[0]["prefill_peak_bytes"]
    rows = [
        [
            r["policy"],
            r["compression"],
            _mib(r["prefill_peak_bytes"]),
            _mib(r["final_bytes"]),
            f"{r['prefill_peak_bytes'] / full_peak:.3f}",
            _mib(r["reserved_bytes"]),
            "-" if r["held_at_once"] is None else str(r["held_at_once"]),
            "-" if r["preempted"] is None else str(r["preempted"]),
            f"{r['prefill_seconds']:.2f}",
            f"{r['prefill_cpu_seconds']:.2f}",
        ]
        for r in results
    ]
    headers = [
        "policy",
        "compression",
        "prefill peak",
        "after prefill",
        "peak / full",
        "reserved at admission",
        f"held at once (pool of {CAPACITY_POOL_PROMPTS} prompts, {config.waiting} waiting)",
        "preempted",
        "prefill s",
        "prefill CPU s",
    ]
    print(format_table(headers, rows))


def _held_at_once(
    model_dir: Path, kwargs: dict[str, Any], prompt: list[int], policy: Any, config: PrefillPeakConfig
) -> tuple[int, int]:
    """Most requests the scheduler held at once, and preemptions, running `config.waiting` copies to the end."""
    per_prompt = -(-len(prompt) // PAGE_SIZE)
    layers_heads = kwargs["num_pages"] // (-(-(config.context_len + 1) // PAGE_SIZE) + 1)
    engine = LLMEngine(
        model_dir,
        **{
            **kwargs,
            "num_pages": CAPACITY_POOL_PROMPTS * layers_heads * per_prompt,
            "max_num_seqs": config.waiting,
        },
    )
    params = SamplingParams(max_tokens=config.decode_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(config.waiting):
        engine.add_request(prompt, params, policy=policy)
    most = preempted = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.finish_reason == "error":
                raise ValueError(f"a request failed while {policy} ran {config.waiting} at once: {output.error}")
            if output.finished:
                preempted += output.num_preemptions
        most = max(most, engine.stats().running)
    return most, preempted


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.3f} MiB"
