"""Loader and wrapper of the CUDA paged decode kernel in `csrc/` (opt-in, JIT-built).

Nothing here runs at install time: `pip install` never needs nvcc. With `KVPRESS_BUILD_CUDA=1` on a
machine with CUDA, the first call compiles `csrc/paged_decode.cu` and `csrc/binding.cpp` with
`torch.utils.cpp_extension.load` (cached by torch under `TORCH_EXTENSIONS_DIR`) and the dispatcher in
`vllm_kvpress_ext/attention/ops.py` routes decode attention to it. The sources are looked up in
`KVPRESS_CSRC_DIR`, else in `csrc/` next to this package's source directory (a source checkout or
an editable install; a wheel does not carry them).

Imports no Triton. Semantics: `vllm_kvpress_ext.attention.reference.paged_decode_attention` without
`probs_out`; supported: head_dim 64 or 128, Hq / Hkv <= 16, query and pool of one dtype.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch
from vllm_kvpress_ext.kernels.common import choose_splits, multiprocessor_count

BUILD_ENV = "KVPRESS_BUILD_CUDA"
CSRC_ENV = "KVPRESS_CSRC_DIR"
EXTENSION_NAME = "kvpress_paged_decode"
SOURCES = ("binding.cpp", "paged_decode.cu")
HEAD_DIMS = (64, 128)
MAX_GROUP = 16
BLOCK_N = 64  # split granularity (tokens); the kernel itself walks one token per warp


def build_requested() -> bool:
    return os.environ.get(BUILD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def csrc_dir() -> Path:
    """Where the CUDA sources are: `KVPRESS_CSRC_DIR`, else `<source root>/csrc`."""
    override = os.environ.get(CSRC_ENV)
    return Path(override) if override else Path(__file__).resolve().parent.parent / "csrc"


def source_paths() -> list[Path]:
    return [csrc_dir() / name for name in SOURCES]


@functools.cache
def load_extension(verbose: bool = False) -> ModuleType:
    """Compile (first time) and import the extension. Raises RuntimeError when it cannot be built here."""
    if not build_requested():
        raise RuntimeError(f"the CUDA decode kernel is opt-in: set {BUILD_ENV}=1")
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA decode kernel needs a CUDA device and a CUDA build of torch")
    missing = [str(p) for p in source_paths() if not p.is_file()]
    if missing:
        raise RuntimeError(f"CUDA sources not found ({', '.join(missing)}); set {CSRC_ENV} to the csrc/ directory")
    from torch.utils.cpp_extension import load

    module: ModuleType = load(
        name=EXTENSION_NAME,
        sources=[str(p) for p in source_paths()],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math"],
        verbose=verbose,
    )
    return module


def extension_loaded() -> bool:
    """True if the extension is (or can now be) built and imported; warns once on failure."""
    try:
        load_extension()
    except Exception as exc:
        _warn_once(str(exc))
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"CUDA decode kernel unavailable ({message}); falling back", stacklevel=4)


def supports(query: torch.Tensor, kv_pool: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel's instantiations cover this call (else the dispatcher uses Triton or torch)."""
    head_dim = query.shape[-1]
    group = query.shape[1] // num_kv_heads if num_kv_heads else 0
    return (
        query.is_cuda
        and query.dtype == kv_pool.dtype
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and head_dim in HEAD_DIMS
        and 1 <= group <= MAX_GROUP
        and query.shape[1] % num_kv_heads == 0
    )


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
    *,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """CUDA twin of the reference `paged_decode_attention` (no `probs_out`; `position_pool` unused)."""
    ext = load_extension()
    device = query.device
    batch = query.shape[0]
    _, num_kv_heads, max_pages = block_tables.shape
    page_size = kv_pool.shape[2]
    has_ring = ring_tables is not None and ring_lens is not None and ring_tables.shape[-1] > 0
    ring_t = ring_l = None
    ring_tokens = 0
    if has_ring:
        assert ring_tables is not None and ring_lens is not None
        ring_t = ring_tables.to(device=device, dtype=torch.int32)
        ring_t = ring_t if ring_t.stride(-1) == 1 else ring_t.contiguous()
        ring_l = ring_lens.to(device=device, dtype=torch.int64)
        ring_tokens = ring_t.shape[-1] * page_size
    tables = block_tables.to(device=device, dtype=torch.int32)
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    num_splits, split = choose_splits(
        batch, num_kv_heads, max_pages * page_size + ring_tokens, BLOCK_N, multiprocessor_count(device), split_tokens
    )
    with torch.cuda.device(device):
        out: torch.Tensor = ext.paged_decode_attention(
            query if query.stride(-1) == 1 else query.contiguous(),
            kv_pool,
            tables,
            seq_lens.to(device=device, dtype=torch.int32),
            rows.to(device=device, dtype=torch.int64).contiguous(),
            ring_t,
            ring_l,
            float(scale),
            num_splits,
            split,
            torch.cuda.current_stream(device).cuda_stream,
        )
    return out
