"""`kvpress bench throughput`: prefill and decode tokens/s of the embedded engine.

Prefill: a batch of B prompts of P tokens goes in at once; tokens/s is B*P over the steps until
every request has its first token. Decode: the same B requests then run `decode_steps` steps;
tokens/s is B*steps over their time. Median of `repeats` runs per (B, P) point, side by side.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_kvpress_ext.bench.models import model_or_bench_model
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models import load_config


@dataclass(frozen=True)
class ThroughputConfig:
    model: str | None = None
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    prompt_lens: tuple[int, ...] = (128, 512)
    decode_steps: int = 32
    repeats: int = 2
    kv_policy: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 4096
    seed: int = 0


def _one_run(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params) for _ in range(batch)
    ]
    started: set[str] = set()
    t0 = time.perf_counter()
    while len(started) < batch:
        for out in engine.step():
            started.add(out.request_id)
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    decoded = 0
    while engine.has_unfinished_requests():
        decoded += sum(1 for out in engine.step() if out.request_id in ids)
    decode_s = time.perf_counter() - t1
    return batch * prompt_len / prefill_s, decoded / decode_s


def run_throughput_bench(config: ThroughputConfig) -> list[dict[str, float]]:
    with model_or_bench_model(config.model, config.seed) as model_dir:
        return _run(config, model_dir)


def _run(config: ThroughputConfig, model_dir: Path) -> list[dict[str, float]]:
    longest = max(config.prompt_lens) + config.decode_steps + 2
    model_config = load_config(model_dir)
    page_size = 16
    # Room for the largest batch at full length, uncompressed.
    num_pages = (
        max(config.batch_sizes)
        * model_config.num_hidden_layers
        * model_config.num_key_value_heads
        * (-(-longest // page_size))
    )
    engine = LLMEngine(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        max_num_seqs=max(config.batch_sizes),
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_policy=config.kv_policy,
        max_model_len=max(longest, 16),
        num_pages=num_pages,
        page_size=page_size,
    )
    c = engine.config
    print(f"config: {asdict(config)}")
    print(
        f"model: {model_dir} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
        f"{c.num_key_value_heads} KV heads, vocab {c.vocab_size}), threads: {torch.get_num_threads()}"
    )
    _one_run(engine, 1, min(config.prompt_lens), 2, config.seed)  # warm-up
    rows, results = [], []
    for prompt_len in config.prompt_lens:
        for batch in config.batch_sizes:
            runs = [
                _one_run(engine, batch, prompt_len, config.decode_steps, config.seed + r) for r in range(config.repeats)
            ]
            prefill = statistics.median(r[0] for r in runs)
            decode = statistics.median(r[1] for r in runs)
            rows.append([prompt_len, batch, f"{prefill:,.0f}", f"{decode:,.1f}", f"{1000 * batch / decode:.1f}"])
            results.append({"prompt_len": prompt_len, "batch": batch, "prefill_tok_s": prefill, "decode_tok_s": decode})
    print(format_table(["prompt", "batch", "prefill tok/s", "decode tok/s", "ms / decode step"], rows))
    return results
