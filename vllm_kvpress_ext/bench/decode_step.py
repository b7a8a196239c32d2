"""`kvpress bench decode-step`: one decode step of the engine against its floor, and where the rest goes.

A decode step must read every weight once (the embedding table only for the batch's rows) and every
kept K and V entry of every request once. Its floor is those bytes over the device's copy bandwidth
(a large clone, read + write bytes over time, as `kvpress bench kernels` measures it). The table gives,
per policy, the median step time over `steps` steps at a steady batch, the floor, and the ratio.

Where the rest goes: a profile of `profile_steps` more steps (`bench/profiling.py`): device busy
time, kernel launches and host syncs per step, and the host ops with most self time.

The batch is `batch` prompts of `prompt_len` random tokens, prefilled first; the policy compresses
them at `ratio` where it has a budget. Nothing here asserts a time. On a CPU the clone runs on fewer
threads than the step's reads, and caches serve part of them, so a step can beat that "floor" (x floor
below 1): the ratio means most on a GPU, and on a CPU the step times compare policies.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_kvpress_ext.bench.budgets import budgeted_policy
from vllm_kvpress_ext.bench.kernels_bench import copy_bandwidth
from vllm_kvpress_ext.bench.models import model_of_shape, runnable_policies, write_untrained_gates
from vllm_kvpress_ext.bench.profiling import format_top_ops, profiled, summarize, sync
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models import load_config


@dataclass(frozen=True)
class DecodeStepConfig:
    model: str | None = None
    shape: str = "bench"  # random-weight model shape when no model is given (bench.models.SHAPES)
    policies: tuple[str, ...] = ("full", "snapkv")
    ratio: float = 0.25
    batch: int = 8
    prompt_len: int = 2048
    steps: int = 16
    profile_steps: int = 3
    page_size: int = 16
    max_num_batched_tokens: int = 8192
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


def weight_bytes_read(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights a decode step reads: every parameter once, and an embedding table only for the
    batch's rows (a lookup), unless logits are computed from it (tied embeddings: no `lm_head`)."""
    tied = getattr(model, "lm_head", "absent") is None
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} if not tied else set()
    total = 0
    for param in model.parameters():  # each shared parameter once
        if id(param) in looked_up:
            total += min(batch, param.shape[0]) * param[0].numel() * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


def _fill_batch(engine: LLMEngine, config: DecodeStepConfig, policy_name: str) -> list[str]:
    """Queue the batch and run until every request has its first token (prefill and compression done)."""
    g = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(max_tokens=config.steps + config.profile_steps + 4, temperature=0.0, ignore_eos=True)
    policy = budgeted_policy(policy_name, config.ratio, config.prompt_len)
    vocab = engine.config.vocab_size
    ids = [
        engine.add_request(torch.randint(0, vocab, (config.prompt_len,), generator=g).tolist(), params, policy=policy)
        for _ in range(config.batch)
    ]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step())
    engine.step()  # one untimed decode step: first-step allocations, kernel compiles
    return ids


def _kept_kv_bytes(engine: LLMEngine, ids: list[str]) -> int:
    """K and V bytes a decode step reads: every entry each request holds, over all (layer, KV head)."""
    c = engine.config
    elem = engine.cache.pool.kv.element_size()
    total = 0
    for request_id in ids:
        request = engine.requests[request_id]
        engine.runner.update_kv_stats(request)
        total += request.seat.kv.tokens_kept * 2 * c.head_dim * elem
    return total


def _profile(engine: LLMEngine, steps: int) -> dict[str, Any]:
    profiles: list[Any] = []
    with profiled(engine.device, profiles):
        for _ in range(steps):
            engine.step()
    return summarize(profiles[0], steps, engine.device.type == "cuda")


def _one_policy(
    engine: LLMEngine, config: DecodeStepConfig, name: str, weights: int, bandwidth: float
) -> dict[str, Any]:
    ids = _fill_batch(engine, config, name)
    kv_bytes = _kept_kv_bytes(engine, ids)
    samples = []
    for _ in range(config.steps):
        sync(engine.device)
        start = time.perf_counter()
        outputs = engine.step()
        sync(engine.device)
        samples.append(time.perf_counter() - start)
        if len(outputs) != config.batch:
            raise RuntimeError(
                f"{name}: a step decoded {len(outputs)} of {config.batch} requests; the pool is too small"
            )
    step_ms = 1000.0 * statistics.median(samples)
    profile_figures = _profile(engine, config.profile_steps) if config.profile_steps else {}
    while engine.has_unfinished_requests():
        engine.step()
    floor_ms = 1000.0 * (weights + kv_bytes) / bandwidth
    return {
        "policy": name,
        "step_ms": step_ms,
        "floor_ms": floor_ms,
        "x_floor": step_ms / floor_ms,
        "weights_GB": weights / 1e9,
        "kv_GB": kv_bytes / 1e9,
        "decode_tok_s": config.batch / (step_ms / 1000.0),
        **profile_figures,
    }


def run_decode_step_bench(config: DecodeStepConfig) -> list[dict[str, Any]]:
    if config.batch < 1 or config.steps < 1 or config.prompt_len < 1 or config.profile_steps < 0:
        raise ValueError("batch, steps and prompt_len must be >= 1, profile_steps >= 0")
    with model_of_shape(config.model, config.shape, config.dtype, config.device, config.seed) as model_dir:
        if config.model is None:
            write_untrained_gates(model_dir)
        policies = runnable_policies(config.policies, model_dir)
        longest = config.prompt_len + config.steps + config.profile_steps + 8
        mc = load_config(model_dir)
        # Room for the whole batch uncompressed: `full` must decode every request at every step.
        pages = config.batch * mc.num_hidden_layers * mc.num_key_value_heads * -(-longest // config.page_size)
        engine = LLMEngine(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            max_num_seqs=config.batch,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=longest,
            page_size=config.page_size,
            num_pages=pages,
        )
        c = engine.config
        bandwidth = copy_bandwidth(1 << 30, 1, 5, engine.device)
        weights = weight_bytes_read(engine.model, config.batch)
        print(f"config: {asdict(config)}")
        print(
            f"model: {model_dir} ({c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
            f"head_dim {c.head_dim}, {engine.dtype}) on {engine.device}; weights read per step "
            f"{weights / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e9:,.0f} GB/s"
        )
        results = []
        for name in policies:
            result = _one_policy(engine, config, name, weights, bandwidth)
            results.append(result)
            print(f"  {name}: {result}", flush=True)
    rows = [
        [
            r["policy"],
            f"{r['kv_GB']:.2f}",
            f"{r['step_ms']:.2f}",
            f"{r['floor_ms']:.2f}",
            f"{r['x_floor']:.2f}x",
            f"{r['decode_tok_s']:.1f}",
            f"{r.get('device_busy_ms', 0.0):.2f}",
            f"{r.get('launches', 0.0):.0f}",
            f"{r.get('host_syncs', 0.0):.0f}",
        ]
        for r in results
    ]
    headers = [
        "policy",
        "kept K/V GB",
        "step ms",
        "floor ms",
        "x floor",
        "decode tok/s",
        "device busy ms",
        "launches",
        "host syncs",
    ]
    print(f"\ndecode step, batch {config.batch} x {config.prompt_len}-token prompts, ratio {config.ratio}")
    print(format_table(headers, rows))
    for r in results:
        print(f"{r['policy']}: host ops with most self time per step: {format_top_ops(r.get('top_host_ops', []))}")
    return results
