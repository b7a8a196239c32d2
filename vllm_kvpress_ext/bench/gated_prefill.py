"""`kvpress bench gated-prefill`: the prefill time of WG-KV's gated attention path against the causal one.

WG-KV's prefill attends under the vertical-slash mask (a query sees the last `W_local` keys and the
admitted older ones), which both runners compute with `vertical_slash_attention` (`attention.gated_chunk_attention`):
on a GPU the block-sparse Triton kernel, on a CPU its block-sparse torch form (`attention/block_sparse.py`:
per block of queries, the admitted keys before its band and the band itself). The ordinary prefill of
a first chunk is torch's fused causal SDPA, which also skips the blocks above the diagonal.
This bench times one prompt's whole prefill (`max_tokens=1`, so the first token and nothing else)
through the engine, per context length, in three rows:

- full: no policy, the causal path;
- wgkv, gates open: WG-KV with `tau = 0`, so every gate value passes and `_gated` hands the step to the
  causal path: the gate evaluation and admission bookkeeping without the vertical-slash attention;
- wgkv: WG-KV with the model's gates (or `--gates`) and its threshold: the gated path.

Repetitions are interleaved (full, open, gated, full, open, gated, ...) after one untimed warm-up of
each row, so that a noisy shared machine slows every row alike; the table reports the median wall and
process CPU seconds per row and their ratio to the full row's median. A second table times the
attention operation alone on one layer's shape (random queries and keys, a fixed share of admitted
keys drawn at random, the same window): `causal_attention` against `vertical_slash_attention` over
the whole prompt as one chunk, which is where the difference comes from, and beside them the dense
masked form (`reference.vertical_slash_attention`, one SDPA call over the whole square), which the
CPU ran before its block-sparse path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.bench.harness import run_alone
from vllm_kvpress_ext.bench.models import model_or_bench_model, write_untrained_gates
from vllm_kvpress_ext.bench.prefill_peak import PAGE_SIZE, _prose_prompt
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models import load_config


@dataclass(frozen=True)
class GatedPrefillConfig:
    model: str | None = None  # None: the random bench model with untrained gates (layout only)
    context_lens: tuple[int, ...] = (2048, 4096, 8192)
    repeats: int = 3
    max_batched_tokens: int | None = None  # prefill chunk; None: the whole prompt in one chunk
    gates: str | None = None  # WG-KV's gates (default: the model's own, beside it or shipped)
    tau: float = 0.1
    op_admitted: float = 0.25  # the attention-op table's share of admitted keys
    op_window: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


ROWS = ("full", "wgkv, gates open", "wgkv")


def _validate(config: GatedPrefillConfig) -> None:
    if not config.context_lens or min(config.context_lens) < 2:
        raise ValueError(f"context_lens must be >= 2 each, got {list(config.context_lens)}")
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}")
    if config.max_batched_tokens is not None and config.max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be >= 1, got {config.max_batched_tokens}")
    if not 0.0 <= config.tau <= 1.0:
        raise ValueError(f"tau must lie in [0, 1], got {config.tau}")
    if not 0.0 <= config.op_admitted <= 1.0:
        raise ValueError(f"op_admitted must lie in [0, 1], got {config.op_admitted}")
    if config.op_window < 1:
        raise ValueError(f"op_window must be >= 1, got {config.op_window}")


def run_gated_prefill_bench(config: GatedPrefillConfig) -> dict[str, list[dict[str, Any]]]:
    """Print both tables; return their rows as dicts ("prefill" and "attention")."""
    _validate(config)
    with model_or_bench_model(config.model, config.seed) as model_dir:
        model_config = load_config(model_dir)
        longest = max(config.context_lens)
        positions = model_config.max_position_embeddings
        if longest + 1 > positions:  # the prompt and its first token
            raise ValueError(f"context length {longest} (+1) exceeds the model's {positions} positions")
        if config.model is None and config.gates is None:
            write_untrained_gates(model_dir)  # random weights: the path is timed, not what a gate would choose
        print(f"config: {asdict(config)}")
        print(
            f"model: {model_dir} ({model_config.num_hidden_layers} layers, {model_config.num_attention_heads} "
            f"query / {model_config.num_key_value_heads} KV heads, head_dim {model_config.head_dim}); "
            f"{_chunk_words(config.max_batched_tokens)}; "
            f"{config.repeats} interleaved repetitions"
        )
        heads = (model_config.num_attention_heads, model_config.num_key_value_heads, model_config.head_dim)
        prefill: list[dict[str, Any]] = []
        attention: list[dict[str, Any]] = []
        for length in config.context_lens:  # each length's figures are printed as soon as they exist
            prefill += _time_prefill(config, model_dir, length)
            attention.append(_time_attention(config, length, heads))
            print(f"ctx {length}: measured", flush=True)
            _print_prefill(prefill[-len(ROWS) :])
        print("\nall lengths:")
        _print_prefill(prefill)
        _print_attention(config, attention)
    return {"prefill": prefill, "attention": attention}


def _chunk_words(max_batched_tokens: int | None) -> str:
    if max_batched_tokens is None:
        return "the whole prompt in one prefill chunk"
    return f"prefill chunks of {max_batched_tokens}"


def _policies(config: GatedPrefillConfig) -> dict[str, Any]:
    gates = {"gates": config.gates} if config.gates is not None else {}
    return {
        "full": None,
        "wgkv, gates open": {"name": "wgkv", "tau": 0.0, **gates},
        "wgkv": {"name": "wgkv", "tau": config.tau, **gates},
    }


def _time_prefill(config: GatedPrefillConfig, model_dir: Path, length: int) -> list[dict[str, Any]]:
    model_config = load_config(model_dir)
    prompt = _prose_prompt(model_dir, length, config.seed)
    if prompt is None:
        g = torch.Generator().manual_seed(config.seed)
        prompt = torch.randint(0, model_config.vocab_size, (length,), generator=g).tolist()
    layers, kv_heads = model_config.num_hidden_layers, model_config.num_key_value_heads
    engine = LLMEngine(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        num_pages=layers * kv_heads * (-(-(length + 1) // PAGE_SIZE) + 1),
        page_size=PAGE_SIZE,
        max_num_seqs=1,
        max_num_batched_tokens=config.max_batched_tokens or length,
        max_model_len=length + 1,
    )
    policies = _policies(config)
    wall: dict[str, list[float]] = {row: [] for row in ROWS}
    cpu: dict[str, list[float]] = {row: [] for row in ROWS}
    kept: dict[str, int] = {}
    for repeat in range(config.repeats + 1):  # repetition 0 is the untimed warm-up
        for row in ROWS:
            seconds, cpu_seconds, kv_bytes = _one_prefill(engine, prompt, policies[row])
            if repeat:
                wall[row].append(seconds)
                cpu[row].append(cpu_seconds)
            kept[row] = kv_bytes
    full_wall, full_cpu = statistics.median(wall["full"]), statistics.median(cpu["full"])
    return [
        {
            "context_len": length,
            "row": row,
            "wall_s": statistics.median(wall[row]),
            "cpu_s": statistics.median(cpu[row]),
            "wall_ratio": statistics.median(wall[row]) / full_wall,
            "cpu_ratio": statistics.median(cpu[row]) / full_cpu,
            "kv_after_prefill_bytes": kept[row],
            "kv_share": kept[row] / kept["full"],
        }
        for row in ROWS
    ]


def _one_prefill(engine: LLMEngine, prompt: list[int], policy: Any) -> tuple[float, float, int]:
    """Wall and process CPU seconds of one request's prefill (and first token), and the KV bytes it then held."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    output, seconds, cpu_seconds = run_alone(engine, prompt, params, policy)
    return seconds, cpu_seconds, output.kv.kv_bytes


