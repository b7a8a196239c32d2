"""Public attention and cache-data ops: one entry point each, dispatched to a kernel or the reference.

Dispatch rule (checked on every call, so tests and operators can flip it at run time):

- Triton kernel (`vllm_kvpress_ext.kernels`) when every tensor argument is on CUDA, `triton` is
  importable, `KVPRESS_DISABLE_TRITON` is unset (or "0"), and the call is one the kernel serves
  (`paged_decode_attention` with `probs_out` goes to the reference: the kernel never materialises
  the probabilities, which is the point of it).
- For `paged_decode_attention` only, the CUDA extension built from `csrc/` when
  `KVPRESS_BUILD_CUDA=1` and it supports the shape (head_dim 64 or 128, group <= 16, one dtype);
  it is JIT-compiled on first use, and a failed build falls back to Triton with one warning.
- For `paged_decode_attention` without `probs_out` on float32 CPU tensors, the C++ kernel of
  `cpu_kernels.py` (`paged_decode.cpp`: reads the pages in place, no dense copy) where it builds and
  `KVPRESS_DISABLE_CPU_KERNELS` is unset.
- `vertical_slash_attention` off CUDA: its block-sparse torch form (`block_sparse.py`), or the
  reference's one masked call over the whole square with `KVPRESS_PREFILL_ATTENTION_ORACLE=1`.
- Otherwise the pure-torch reference (`reference.py`): CPU tensors, no Triton, or disabled.

Why the CPU runs no Triton: Triton only targets GPUs (its interpreter, which the tests use on CPU, is
orders of magnitude slower than torch). Its kernels here are torch code tuned for it and the small
C++ library of `cpu_kernels.py` (H2O's column sums, the paged decode), compiled on first use. Triton
is imported lazily and only here, so the package imports without it.

`gather_paged`, `paged_prefill_attention` (torch's fused SDPA under the oracle's mask,
`reference.paged_prefill_attention_sdpa`; the einsum oracle with `KVPRESS_PREFILL_ATTENTION_ORACLE=1`),
`causal_attention` (SDPA, already fused on GPU),
`causal_attention_with_lse` (torch's CPU flash attention, SDPA elsewhere) and
`varlen_causal_attention` have no kernel of this project and always run the reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from types import ModuleType

import torch

from vllm_kvpress_ext.attention import cpu_kernels, reference
from vllm_kvpress_ext.attention.block_sparse import vertical_slash_attention_blocks
from vllm_kvpress_ext.attention.reference import (
    causal_attention,
    causal_attention_with_lse,
    gather_paged,
    varlen_causal_attention,
)
from vllm_kvpress_ext.utils.flags import env_flag

DISABLE_TRITON_ENV = "KVPRESS_DISABLE_TRITON"
PREFILL_ORACLE_ENV = "KVPRESS_PREFILL_ATTENTION_ORACLE"
BUILD_CUDA_ENV = "KVPRESS_BUILD_CUDA"

__all__ = [
    "BUILD_CUDA_ENV",
    "DISABLE_TRITON_ENV",
    "PREFILL_ORACLE_ENV",
    "backend",
    "causal_attention",
    "causal_attention_with_lse",
    "copy_slots",
    "gated_chunk_attention",
    "gather_paged",
    "paged_decode_attention",
    "paged_prefill_attention",
    "varlen_causal_attention",
    "vertical_slash_attention",
    "window_scores",
    "write_kv",
]


@functools.cache
def _triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a half-installed or stubbed-out package
        return False


@functools.cache
def _kernel_module(name: str) -> ModuleType | None:
    """`vllm_kvpress_ext.kernels.<name>`, or None (with one warning) if it fails to import."""
    try:
        return importlib.import_module(f"vllm_kvpress_ext.kernels.{name}")
    except Exception as exc:  # a broken Triton install must not take serving down
        warnings.warn(f"kernel module {name} unavailable ({exc}); using the fallback", stacklevel=3)
        return None


def _on_cuda(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.is_cuda for t in present)


def triton_enabled(*tensors: torch.Tensor | None) -> bool:
    """True when a call on these tensors would run a Triton kernel (see the module docstring)."""
    # Device first: a CPU call never reads the environment.
    return _on_cuda(tensors) and not env_flag(DISABLE_TRITON_ENV) and _triton_importable()


def _triton(name: str, *tensors: torch.Tensor | None) -> ModuleType | None:
    return _kernel_module(name) if triton_enabled(*tensors) else None


def _cuda_decode(query: torch.Tensor, kv_pool: torch.Tensor, num_kv_heads: int) -> ModuleType | None:
    """The CUDA-extension wrapper when it is requested, present and serves this shape."""
    if not query.is_cuda or not env_flag(BUILD_CUDA_ENV):
        return None
    module = _kernel_module("cuda_decode")
    if module is None or not module.supports(query, kv_pool, num_kv_heads):
        return None
    return module if module.extension_loaded() else None


def backend(*tensors: torch.Tensor | None) -> str:
    """Return "triton" or "reference": what a Triton-served op would run on these tensors (benches, logs).

    The opt-in CUDA decode extension is not reported here: whether it serves a call also depends on
    the shape and on its build succeeding.
    """
    return "triton" if triton_enabled(*tensors) else "reference"


def paged_decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    ring_tables: torch.Tensor | None = None,
    ring_lens: torch.Tensor | None = None,
    probs_out: list[torch.Tensor] | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention over the ragged paged cache; see `reference.paged_decode_attention`. The kernels take
    no logit soft cap: a capped layer (Gemma 2) runs the torch path on every device."""
    if probs_out is None and soft_cap is None:
        cuda = _cuda_decode(query, kv_pool, block_tables.shape[1])
        if cuda is not None:
            out: torch.Tensor = cuda.paged_decode_attention(
                query, kv_pool, position_pool, block_tables, seq_lens, rows, scale, ring_tables, ring_lens
            )
            return out
        kernel = _triton("decode_attention", query, kv_pool, block_tables, seq_lens, ring_tables)
        if kernel is not None:
            out = kernel.paged_decode_attention(
                query, kv_pool, position_pool, block_tables, seq_lens, rows, scale, ring_tables, ring_lens
            )
            return out
        out_cpu = cpu_kernels.paged_decode_attention(  # None off the CPU, or where it cannot run
            query, kv_pool, block_tables, seq_lens, rows, scale, ring_tables, ring_lens
        )
        if out_cpu is not None:
            return out_cpu
    return reference.paged_decode_attention(
        query,
        kv_pool,
        position_pool,
        block_tables,
        seq_lens,
        rows,
        scale,
        ring_tables,
        ring_lens,
        probs_out,
        soft_cap,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float,
    lse_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """A later prefill chunk over its request's cache: fused SDPA (`reference.paged_prefill_attention_sdpa`),
    or the einsum oracle when `KVPRESS_PREFILL_ATTENTION_ORACLE=1` (`kvpress bench prefill` compares them)."""
    if env_flag(PREFILL_ORACLE_ENV):
        return reference.paged_prefill_attention(
            query, query_positions, kv_pool, position_pool, block_table, seq_len, scale, lse_out
        )
    return reference.paged_prefill_attention_sdpa(
        query, query_positions, kv_pool, position_pool, block_table, seq_len, scale, lse_out
    )


def vertical_slash_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    admitted: torch.Tensor,
    window: int,
    scale: float,
    query_start: int = 0,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Prefill attention under the vertical-slash mask; see `reference.vertical_slash_attention`.

    Triton's block-sparse kernel on CUDA; elsewhere the block-sparse torch path (`block_sparse.py`),
    or the reference's one masked call over the whole square with `KVPRESS_PREFILL_ATTENTION_ORACLE=1`.
    Under a logit soft cap (Gemma 2), which neither block-sparse path applies, the reference.
    """
    if soft_cap is not None:
        return reference.vertical_slash_attention(query, keys, values, admitted, window, scale, query_start, soft_cap)
    kernel = _triton("vertical_slash", query, keys, values)
    if kernel is not None and query.dtype == keys.dtype == values.dtype:
        out: torch.Tensor = kernel.vertical_slash_attention(query, keys, values, admitted, window, scale, query_start)
        return out
    if env_flag(PREFILL_ORACLE_ENV):
        return reference.vertical_slash_attention(query, keys, values, admitted, window, scale, query_start)
    return vertical_slash_attention_blocks(query, keys, values, admitted, window, scale, query_start)


def gated_chunk_attention(
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    admitted: torch.Tensor,
    window: int,
    scale: float,
    query_start: int,
    soft_cap: float | None = None,
) -> torch.Tensor | None:
    """A write-gated prompt chunk (WG-KV) at positions `query_start`.. under the vertical-slash mask (its logits
    under `soft_cap` where the layer has one).

    `admitted [Hkv, end]` flags every prompt token up to the chunk's end; query `[n, Hq, d]`, the chunk's
    keys/values `[n, Hkv, d]`. A first chunk attends over its own keys. A later one reads the row
    (`block_table [Hkv, P]`, `seq_lens [Hkv]`), already written with the chunk, where earlier chunks left each
    head only its admitted entries and the last window (`PagedKVCache.drop_unadmitted`). Returns None where
    the mask is causal anyway (the prompt so far fits in the window, or every token so far is admitted):
    the caller's causal path gives the same result faster.
    """
    end = query_start + query.shape[0]
    if end <= window or bool(admitted.all()):
        return None
    if query_start == 0:
        return vertical_slash_attention(query, keys, values, admitted, window, scale, soft_cap=soft_cap)
    held_keys, held_values, positions, valid = gather_paged(kv_pool, position_pool, block_table, seq_lens)
    # Back to one row per position: the entries earlier chunks dropped are exactly the ones this chunk's
    # mask hides, so the zeros standing in for them are never attended to, and the result is bit for bit
    # what the whole prefix gives.
    heads, _, dim = held_keys.shape
    dense_keys = held_keys.new_zeros(end, heads, dim)
    dense_values = held_values.new_zeros(end, heads, dim)
    head_index = torch.arange(heads, device=held_keys.device).view(-1, 1).expand_as(positions)[valid]
    position_index = positions[valid].to(torch.int64)
    dense_keys[position_index, head_index] = held_keys[valid]
    dense_values[position_index, head_index] = held_values[valid]
    return vertical_slash_attention(
        query, dense_keys, dense_values, admitted, window, scale, query_start=query_start, soft_cap=soft_cap
    )


# Attention within a sliding window over a ring's and a chunk's keys: torch's SDPA under a mask on every device
# (its query blocks are a window wide, so no kernel of its own is needed).
sliding_window_attention = reference.sliding_window_attention
ring_chunk_attention = reference.ring_chunk_attention


def write_kv(
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position_pool: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Store K/V (and positions) at flat slots in place; see `reference.write_kv`."""
    kernel = _triton("kv_write", kv_pool, keys, values, position_pool)
    if kernel is not None:
        kernel.write_kv(kv_pool, slots, keys, values, position_pool, positions)
    else:
        reference.write_kv(kv_pool, slots, keys, values, position_pool, positions)


def copy_slots(
    kv_pool: torch.Tensor, position_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, disjoint: bool = False
) -> None:
    """Copy K, V and positions between flat slots in place; see `reference.copy_slots`.

    `disjoint=True` promises no slot is both a source and a destination (tail-into-hole eviction), which
    lets the kernel copy in one pass instead of staging; the reference ignores it.
    """
    kernel = _triton("compaction", kv_pool, position_pool)
    if kernel is not None:
        kernel.copy_slots(kv_pool, position_pool, src, dst, disjoint=disjoint)
    else:
        reference.copy_slots(kv_pool, position_pool, src, dst)


def window_scores(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    window_reduction: str = "sum",
    group_reduction: str = "mean",
) -> torch.Tensor:
    """Observation-window scores `[Hkv, n]` fp32; see `reference.window_scores`."""
    kernel = _triton("window_scores", queries, keys)
    if kernel is not None:
        out: torch.Tensor = kernel.window_scores(
            queries, query_positions, keys, key_positions, scale, window_reduction, group_reduction
        )
        return out
    return reference.window_scores(
        queries, query_positions, keys, key_positions, scale, window_reduction, group_reduction
    )
