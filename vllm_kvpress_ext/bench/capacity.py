"""`kvpress bench capacity`: what compression buys in one fixed KV pool, end to end on the engine.

`requests` prompts of `prompt_len` random tokens, each asking for `new_tokens` greedy tokens, are
queued at once on an engine whose pool holds `kv_memory` bytes. The scheduler starts a request when
its uncompressed prefill peak fits; after compression its footprint shrinks and the next one fits.
Reported per policy, all on the same engine and model, one after the other:

- held at once: the most requests holding pages in the pool at the same time (peak), and the mean
  over the decode steps;
- output tokens/s: every generated token over the whole run's wall time (prefill included), and
  the decode tokens/s over decode steps alone;
- retention and KV bytes per request (from the pool), and preemptions.

With `samples` n > 1, each prompt asks for n sampled answers (temperature 0.8, seeds 0..n-1), and every
policy runs twice: with the samples sharing the prompt's compressed pages (`sample_of`, as `kvpress serve`
sends `n`), and as n separate requests; `requests` counts prompts, so both runs do the same work.

Budgets: a policy with a `ratio` field is run at `ratio`; WG-KV runs its admission with a hard cap of
`ratio * prompt_len - local_window` global entries per head, so ring + global hold `ratio` of the
prompt; a budget-free policy (GVote) runs with its defaults and its own retention is reported. On a random-weight
model WG-KV gets untrained gates (`bench.models.write_untrained_gates`); on a model without gates it is
skipped with a line saying so.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_kvpress_ext.bench.budgets import budgeted_policy
from vllm_kvpress_ext.bench.models import (
    model_of_shape,
    runnable_policies,
    write_untrained_gates,
)
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.scheduler import SchedulerOutput
from vllm_kvpress_ext.policies import KVPolicy


@dataclass(frozen=True)
class CapacityConfig:
    model: str | None = None
    shape: str = "bench"  # random-weight model shape when no model is given (bench.models.SHAPES)
    policies: tuple[str, ...] = ("full", "snapkv", "gvote", "wgkv")
    ratio: float = 0.25
    prompt_len: int = 2048
    new_tokens: int = 32
    requests: int = 16
    kv_memory: int = 64 * 2**20
    page_size: int = 16
    max_num_batched_tokens: int = 8192
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    samples: int = 1


def _submit(engine: LLMEngine, config: CapacityConfig, policy: KVPolicy, share: bool) -> list[str]:
    """Queue every prompt (each with `config.samples` answers); return the engine request ids."""
    g = torch.Generator().manual_seed(config.seed)
    vocab = engine.config.vocab_size
    if config.samples == 1:
        params = [SamplingParams(max_tokens=config.new_tokens, temperature=0.0, ignore_eos=True)]
    else:
        params = [
            SamplingParams(max_tokens=config.new_tokens, temperature=0.8, seed=j, ignore_eos=True)
            for j in range(config.samples)
        ]
    ids: list[str] = []
    for _ in range(config.requests):
        prompt = torch.randint(0, vocab, (config.prompt_len,), generator=g).tolist()
        first = engine.add_request(prompt, params[0], policy=policy)
        ids.append(first)
        for sample in params[1:]:
            ids.append(engine.add_request(prompt, sample, policy=policy, sample_of=first if share else None))
    return ids


def _one_policy(engine: LLMEngine, config: CapacityConfig, policy: KVPolicy, share: bool = True) -> dict[str, Any]:
    ids = _submit(engine, config, policy, share)
    held_peak = 0
    held_decode: list[int] = []
    decode_seconds = 0.0
    decode_tokens = 0
    outputs = {}
    scheduled: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:  # observes what each step ran; changes nothing
        scheduled.append(schedule())
        return scheduled[-1]

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            step_outputs = engine.step()
            step_seconds = time.perf_counter() - step_start
            held_peak = max(held_peak, engine.stats().running + len([o for o in step_outputs if o.finished]))
            if scheduled and scheduled[-1].decode:
                held_decode.append(len(scheduled[-1].decode))
                decode_seconds += step_seconds
                decode_tokens += len(scheduled[-1].decode)
            scheduled.clear()
            for out in step_outputs:
                if out.finished:
                    outputs[out.request_id] = out
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    wall = time.perf_counter() - start
    done = [outputs[i] for i in ids]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages, "pages leaked"
    generated = sum(len(o.output_token_ids) for o in done)
    return {
        "held_peak": held_peak,
        "held_mean_decode": statistics.fmean(held_decode) if held_decode else 0.0,
        "output_tok_s": generated / wall,
        "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
        "wall_s": wall,
        "retention": statistics.fmean(o.kv.retention for o in done),
        "kv_mib_per_request": statistics.fmean(o.kv.kv_bytes for o in done) / 2**20,
        "preemptions": sum(o.num_preemptions for o in done),
    }


def run_capacity_bench(config: CapacityConfig) -> list[dict[str, Any]]:
    with model_of_shape(config.model, config.shape, config.dtype, config.device, config.seed) as model_dir:
        if config.model is None:
            write_untrained_gates(model_dir)
        policies = runnable_policies(config.policies, model_dir)
        engine = LLMEngine(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            kv_memory=config.kv_memory,
            page_size=config.page_size,
            max_num_seqs=max(config.requests * config.samples, 1),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.prompt_len + config.new_tokens + 1,
        )
        mc = engine.config
        print(f"config: {asdict(config)}")
        print(
            f"model: {model_dir} ({mc.num_hidden_layers} layers, {mc.num_attention_heads} heads, "
            f"{mc.num_key_value_heads} KV heads, head_dim {mc.head_dim}, {engine.dtype}), "
            f"pool {engine.cache.pool.num_pages} pages = {config.kv_memory / 2**20:.0f} MiB on {config.device}"
        )
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(1, 33)), warm)
        while engine.has_unfinished_requests():
            engine.step()
        results = []
        for name in policies:
            policy = budgeted_policy(name, config.ratio, config.prompt_len)
            for share in (True, False) if config.samples > 1 else (True,):
                label = (
                    name if config.samples == 1 else f"{name} (n={config.samples}, {'shared' if share else 'separate'})"
                )
                result = {"policy": label, **_one_policy(engine, config, policy, share)}
                results.append(result)
                print(f"  {label}: {result}", flush=True)
    full = next((r for r in results if r["policy"].split(" ")[0] == "full"), None)
    rows = [
        [
            r["policy"],
            r["held_peak"],
            f"{r['held_mean_decode']:.1f}",
            f"{r['held_peak'] / full['held_peak']:.2f}x" if full else "-",
            f"{r['output_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['output_tok_s'] / full['output_tok_s']:.2f}x" if full else "-",
            f"{r['retention']:.3f}",
            f"{r['kv_mib_per_request']:.1f}",
            r["preemptions"],
            f"{r['wall_s']:.1f}",
        ]
        for r in results
    ]
    headers = [
        "policy",
        "held peak",
        "held mean (decode)",
        "vs full",
        "output tok/s",
        "decode tok/s",
        "vs full",
        "retention",
        "KV MiB/req",
        "preemptions",
        "wall s",
    ]
    print(format_table(headers, rows))
    return results