def _time_attention(config: GatedPrefillConfig, length: int, heads: tuple[int, int, int]) -> dict[str, Any]:
    """One layer's attention over a whole prompt of `length`: causal SDPA vs the vertical-slash op, interleaved."""
    from vllm_kvpress_ext.attention import causal_attention, reference, vertical_slash_attention

    num_q_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(config.seed)
    device = torch.device(config.device)
    q = torch.randn(length, num_q_heads, head_dim, generator=g).to(device)
    k = torch.randn(length, num_kv_heads, head_dim, generator=g).to(device)
    v = torch.randn(length, num_kv_heads, head_dim, generator=g).to(device)
    admitted = (torch.rand(num_kv_heads, length, generator=g) < config.op_admitted).to(device)
    scale = head_dim**-0.5
    ops: dict[str, Callable[[], torch.Tensor]] = {
        "causal": lambda: causal_attention(q[None], k[None], v[None], scale)[0],
        "vertical-slash": lambda: vertical_slash_attention(q, k, v, admitted, config.op_window, scale),
        "dense mask": lambda: reference.vertical_slash_attention(q, k, v, admitted, config.op_window, scale),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for repeat in range(config.repeats + 1):
        for name, op in ops.items():
            start = time.process_time()
            op()
            if repeat:
                times[name].append(time.process_time() - start)
    causal_s, gated_s = statistics.median(times["causal"]), statistics.median(times["vertical-slash"])
    return {
        "context_len": length,
        "causal_cpu_s": causal_s,
        "vertical_slash_cpu_s": gated_s,
        "dense_mask_cpu_s": statistics.median(times["dense mask"]),
        "ratio": gated_s / causal_s,
    }


def _print_prefill(rows: list[dict[str, Any]]) -> None:
    headers = ["ctx", "row", "prefill s (median)", "CPU s (median)", "wall / full", "CPU / full", "KV after prefill"]
    table = [
        [
            r["context_len"],
            r["row"],
            f"{r['wall_s']:.2f}",
            f"{r['cpu_s']:.2f}",
            f"{r['wall_ratio']:.2f}",
            f"{r['cpu_ratio']:.2f}",
            f"{r['kv_share']:.3f}",
        ]
        for r in rows
    ]
    print(format_table(headers, table), flush=True)


def _print_attention(config: GatedPrefillConfig, rows: list[dict[str, Any]]) -> None:
    print(
        f"attention alone, one layer, the whole prompt as one chunk ({config.op_admitted:.0%} of keys admitted "
        f"at random, window {config.op_window}), process CPU s, median of {config.repeats}:"
    )
    headers = ["ctx", "causal", "vertical-slash", "vertical-slash / causal", "dense mask", "dense mask / causal"]
    table = [
        [
            r["context_len"],
            f"{r['causal_cpu_s']:.3f}",
            f"{r['vertical_slash_cpu_s']:.3f}",
            f"{r['ratio']:.2f}",
            f"{r['dense_mask_cpu_s']:.3f}",
            f"{r['dense_mask_cpu_s'] / r['causal_cpu_s']:.2f}",
        ]
        for r in rows
    ]
    print(format_table(headers, table), flush=True)
