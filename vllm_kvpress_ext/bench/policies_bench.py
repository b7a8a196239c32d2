"""`kvpress bench policies`: what each policy costs at prefill and what it keeps.

For every registered policy and prompt length, one request runs on the engine: prefill, the
policy's compression (timed inside the engine: scoring, planning and compaction), then a few
decode steps so decode-time policies run too. Reported per row: prefill time without compression,
compression time and its share of prefill, the policy's whole cost over an uncompressed request
(its prefill plus compression, less the prefill of `full`, over that prefill: what a policy that
does work inside the prefill's own pass, as H2O does, costs there shows here), decode-step hook
time, and the retention and KV bytes the pool actually held. `full` always runs first, as that
baseline. With `repeats` above 1 each request runs that many times and the fastest prefill and
compression are kept, which steadies the times on a busy machine. All rows run side by side in one
process on the same model. On the random bench model WG-KV runs with untrained gates (its ring +
global layout, not a gate's choices); on a model without gates beside it, WG-KV is skipped with a
line saying so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.bench.models import model_or_bench_model, runnable_policies, write_untrained_gates
from vllm_kvpress_ext.bench.profiling import format_top_ops, summarize, wrap_profiled
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.request import KVStats
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.policies import policy_names

BASELINE = "full"  # no compression: the prefill every other row's cost is measured against


@dataclass(frozen=True)
class PoliciesBenchConfig:
    model: str | None = None
    policies: tuple[str, ...] = ()
    prompt_lens: tuple[int, ...] = (2048, 8192)
    decode_steps: int = 8
    repeats: int = 1
    profile: bool = False  # also profile each policy's compression at the longest prompt
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0


def run_policies_bench(config: PoliciesBenchConfig) -> list[dict[str, object]]:
    with model_or_bench_model(config.model, config.seed) as model_dir:
        if config.model is None:
            write_untrained_gates(model_dir)
        return _run(config, model_dir)


def _run(config: PoliciesBenchConfig, model_dir: Path) -> list[dict[str, object]]:
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}")
    requested = [name for name in config.policies or policy_names() if name != BASELINE]
    policies = [BASELINE, *runnable_policies(requested, model_dir)]
    engine = _engine_for(config, model_dir)
    g = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(max_tokens=config.decode_steps + 1, temperature=0.0, ignore_eos=True)
    # Warm-up: first calls and lazily built kernels. The prompt is long enough for every policy to compress
    # (a 4-token prompt is shorter than the observation windows), so no kernel compiles inside a timed run.
    warm = torch.randint(0, engine.config.vocab_size, (min(512, *config.prompt_lens),), generator=g).tolist()
    for name in policies:
        _timed_request(engine, warm, params, name)
    results: list[dict[str, object]] = []
    for prompt_len in config.prompt_lens:
        prompt = torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=g).tolist()
        baseline_prefill_s = 0.0
        for name in policies:
            prefill_s, compression_s, decode_hook_s, kv = min(
                (_timed_request(engine, prompt, params, name) for _ in range(config.repeats)),
                key=lambda run: run[0] + run[1],
            )
            if name == BASELINE:
                baseline_prefill_s = prefill_s
            results.append(
                {
                    "prompt_len": prompt_len,
                    "policy": name,
                    "prefill_s": prefill_s,
                    "compression_s": compression_s,
                    "share": compression_s / prefill_s,
                    "cost_over_full": (prefill_s + compression_s - baseline_prefill_s) / baseline_prefill_s,
                    "decode_hook_ms_per_step": 1000 * decode_hook_s / max(1, config.decode_steps),
                    "retention": kv.retention,
                    "kv_bytes": kv.kv_bytes,
                }
            )
    _print_table(results)
    if config.profile:
        _profile_compressions(engine, policies[1:], prompt, params)
    return results


def _profile_compressions(engine: LLMEngine, policies: list[str], prompt: list[int], params: SamplingParams) -> None:
    """One more request per policy with its compression (`ModelRunner.complete_prefill`) under the profiler.

    What a policy does inside the prefill's own pass (H2O's column sums) is not in this profile.
    """
    rows = []
    for name in policies:
        profiles: list[Any] = []
        undo = wrap_profiled(engine.runner, "complete_prefill", engine.device, profiles)
        try:
            _timed_request(engine, prompt, params, name)
        finally:
            undo()
        if not profiles:
            continue
        figures = [summarize(events, 1, engine.device.type == "cuda") for events in profiles]
        rows.append(
            [
                name,
                f"{sum(f['device_busy_ms'] for f in figures):.1f}",
                f"{sum(f['launches'] for f in figures):.0f}",
                f"{sum(f['host_syncs'] for f in figures):.0f}",
                format_top_ops(figures[0]["top_host_ops"][:3]),
            ]
        )
    print(f"\ncompression profile, {len(prompt)}-token prompt (one request per policy)")
    print(format_table(["policy", "device busy ms", "launches", "host syncs", "host ops with most self time"], rows))


def _engine_for(config: PoliciesBenchConfig, model_dir: Path) -> LLMEngine:
    """One request at a time, with a pool that holds the longest prompt uncompressed."""
    longest = max(config.prompt_lens) + config.decode_steps + 2
    model_config = load_config(model_dir)
    page_size = 16
    num_pages = model_config.num_hidden_layers * model_config.num_key_value_heads * (-(-longest // page_size) + 1)
    print(f"config: {asdict(config)}")
    print(
        f"model: {model_dir} ({model_config.num_hidden_layers} layers, {model_config.num_attention_heads} heads, "
        f"{model_config.num_key_value_heads} KV heads), pool {num_pages} pages"
    )
    return LLMEngine(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=1,
        max_num_batched_tokens=max(config.prompt_lens),
        max_model_len=longest + 1,
    )


def _print_table(results: list[dict[str, Any]]) -> None:
    headers = ["prompt", "policy", "prefill ms", "compress ms", "share", "cost vs full", "decode hook ms/step"]
    rows = [
        [
            r["prompt_len"],
            r["policy"],
            f"{1000 * r['prefill_s']:.0f}",
            f"{1000 * r['compression_s']:.1f}",
            f"{100 * r['share']:.1f}%",
            f"{100 * r['cost_over_full']:+.1f}%",
            f"{r['decode_hook_ms_per_step']:.2f}",
            f"{r['retention']:.3f}",
            f"{r['kv_bytes'] / 2**20:.2f}",
        ]
        for r in results
    ]
    print(format_table([*headers, "retention", "KV MiB"], rows))
    print(
        "share: compression / the row's own prefill; cost vs full: (prefill + compression - full's prefill) / "
        "full's prefill"
    )
    print("retention and KV MiB are measured at the end of the request (prompt + decoded tokens), from the pool")


def _timed_request(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, policy: str
) -> tuple[float, float, float, KVStats]:
    """(prefill s, compression s at the first token, decode-hook s after it, final KV stats) of one request."""
    rid = engine.add_request(prompt, params, policy=policy)
    request = engine.requests[rid]
    start = time.perf_counter()
    first_token_s: float | None = None
    compression_at_first = 0.0
    kv: KVStats | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
                compression_at_first = request.seat.kv.compression_seconds
            if out.finished:
                kv = out.kv
    assert first_token_s is not None and kv is not None
    return first_token_s - compression_at_first, compression_at_first, kv.compression_seconds - compression_at_first, kv
