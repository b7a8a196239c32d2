"""`kvpress bench prefill`: prompt tokens/s of one prompt's prefill through the embedded engine.

Each prompt (random token ids, one request, `max_tokens=1`) is prefilled three ways, side by side in
one run so that a busy machine affects all of them alike:

- `chunked, oracle`: chunks of `--chunk` tokens, a later chunk attending to the cached prefix with
  the einsum oracle (`reference.paged_prefill_attention`, what the engine ran before the fused path);
- `chunked, fused`: the same chunks through torch's fused SDPA under the same mask (what it runs now);
- `one chunk`: the whole prompt as one chunk, i.e. plain causal SDPA over a dense prompt, the way a
  dense HF-style forward of the same model attends (the bound the chunked paths can approach).

The time is the engine step(s) from the request's admission to its first token, sampling included.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.attention.ops import PREFILL_ORACLE_ENV
from vllm_kvpress_ext.bench.report import format_table

MODES = ("chunked, oracle", "chunked, fused", "one chunk")


@dataclass(frozen=True)
class PrefillBenchConfig:
    model: str = "smollm2-135m"
    prompt_lens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    chunk: int = 2048
    repeats: int = 1
    modes: tuple[str, ...] = MODES
    kv_policy: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    out: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError("prompt lengths must be >= 1")
        if self.chunk < 1 or self.repeats < 1:
            raise ValueError("chunk and repeats must be >= 1")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")


def _prefill_seconds(engine: Any, prompt: list[int], chunk: int) -> float:
    from vllm_kvpress_ext.engine import SamplingParams

    engine.scheduler.max_num_batched_tokens = chunk
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _timed(engine: Any, prompt: list[int], mode: str, chunk: int, repeats: int) -> float:
    previous = os.environ.get(PREFILL_ORACLE_ENV)
    os.environ[PREFILL_ORACLE_ENV] = "1" if mode == "chunked, oracle" else "0"
    try:
        size = len(prompt) if mode == "one chunk" else chunk
        return min(_prefill_seconds(engine, prompt, size) for _ in range(repeats))
    finally:
        if previous is None:
            os.environ.pop(PREFILL_ORACLE_ENV, None)
        else:
            os.environ[PREFILL_ORACLE_ENV] = previous


def run_prefill_bench(config: PrefillBenchConfig) -> list[dict[str, Any]]:
    import torch

    from vllm_kvpress_ext.engine import LLMEngine

    longest = max(config.prompt_lens)
    engine = LLMEngine(
        config.model,
        dtype=config.dtype,
        device=config.device,
        kv_policy=config.kv_policy,
        max_num_seqs=2,
        max_num_batched_tokens=max(longest, config.chunk),
    )
    if longest >= engine.max_model_len:
        raise ValueError(f"prompts must be shorter than the model's {engine.max_model_len} tokens")
    rng = random.Random(config.seed)
    vocab = engine.config.vocab_size
    _prefill_seconds(engine, [rng.randrange(vocab) for _ in range(64)], config.chunk)  # first passes are slow
    rows = []
    for length in config.prompt_lens:
        prompt = [rng.randrange(vocab) for _ in range(length)]
        row: dict[str, Any] = {"prompt_tokens": length}
        for mode in config.modes:
            seconds = _timed(engine, prompt, mode, config.chunk, config.repeats)
            row[mode] = {"seconds": seconds, "tokens_per_s": length / seconds}
        rows.append(row)
        print(f"[{length} tokens] " + ", ".join(f"{m}: {row[m]['seconds']:.2f} s" for m in config.modes), flush=True)
    _print(config, rows, torch.get_num_threads())
    if config.out:
        Path(config.out).write_text(json.dumps({"config": asdict(config), "rows": rows}, indent=2) + "\n")
    return rows


def _print(config: PrefillBenchConfig, rows: list[dict[str, Any]], threads: int) -> None:
    print(f"config: {asdict(config)}; torch threads {threads}; load average {os.getloadavg()[0]:.1f}")
    headers = ["prompt tokens"] + [f"{m} tok/s (s)" for m in config.modes]
    fused, oracle = "chunked, fused", "chunked, oracle"
    if fused in config.modes and oracle in config.modes:
        headers.append("fused / oracle")
    table = []
    for r in rows:
        line = [str(r["prompt_tokens"])]
        line += [f"{r[m]['tokens_per_s']:.0f} ({r[m]['seconds']:.2f})" for m in config.modes]
        if len(headers) > len(line):
            line.append(f"{r[oracle]['seconds'] / r[fused]['seconds']:.2f}x")
        table.append(line)
    print(format_table(headers, table))
