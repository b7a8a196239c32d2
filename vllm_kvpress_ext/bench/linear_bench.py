"""`kvpress bench linear`: the model's projections through torch's `F.linear` and through oneDNN.

Every dense projection of the model (`models/linear.py`) runs through oneDNN on the CPU unless
`KVPRESS_DISABLE_ONEDNN_LINEAR=1`. This bench times what that choice changes: for each row count
(decode batches of a few rows to prefill chunks of thousands), one pass over every projection of
every layer of the loaded model with its own weights, in forward order, so the weights stream from
memory as in a forward pass instead of sitting in cache, once with `F.linear` and once with
`models.linear.linear`, interleaved, median of `--repeats`. Where oneDNN runs the dtype, a third
column times oneDNN on the same weights packed once into its blocked layout (`models.linear.pack_weight`),
the path vLLM's runner takes under the plugin. The vocabulary head is left out unless `--head` (the
engines apply it to the sampled rows only, but at 16 rows Gemma 3's 262,144 x 640 head outweighs its
layers). Where oneDNN cannot run the dtype on this CPU (bf16 without AVX-512, fp16 without
AVX-512-FP16), `models.linear.linear` is `F.linear` for a few rows and oneDNN's fp32 product on widened
operands from 16 rows: the column is then named "engine" and the line above the table says which path
it takes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_kvpress_ext.bench.report import format_table


@dataclass(frozen=True)
class LinearBenchConfig:
    model: str = "smollm2-135m"
    rows: tuple[int, ...] = (1, 16, 64, 512, 2048)
    repeats: int = 5
    dtype: str = "float32"
    head: bool = False  # the vocabulary head too
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) < 1:
            raise ValueError("row counts must be >= 1")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


def _projections(model: torch.nn.Module, head: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every projection in forward order: the decoder layers' nn.Linear modules, then with `head`
    the vocabulary head's weight (the embedding's where they are tied)."""
    weights: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (module.weight, module.bias)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    ]
    if head:
        lm_head = getattr(model, "lm_head", None)
        table: Any = lm_head if lm_head is not None else model.embed_tokens
        weights.append((table.weight, None))
    return weights


def _pass_seconds(
    op: Callable[..., torch.Tensor], inputs: dict[int, torch.Tensor], weights: list[tuple[torch.Tensor, Any]]
) -> float:
    start = time.perf_counter()
    for weight, bias in weights:
        op(inputs[weight.shape[1]], weight, bias)
    return time.perf_counter() - start


def run_linear_bench(config: LinearBenchConfig) -> list[dict[str, Any]]:
    from vllm_kvpress_ext.models.linear import linear, onednn_runs, pack_weight, packed_linear, path_for
    from vllm_kvpress_ext.models.loader import load_model

    model = load_model(config.model, dtype=config.dtype)
    weights = _projections(model, config.head)
    dtype = weights[0][0].dtype
    with torch.inference_mode():
        engine = "oneDNN" if onednn_runs(dtype) else "engine"
        packed = [(pack_weight(w), b) for w, b in weights] if engine == "oneDNN" else []
    if any(w is None for w, _ in packed):
        packed = []
    generator = torch.Generator().manual_seed(config.seed)
    ops: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[Any, Any]]]] = {
        "F.linear": (F.linear, weights),
        "oneDNN": (linear, weights),
    }
    if packed:
        ops["packed"] = (packed_linear, packed)
    results = []
    with torch.inference_mode():
        for rows in config.rows:
            widths = {w.shape[1] for w, _ in weights}
            inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in widths}
            times: dict[str, list[float]] = {name: [] for name in ops}
            for repeat in range(config.repeats + 1):  # the first pass warms up and is not counted
                for name, (op, operands) in ops.items():
                    seconds = _pass_seconds(op, inputs, operands)
                    if repeat:
                        times[name].append(seconds)
            flops = sum(2 * rows * w.numel() for w, _ in weights)
            torch_s, onednn_s = statistics.median(times["F.linear"]), statistics.median(times["oneDNN"])
            result = {
                "rows": rows,
                "f_linear_ms": torch_s * 1e3,
                "onednn_ms": onednn_s * 1e3,
                "speedup": torch_s / onednn_s,
                "f_linear_gflops": flops / torch_s / 1e9,
                "onednn_gflops": flops / onednn_s / 1e9,
            }
            if packed:
                packed_s = statistics.median(times["packed"])
                result |= {
                    "packed_ms": packed_s * 1e3,
                    "packed_speedup": onednn_s / packed_s,
                    "packed_gflops": flops / packed_s / 1e9,
                }
            results.append(result)
    headers = ["rows", "F.linear ms", f"{engine} ms", f"F.linear / {engine}", "F.linear GFLOP/s", f"{engine} GFLOP/s"]
    if packed:
        headers += ["packed ms", "oneDNN / packed", "packed GFLOP/s"]
    table = []
    for r in results:
        line = [
            r["rows"],
            f"{r['f_linear_ms']:.2f}",
            f"{r['onednn_ms']:.2f}",
            f"{r['speedup']:.2f}",
            f"{r['f_linear_gflops']:.0f}",
            f"{r['onednn_gflops']:.0f}",
        ]
        if packed:
            line += [f"{r['packed_ms']:.2f}", f"{r['packed_speedup']:.2f}", f"{r['packed_gflops']:.0f}"]
        table.append(line)
    what = f"{len(weights) - 1} projections and the vocabulary head" if config.head else f"{len(weights)} projections"
    print(
        f"{what} ({sum(w.numel() for w, _ in weights) / 1e6:.1f}M weights, {config.dtype}), "
        f"one pass each in forward order, median of {config.repeats}, {torch.get_num_threads()} threads:"
    )
    if engine != "oneDNN":
        print(f"oneDNN has no {dtype} kernel on this CPU; the engine's path: {path_for(dtype)}")
    print(format_table(headers, table), flush=True)
    return results
