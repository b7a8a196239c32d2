"""`kvpress bench tensor-parallel`: the plugin on vLLM's runner at several tensor-parallel sizes (and pipeline
stages), side by side.

Per worker count and stage count, one offline `vllm.LLM` (vLLM's runner over the plugin's pool; more than one
worker: vLLM's multiprocessing executor, gloo between the workers) runs the same requests under each policy:

- requests/s and output tokens/s of the whole batch (`--num-prompts` random prompts at once);
- the KV bytes the requests held when they finished (their `kv_bytes`, summed) and each worker's pool
  high-water mark: what one worker's memory must hold;
- what the policies' exchange cost (`native/tensor_parallel.py`): bytes each worker sent and seconds spent in
  the gathers, per compressed request, against the prefill time of one request (the batch's prefill alone,
  timed with one output token, divided by the requests).

On one machine the workers share its cores: the run says what tensor parallelism costs and exchanges here,
not how fast it runs on a GPU per worker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.bench.models import model_or_bench_model
from vllm_kvpress_ext.bench.report import format_table

PAGE_SIZE = 16


@dataclass(frozen=True)
class TensorParallelBenchConfig:
    model: str | None = None
    workers: tuple[int, ...] = (1, 2)
    stages: tuple[int, ...] = (1,)  # pipeline stages, each of `workers` tensor-parallel workers
    policies: tuple[str, ...] = ("full", "snapkv", "adakv")
    num_prompts: int = 16
    input_len: int = 512
    output_len: int = 32
    max_num_seqs: int = 16
    num_pages: int | None = None  # None: every request of the batch uncompressed, on one worker
    seed: int = 0


def _pool_pages(model: str, config: TensorParallelBenchConfig) -> int:
    """`--num-pages`, else room for `max_num_seqs` uncompressed requests on one worker: every worker count then
    runs the whole batch at once, and the rows compare compute, not capacity."""
    if config.num_pages is not None:
        return config.num_pages
    raw = json.loads((Path(model) / "config.json").read_text())
    per_request = raw["num_hidden_layers"] * raw.get("num_key_value_heads", raw["num_attention_heads"])
    return per_request * -(-(config.input_len + config.output_len) // PAGE_SIZE) * config.max_num_seqs


def _llm(model: str, workers: int, stages: int, config: TensorParallelBenchConfig) -> Any:
    from vllm import LLM

    return LLM(
        model,
        dtype="float32",
        max_model_len=config.input_len + config.output_len + 16,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max(2048, config.input_len),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every request prefills its whole prompt under every policy
        tensor_parallel_size=workers,
        pipeline_parallel_size=stages,
        distributed_executor_backend="mp" if workers * stages > 1 else "uni",
        seed=config.seed,
        block_size=PAGE_SIZE,
        additional_config={"kv_runner": "vllm", "kv_num_pages": _pool_pages(model, config)},
    )


def _prompts(config: TensorParallelBenchConfig, vocab: int) -> list[dict[str, list[int]]]:
    import torch

    g = torch.Generator().manual_seed(config.seed)
    return [
        {"prompt_token_ids": torch.randint(10, vocab, (config.input_len,), generator=g).tolist()}
        for _ in range(config.num_prompts)
    ]


def _stats(llm: Any, restart_peak: bool = False) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("kvpress_worker_stats", args=(restart_peak,)))


def _run_policy(
    llm: Any, policy: str, prompts: list[Any], config: TensorParallelBenchConfig, workers: int, stages: int
) -> dict[str, Any]:
    from vllm import SamplingParams

    extra = {} if policy == "full" else {"kv_policy": policy}
    before = _stats(llm, restart_peak=True)
    start = time.perf_counter()
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
    llm.generate(prompts, prefill, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True, extra_args=extra)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _stats(llm)
    figures = [(o.kv_transfer_params or {}).get("kvpress", {}) for o in outputs]
    compressed = 2 * len(prompts) if policy != "full" else 0  # both passes compress every request
    gathers = sum(a["gathers"] - b["gathers"] for a, b in zip(after, before, strict=True))
    sent = max(a["exchange_bytes"] - b["exchange_bytes"] for a, b in zip(after, before, strict=True))
    exchange_s = max(a["exchange_seconds"] - b["exchange_seconds"] for a, b in zip(after, before, strict=True))
    prefill_per_request = prefill_s / len(prompts)
    per_compression = exchange_s / compressed if compressed else 0.0
    return {
        "workers": workers,
        "stages": stages,
        "policy": policy,
        "requests_per_s": round(len(prompts) / seconds, 3),
        "output_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, 1),
        "kv_mib": round(sum(f.get("kv_bytes", 0) for f in figures) / 2**20, 2),
        "worker_peak_kv_mib": round(max(a["peak_kv_bytes"] for a in after) / 2**20, 2),
        "gathers_per_request": round(gathers / len(after) / compressed, 1) if compressed else 0,
        "exchange_kib_per_request": round(sent / compressed / 1024, 1) if compressed else 0.0,
        "exchange_ms_per_request": round(1000 * per_compression, 2),
        "prefill_ms_per_request": round(1000 * prefill_per_request, 1),
        "exchange_share_of_prefill": round(per_compression / prefill_per_request, 4) if prefill_per_request else 0.0,
    }


def run_tensor_parallel_bench(config: TensorParallelBenchConfig) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with model_or_bench_model(config.model, config.seed) as model_dir:
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        prompts = _prompts(config, vocab)
        for workers, stages in ((w, s) for s in config.stages for w in config.workers):
            llm = _llm(str(model_dir), workers, stages, config)
            try:
                # Warm-up: the batch's prefill and a few decodes, so that no policy's row pays for first calls.
                from vllm import SamplingParams

                llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
                for policy in config.policies:
                    rows.append(_run_policy(llm, policy, prompts, config, workers, stages))
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                from vllm.distributed import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
    headers = list(rows[0]) if rows else []
    print(format_table(headers, [[row[h] for h in headers] for row in rows]))
    return rows
