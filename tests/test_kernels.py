"""Triton kernels (and the CUDA decode kernel) against their pure-torch references.

Without a GPU the Triton kernels run under the Triton interpreter (`TRITON_INTERPRET=1`) at small
shapes; on a GPU the same tests run compiled, at larger shapes. The variable is read when a
`@triton.jit` function is decorated, and that includes Triton's own standard library (`tl.zeros`,
`tl.sum`, ...), decorated when `triton.language` is first imported. So it is set here at collection
time (only where no GPU is visible: it is process-wide). When this module runs alone that is early
enough; in the full suite something imports triton first (transformers' Llama code does), and then
`test_interpreter_tests_in_a_fresh_process` re-runs this file in a child process with the variable
set from the start, while the in-process interpreter tests skip.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import torch.nn.functional as F

from vllm_kvpress_ext.attention import ops, reference
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill, RequestPrefill, reduce_group, window_attention
from vllm_kvpress_ext.policies.capture import LayerCapture

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs are for machines without a GPU (process-wide)"),
    ),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """assert_close at the tolerance of the kernel's compute dtype (fp32 accumulation in every case)."""
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# Triton 3.9's interpreter multiplies bf16 `tl.dot` operands as their raw uint16 bit patterns
# (`create_dot` in triton/runtime/interpreter.py), so bf16 attention is checked on GPUs only.
BF16_DOT_BROKEN = not HAS_CUDA


def _interpreter_usable() -> bool:
    """On CPU: was `triton.language` set up for the interpreter (imported after TRITON_INTERPRET=1)?"""
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def _kernel(name: str) -> ModuleType:
    """`vllm_kvpress_ext.kernels.<name>`, interpreted on CPU even if it was imported before the env var."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not HAS_CUDA and not _interpreter_usable():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET was set; run by test_interpreter_tests_in_a_fresh_process"
        )
    module = importlib.import_module(f"vllm_kvpress_ext.kernels.{name}")
    if not HAS_CUDA and not any(type(v).__name__ == "InterpretedFunction" for v in vars(module).values()):
        module = importlib.reload(module)
    return module


# ---------------------------------------------------------------------------------------------- decode


def _ragged_tables(
    lens: torch.Tensor, page_size: int, ring_pages: int, spare: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables for per-(row, head) lengths, pages scattered over a pool, and ring tables: (tables, ring, pages)."""
    rows, heads = lens.shape
    per_head = (lens + page_size - 1) // page_size
    width = int(per_head.max()) + 1  # one spare -1 column, as after the table doubled
    ring_total = rows * heads * ring_pages
    num_pages = int(per_head.sum()) + ring_total + spare
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    tables = torch.full((rows, heads, width), -1, dtype=torch.int32)
    taken = 0
    for r in range(rows):
        for h in range(heads):
            n = int(per_head[r, h])
            tables[r, h, :n] = perm[taken : taken + n]
            taken += n
    ring = perm[taken : taken + ring_total].view(rows, heads, ring_pages).contiguous()
    return tables, ring, num_pages


def _decode_case(
    device: str, group: int, head_dim: int, dtype: torch.dtype, ring: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    page_size = 16
    if device == "cpu":
        num_kv_heads = 2
        # Empty, single-entry, exactly one page, crossing one and two page boundaries, long.
        lens = torch.tensor([[0, 1], [16, 17], [33, 70], [5, 0]], dtype=torch.int32)
        ring_pages, ring_lens = 2, torch.tensor([5, 32, 0, 17])
    else:
        num_kv_heads = 8 if group <= 4 else 4
        lens = torch.randint(0, 3000, (12, num_kv_heads), generator=gen, dtype=torch.int32)
        lens[0, 0], lens[1, 1], lens[2, :] = 0, 1, 4000
        ring_pages, ring_lens = 8, torch.randint(0, 8 * page_size + 1, (12,), generator=gen)
    tables, ring_tables, num_pages = _ragged_tables(lens, page_size, ring_pages if ring else 0, 3, gen)
    kv = torch.randn(num_pages, 2, page_size, head_dim, generator=gen).to(dtype)
    positions = torch.zeros(num_pages, page_size, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3, 1]) if device == "cpu" else torch.randperm(12, generator=gen)[:9]
    query = torch.randn(rows.numel(), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    tensors = [query, kv, positions, tables, lens, rows, ring_tables, ring_lens]
    return tuple(t.to(device) for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [False, True], ids=["global", "ring"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(device: str, group: int, head_dim: int, ring: bool) -> None:
    kernel = _kernel("decode_attention")
    query, kv, positions, tables, lens, rows, ring_tables, ring_lens = _decode_case(
        device, group, head_dim, torch.float32, ring, seed=group * 10 + head_dim + ring
    )
    rt, rl = (ring_tables, ring_lens) if ring else (None, None)
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(query, kv, positions, tables, lens, rows, scale, rt, rl)
    # Default launch shape, then forced split-K: 16-token splits give up to 7 splits per head here.
    for split_tokens, block_n in ((None, 64), (16, 16), (48, 16)):
        out = kernel.paged_decode_attention(
            query, kv, positions, tables, lens, rows, scale, rt, rl, split_tokens=split_tokens, block_n=block_n
        )
        assert out.dtype == query.dtype and out.shape == query.shape
        _close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_half_precision(device: str, dtype: torch.dtype) -> None:
    kernel = _kernel("decode_attention")
    query, kv, positions, tables, lens, rows, ring_tables, ring_lens = _decode_case(device, 4, 64, dtype, True, 7)
    if not (dtype == torch.bfloat16 and BF16_DOT_BROKEN):
        expected = reference.paged_decode_attention(
            query, kv, positions, tables, lens, rows, 0.125, ring_tables, ring_lens
        )
        out = kernel.paged_decode_attention(
            query, kv, positions, tables, lens, rows, 0.125, ring_tables, ring_lens, split_tokens=32, block_n=16
        )
        assert out.dtype == dtype
        _close(out, expected, dtype)
    # A query dtype other than the pool's promotes both to fp32 (no silent downcast of the query).
    q32 = query.float()
    expected32 = reference.paged_decode_attention(q32, kv, positions, tables, lens, rows, 0.125, ring_tables, ring_lens)
    out32 = kernel.paged_decode_attention(q32, kv, positions, tables, lens, rows, 0.125, ring_tables, ring_lens)
    assert out32.dtype == torch.float32
    _close(out32, expected32, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_on_the_managers_layout(device: str) -> None:
    """The cache's own tables after compaction, a ring and decode steps: kernel == reference."""
    kernel = _kernel("decode_attention")
    torch.manual_seed(3)
    layers, heads, head_dim, page_size, window = 2, 2, 64, 8, 16
    cache = PagedKVCache(
        layers, heads, head_dim, num_pages=128, page_size=page_size, max_requests=3, dtype=torch.float32, device=device
    )
    rows = []
    for r, n in enumerate((40, 23, 9)):
        rid = f"r{r}"
        row = cache.add_request(rid)
        rows.append(row)
        slots = cache.append_slots([row], torch.arange(n).view(1, -1))
        cache.write(slots, torch.randn(*slots.shape, head_dim), torch.randn(*slots.shape, head_dim))
        if r == 0:
            cache.start_ring(rid, window, torch.rand(layers, heads, n, device=device) < 0.4)
        else:
            mask = torch.rand(layers, heads, n) < 0.6
            mask[..., 0] = True
            cache.apply_keep_plan(rid, KeepPlan.from_mask(mask))
    for step in range(3):  # decode appends (the ring row promotes or overwrites)
        slots = cache.append_slots(rows, torch.full((3, 1), 100 + step))
        cache.write(slots, torch.randn(*slots.shape, head_dim), torch.randn(*slots.shape, head_dim))
    batch = torch.tensor([rows[2], rows[0], rows[1]], device=device)
    query = torch.randn(3, heads * 4, head_dim, device=device)
    ring_lens = cache.rings.lens().to(device)
    for layer in range(layers):
        args = (
            query,
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[layer],
            cache.device_seq_lens[layer],
            batch,
            0.125,
            cache.rings.device_tables[layer],
            ring_lens,
        )
        expected = reference.paged_decode_attention(*args)
        out = kernel.paged_decode_attention(*args, split_tokens=16, block_n=16)
        _close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_degenerate_batches(device: str) -> None:
    kernel = _kernel("decode_attention")
    kv = torch.randn(4, 2, 16, 64, device=device)
    positions = torch.zeros(4, 16, dtype=torch.int32, device=device)
    tables = torch.full((2, 2, 1), -1, dtype=torch.int32, device=device)
    lens = torch.zeros(2, 2, dtype=torch.int32, device=device)
    query = torch.randn(2, 4, 64, device=device)
    rows = torch.tensor([1, 0], device=device)
    out = kernel.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.125)
    assert torch.equal(out, torch.zeros_like(out))  # nothing cached: zeros, like the reference
    empty = kernel.paged_decode_attention(query[:0], kv, positions, tables, lens, rows[:0], 0.125)
    assert empty.shape == (0, 4, 64)


def test_choose_splits() -> None:
    from vllm_kvpress_ext.kernels.common import MAX_SPLITS, choose_splits

    # A big batch already fills the GPU: one split per head, no partials.
    assert choose_splits(1024, 8, 8192, 64, 132) == (1, 8192)
    # One request, one long head: cut into chunks of whole tiles, bounded by MAX_SPLITS.
    splits, tokens = choose_splits(1, 1, 100_000, 64, 132)
    assert 1 < splits <= MAX_SPLITS and tokens % 64 == 0 and splits * tokens >= 100_000
    assert choose_splits(4, 2, 0, 64, 132) == (1, 64)
    assert choose_splits(4, 2, 100, 16, 132, split_tokens=20) == (4, 32)


# -------------------------------------------------------------------------------------------- kv write


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_kv_write_matches_the_cache_write(device: str, dtype: torch.dtype) -> None:
    kernel = _kernel("kv_write")
    torch.manual_seed(4)
    head_dim, heads, layers = 64, 2, 2
    cache = PagedKVCache(
        layers, heads, head_dim, num_pages=64, page_size=16, max_requests=2, dtype=dtype, device=device
    )
    row = cache.add_request("a")
    slots = cache.append_slots([row], torch.arange(37).view(1, -1))  # prefill bulk: [L, 1, H, 37]
    k, v = torch.randn(*slots.shape, head_dim, device=device), torch.randn(*slots.shape, head_dim, device=device)
    kv_before = cache.pool.kv.clone()
    cache.write(slots, k, v)
    expected = cache.pool.kv.clone()
    cache.pool.kv.copy_(kv_before)
    kernel.write_kv(cache.pool.kv, slots, k.to(dtype), v.to(dtype))  # same-dtype input: exact
    assert torch.equal(cache.pool.kv, expected)
    # Decode append (one token per head), fp32 input cast to the pool's dtype, positions too.
    step = cache.append_slots([row], torch.tensor([[37]]))[:, :, :, 0]  # [L, 1, H]
    k1, v1 = torch.randn(*step.shape, head_dim, device=device), torch.randn(*step.shape, head_dim, device=device)
    kv_ref, pos_ref = cache.pool.kv.clone(), cache.pool.positions.clone()
    pos = torch.full(step.shape, 1234, device=device)
    reference.write_kv(kv_ref, step, k1, v1, pos_ref, pos)
    kernel.write_kv(cache.pool.kv, step, k1, v1, cache.pool.positions, pos)
    # The interpreter rounds fp32 -> bf16 differently from torch (a last-bit difference); GPUs agree.
    exact = dtype != torch.bfloat16 or device == "cuda"
    if exact:
        assert torch.equal(cache.pool.kv, kv_ref)
    else:
        _close(cache.pool.kv, kv_ref, dtype)
    assert torch.equal(cache.pool.positions, pos_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_skips_negative_slots(device: str) -> None:
    kernel = _kernel("kv_write")
    kv = torch.zeros(4, 2, 8, 32, device=device)
    ref = kv.clone()
    slots = torch.tensor([3, -1, 17, -1], device=device)
    k, v = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    kernel.write_kv(kv, slots, k, v)
    reference.write_kv(ref, slots, k, v)
    assert torch.equal(kv, ref) and int((kv != 0).any(-1).sum()) == 4  # 2 slots x (K, V)


# ---------------------------------------------------------------------------------------------- copies


def _filled_pool(device: str, pages: int = 16, page_size: int = 4, head_dim: int = 64) -> tuple[torch.Tensor, ...]:
    kv = torch.randn(pages, 2, page_size, head_dim, device=device)
    positions = torch.arange(pages * page_size, dtype=torch.int32, device=device).view(pages, page_size)
    return kv, positions


@pytest.mark.parametrize("device", DEVICES)
def test_copy_slots_read_before_write(device: str) -> None:
    """Chains where a slot is written by one entry and read by the next, as in order-preserving compaction."""
    kernel = _kernel("compaction")
    kv, positions = _filled_pool(device)
    src = torch.tensor([3, 4, 5, 9, 30, 31], device=device)
    dst = torch.tensor([2, 3, 4, 5, 9, 30], device=device)
    kv_ref, pos_ref = kv.clone(), positions.clone()
    reference.copy_slots(kv_ref, pos_ref, src, dst)
    kernel.copy_slots(kv, positions, src, dst, block_t=4)
    assert torch.equal(kv, kv_ref) and torch.equal(positions, pos_ref)
    # Disjoint sources and destinations (tail entries into holes): the one-pass copy agrees.
    kv, positions = _filled_pool(device)
    kv_ref, pos_ref = kv.clone(), positions.clone()
    src, dst = torch.tensor([40, 41, 50, 63], device=device), torch.tensor([1, 7, 8, 20], device=device)
    reference.copy_slots(kv_ref, pos_ref, src, dst)
    kernel.copy_slots(kv, positions, src, dst, disjoint=True, block_t=4)
    assert torch.equal(kv, kv_ref) and torch.equal(positions, pos_ref)


# --------------------------------------------------------------------------------------- window scores


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_reduction", ["mean", "max"])
@pytest.mark.parametrize("window_reduction", ["sum", "mean"])
@pytest.mark.parametrize("group", [1, 4])
def test_window_scores_match_the_policies_scoring(
    device: str, group: int, window_reduction: str, group_reduction: str
) -> None:
    kernel = _kernel("window_scores")
    gen = torch.Generator().manual_seed(group)
    heads, head_dim = 2, 64
    n, w = (70, 7) if device == "cpu" else (5000, 64)
    keys = torch.randn(heads, n, head_dim, generator=gen).to(device)
    key_pos = torch.arange(n, device=device)
    queries = torch.randn(w, heads * group, head_dim, generator=gen).to(device)
    query_pos = torch.arange(n - w, n, device=device)
    scale = head_dim**-0.5
    out = kernel.window_scores(queries, query_pos, keys, key_pos, scale, window_reduction, group_reduction, block_n=16)
    probs = window_attention(queries, query_pos, keys, key_pos, scale)  # what SnapKV-family policies compute
    per_head = probs.sum(dim=1) if window_reduction == "sum" else probs.mean(dim=1)
    expected = reduce_group(per_head, heads, group_reduction)
    assert out.dtype == torch.float32 and out.shape == (heads, n)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    ref = reference.window_scores(queries, query_pos, keys, key_pos, scale, window_reduction, group_reduction)
    torch.testing.assert_close(ref, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_window_scores_per_head_positions_and_half_precision(device: str) -> None:
    """After compaction every head has its own positions; fp16 keys and queries."""
    kernel = _kernel("window_scores")
    gen = torch.Generator().manual_seed(9)
    heads, group, head_dim, n, w = 2, 8, 128, 40, 5
    key_pos = torch.stack([torch.randperm(60, generator=gen)[:n].sort().values for _ in range(heads)]).to(device)
    keys = torch.randn(heads, n, head_dim, generator=gen).to(device, torch.float16)
    queries = torch.randn(w, heads * group, head_dim, generator=gen).to(device, torch.float16)
    query_pos = torch.arange(55, 60, device=device)
    for wr, gr in (("sum", "mean"), ("mean", "max")):
        out = kernel.window_scores(queries, query_pos, keys, key_pos, 0.1, wr, gr, block_n=16)
        expected = reference.window_scores(queries, query_pos, keys, key_pos, 0.1, wr, gr)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


# The launch defaults `kvpress bench kernels --compile-only` chose per head_dim and dtype (docs/gpu.md):
# run at GPU shapes with no block size forced, so the tiles under test are the ones the dispatcher uses.
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
on_gpu = pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs CUDA and triton")


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(F32, F32), (F16, F16), (BF16, BF16), (F32, BF16), (BF16, F16)],
    ids=["fp32", "fp16", "bf16", "fp32-q-bf16-cache", "bf16-q-fp16-cache"],
)
def test_decode_default_tiles_on_cuda(head_dim: int, query_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    kernel = _kernel("decode_attention")
    query, kv, positions, tables, lens, rows, rt, rl = _decode_case("cuda", 4, head_dim, cache_dtype, True, head_dim)
    query = query.to(query_dtype)
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(query, kv, positions, tables, lens, rows, scale, rt, rl)
    out = kernel.paged_decode_attention(query, kv, positions, tables, lens, rows, scale, rt, rl)
    assert out.dtype == expected.dtype == query_dtype
    _close(out.float(), expected.float(), query_dtype)  # mixed dtypes compute in fp32, then round to the query's


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize(("head_dim", "dtype"), [(128, BF16), (128, F32), (256, BF16), (256, F32)])
def test_vertical_slash_default_tiles_on_cuda(head_dim: int, dtype: torch.dtype) -> None:
    kernel = _kernel("vertical_slash")
    n = 2000
    q, k, v = _vs_inputs("cuda", n, 2, 4, head_dim, dtype, seed=head_dim)
    admitted = (torch.rand(2, n, generator=torch.Generator().manual_seed(5)) < 0.2).cuda()
    scale = head_dim**-0.5
    out = kernel.vertical_slash_attention(q, k, v, admitted, 256, scale)
    expected = reference.vertical_slash_attention(q, k, v, admitted, 256, scale)
    assert out.dtype == dtype
    _close(out, expected, dtype)


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize(("head_dim", "dtype"), [(128, F32), (256, F32), (256, BF16)])
def test_window_scores_default_tiles_on_cuda(head_dim: int, dtype: torch.dtype) -> None:
    kernel = _kernel("window_scores")
    gen = torch.Generator().manual_seed(head_dim)
    heads, group, n, w = 2, 4, 3000, 64
    keys = torch.randn(heads, n, head_dim, generator=gen).to("cuda", dtype)
    queries = torch.randn(w, heads * group, head_dim, generator=gen).to("cuda", dtype)
    key_pos, query_pos = torch.arange(n, device="cuda"), torch.arange(n - w, n, device="cuda")
    out = kernel.window_scores(queries, query_pos, keys, key_pos, head_dim**-0.5)
    expected = reference.window_scores(queries, query_pos, keys, key_pos, head_dim**-0.5)
    tol = 1e-5 if dtype == F32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


# ------------------------------------------------------------------------- the hot path through the ops


def _dispatch_to_kernels(monkeypatch: pytest.MonkeyPatch, device: str) -> list[str]:
    """Make `attention.ops` run its Triton kernels on these tensors (interpreted on CPU); record the kernels used."""
    used: list[str] = []

    def module(name: str) -> ModuleType:
        used.append(name)
        return _kernel(name)

    monkeypatch.delenv(ops.DISABLE_TRITON_ENV, raising=False)
    monkeypatch.setattr(ops, "_kernel_module", module)
    if device == "cpu":
        monkeypatch.setattr(ops, "_on_cuda", lambda tensors: True)
    return used


def _cache_life(device: str) -> PagedKVCache:
    """Prefill writes, a keep plan, a decode eviction, and a ring request promoting tokens while decoding."""
    head_dim = 32
    cache = PagedKVCache(2, 2, head_dim, num_pages=120, page_size=4, max_requests=3, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(21)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, head_dim, generator=gen).to(device)

    for rid in ("a", "b", "ring"):
        row = cache.add_request(rid)
        slots = cache.append_slots([row], torch.arange(30).view(1, -1))
        cache.write(slots, rand(*slots.shape), rand(*slots.shape))
    mask = torch.rand(2, 2, 30, generator=gen) < 0.5
    mask[..., 0] = True
    cache.apply_keep_plan("a", KeepPlan.from_mask(mask))
    cache.evict([cache.row_of("b")] * 4, [0, 1, 1, 0], [0, 1, 1, 1], [2, 5, 6, 29])
    cache.start_ring("ring", 8, torch.rand(2, 2, 30, generator=gen) < 0.5)
    for t in range(30, 42):
        row = cache.row_of("ring")
        step = cache.append_slots([row], torch.tensor([[t]]))
        cache.write(step[:, :, :, 0], rand(2, 1, 2), rand(2, 1, 2))
        cache.rings.admit(0, [row], torch.tensor([[t % 2 == 0, t % 3 == 0]]))
        cache.rings.admit(1, [row], torch.tensor([[True, False]]))
    return cache


@pytest.mark.parametrize("device", DEVICES)
def test_cache_writes_and_copies_run_through_the_kernels(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's writes, compaction, eviction, ring start and promotions give the same cache either way."""
    _kernel("kv_write")  # skips where the interpreter cannot run
    monkeypatch.setenv(ops.DISABLE_TRITON_ENV, "1")
    expected = _cache_life(device)
    monkeypatch.undo()
    used = _dispatch_to_kernels(monkeypatch, device)
    actual = _cache_life(device)
    assert {"kv_write", "compaction"} <= set(used)
    assert torch.equal(actual.block_tables, expected.block_tables) and torch.equal(actual.seq_lens, expected.seq_lens)
    for rid in ("a", "b", "ring"):
        for layer in range(2):
            for head in range(2):
                for region in ("global", "ring") if rid == "ring" else ("global",):
                    for want, got in zip(
                        expected.gather(rid, layer, head, region), actual.gather(rid, layer, head, region), strict=True
                    ):
                        assert torch.equal(want, got)


def _scoring_layers(device: str, n: int = 48, hkv: int = 2, hq: int = 8, d: int = 16) -> list[LayerPrefill]:
    layers = []
    for index in range(3):
        g = torch.Generator().manual_seed(100 + index)
        capture = LayerCapture(
            queries=(torch.randn(20, hq, d, generator=g) * 1.5).to(device), query_positions=torch.arange(n - 20, n)
        )
        keys, values = torch.randn(hkv, n, d, generator=g) * 1.5, torch.randn(hkv, n, d, generator=g)
        positions = torch.arange(n).to(device)
        layer = LayerPrefill(index, 3, keys.to(device), values.to(device), positions, capture, None, d**-0.5)  # type: ignore[arg-type]
        layers.append(layer)
    return layers


def _plan_masks(spec: dict[str, object], layers: list[LayerPrefill]) -> torch.Tensor:
    policy = load_policy(spec)
    assert policy is not None
    state: dict[str, object] = {}
    results = [policy.on_layer_prefilled(layer, state) for layer in layers]
    first = layers[0]
    assert first.capture is not None and first.capture.queries is not None
    request = RequestPrefill("r", len(layers), first.num_kv_heads, first.capture.queries.shape[1], first.length)
    plan = policy.plan(request, results, state)
    assert plan is not None
    return plan.to_mask(torch.full((len(layers), first.num_kv_heads), first.length))


POLICIES_SCORED_BY_WINDOW = [
    {"name": "snapkv", "window": 8, "ratio": 0.3},
    {"name": "pyramidkv", "window": 8, "ratio": 0.3},
    {"name": "adakv", "window": 8, "ratio": 0.3, "gqa_reduction": "max"},
    {"name": "kvec", "window": 8, "extended_window": 16, "delta": 1, "ratio": 0.3},
    {"name": "kvec", "window": 8, "extended_window": 16, "delta": 1, "lam": 0.0, "ratio": 0.3},
    {"name": "lava", "window": 8, "ratio": 0.3},
    {"name": "lava", "window": 8, "ratio": 0.3, "pooling": "avgpool", "gqa_reduction": "mean"},
    {"name": "xkv", "window": 8, "ratio": 0.3},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", POLICIES_SCORED_BY_WINDOW, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_window_scoring_policies_plan_the_same_through_the_kernel(
    device: str, spec: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SnapKV family, K-VEC, LAVa and XKV score through `attention.ops.window_scores`: same plans either way."""
    _kernel("window_scores")
    layers = _scoring_layers(device)
    monkeypatch.setenv(ops.DISABLE_TRITON_ENV, "1")
    expected = _plan_masks(spec, layers)
    monkeypatch.undo()
    used = _dispatch_to_kernels(monkeypatch, device)
    actual = _plan_masks(spec, layers)
    assert "window_scores" in used
    assert torch.equal(actual, expected)


# --------------------------------------------------------------------------------------- vertical-slash


def _vs_inputs(
    device: str, n: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return q, k, v


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense SDPA with an explicit `[Hkv, n, n]` mask, GQA by repetition: an oracle independent of `reference`."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(group, 1).transpose(0, 1).float(),
        v.repeat_interleave(group, 1).transpose(0, 1).float(),
        attn_mask=mask.repeat_interleave(group, 0),
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 64), (4, 128)])
@pytest.mark.parametrize("pattern", ["all", "none", "random"])
def test_vertical_slash_matches_reference(device: str, pattern: str, group: int, head_dim: int) -> None:
    kernel = _kernel("vertical_slash")
    heads = 2
    n, window, blocks = (50, 7, {"block_m": 16, "block_n": 16}) if device == "cpu" else (3000, 256, {})
    q, k, v = _vs_inputs(device, n, heads, group, head_dim, torch.float32, seed=group + head_dim)
    gen = torch.Generator().manual_seed(11)
    admitted = {
        "all": torch.ones(heads, n, dtype=torch.bool),
        "none": torch.zeros(heads, n, dtype=torch.bool),
        "random": torch.rand(heads, n, generator=gen) < 0.15,
    }[pattern].to(device)
    if pattern == "random":
        admitted[1, : n // 2] = False  # one head with a long run of empty key blocks to skip
    scale = head_dim**-0.5
    out = kernel.vertical_slash_attention(q, k, v, admitted, window, scale, **blocks)
    expected = reference.vertical_slash_attention(q, k, v, admitted, window, scale)
    _close(out, expected, torch.float32)
    i = torch.arange(n, device=device).view(n, 1)
    j = torch.arange(n, device=device).view(1, n)
    if pattern == "all":  # every column admitted: plain causal attention
        causal = reference.causal_attention(q[None], k[None], v[None], scale)[0]
        _close(out, causal, torch.float32)
    if pattern == "none":  # nothing admitted: the sliding-window band alone
        band = ((j <= i) & (i - j < window)).expand(heads, n, n)
        _close(out, _masked_sdpa(q, k, v, band, scale), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_vertical_slash_chunk_and_half_precision(device: str) -> None:
    """A later prefill chunk (`query_start`) over its prefix, group 8, and fp16 inputs."""
    kernel = _kernel("vertical_slash")
    n, start = (45, 29) if device == "cpu" else (2500, 1700)
    blocks = {"block_m": 16, "block_n": 16} if device == "cpu" else {}
    q, k, v = _vs_inputs(device, n, 1, 8, 64, torch.float32, seed=3)
    admitted = (torch.rand(1, n, generator=torch.Generator().manual_seed(2)) < 0.3).to(device)
    expected = reference.vertical_slash_attention(q[start:], k, v, admitted, 5, 0.125, query_start=start)
    out = kernel.vertical_slash_attention(q[start:], k, v, admitted, 5, 0.125, query_start=start, **blocks)
    _close(out, expected, torch.float32)
    q16, k16, v16 = q.half(), k.half(), v.half()
    out16 = kernel.vertical_slash_attention(q16, k16, v16, admitted, 5, 0.125, **blocks)
    assert out16.dtype == torch.float16
    _close(out16, reference.vertical_slash_attention(q16, k16, v16, admitted, 5, 0.125), torch.float16)


def test_admitted_blocks_lists_flagged_blocks_per_head() -> None:
    vertical_slash = _kernel("vertical_slash")
    admitted = torch.zeros(2, 70, dtype=torch.bool)
    admitted[0, [3, 40, 69]] = True  # blocks 0, 2, 4 of 16
    ids, counts = vertical_slash.admitted_blocks(admitted, 16)
    assert counts.tolist() == [[0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 0, 0]]
    assert ids[0, :3].tolist() == [0, 2, 4]


# ---------------------------------------------------------------------------------------------- dispatch


def _forbid_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> ModuleType:
        raise AssertionError(f"kernel {name} must not be used here")

    monkeypatch.setattr(ops, "_kernel_module", fail)


def test_dispatch_never_runs_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors get the references, or the CPU's own paths (the C++ paged decode, the block-sparse
    vertical-slash: equal to the references to rounding, tested in their own files), never Triton."""
    _forbid_kernels(monkeypatch)
    monkeypatch.delenv(ops.DISABLE_TRITON_ENV, raising=False)
    query, kv, positions, tables, lens, rows, ring_tables, ring_lens = _decode_case(
        "cpu", 4, 64, torch.float32, True, 1
    )
    args = (query, kv, positions, tables, lens, rows, 0.125, ring_tables, ring_lens)
    expected = reference.paged_decode_attention(*args)
    torch.testing.assert_close(ops.paged_decode_attention(*args), expected, rtol=1e-5, atol=1e-5)
    q, k, v = _vs_inputs("cpu", 20, 2, 2, 64, torch.float32, 0)
    admitted = torch.rand(2, 20) < 0.5
    torch.testing.assert_close(
        ops.vertical_slash_attention(q, k, v, admitted, 4, 0.1),
        reference.vertical_slash_attention(q, k, v, admitted, 4, 0.1),
        rtol=1e-5,
        atol=1e-5,
    )
    keys, queries = torch.randn(2, 12, 64), torch.randn(3, 4, 64)
    assert torch.equal(
        ops.window_scores(queries, torch.arange(9, 12), keys, torch.arange(12), 0.1),
        reference.window_scores(queries, torch.arange(9, 12), keys, torch.arange(12), 0.1),
    )
    pool, pool_pos = _filled_pool("cpu")
    ops.write_kv(pool, torch.tensor([1, 2]), torch.ones(2, 64), torch.ones(2, 64))
    ops.copy_slots(pool, pool_pos, torch.tensor([1]), torch.tensor([5]))
    # Slot 5 (page 1, offset 1) now holds slot 1's ones and position.
    assert bool((pool[1, :, 1] == 1).all()) and int(pool_pos.view(-1)[5]) == 1
    assert ops.backend(query) == "reference"


def test_dispatch_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors + triton importable + not disabled -> Triton; probs_out always -> reference."""
    monkeypatch.setattr(ops, "_on_cuda", lambda tensors: True)
    monkeypatch.setattr(ops, "_triton_importable", lambda: True)
    monkeypatch.delenv(ops.DISABLE_TRITON_ENV, raising=False)
    monkeypatch.delenv(ops.BUILD_CUDA_ENV, raising=False)
    assert ops.triton_enabled(torch.empty(1))
    monkeypatch.setenv(ops.DISABLE_TRITON_ENV, "1")
    assert not ops.triton_enabled(torch.empty(1))
    monkeypatch.setenv(ops.DISABLE_TRITON_ENV, "0")
    assert ops.triton_enabled(torch.empty(1))

    calls: list[str] = []

    class FakeDecode:
        @staticmethod
        def paged_decode_attention(*args: object) -> torch.Tensor:
            calls.append("triton")
            return torch.zeros(1)

    monkeypatch.setattr(ops, "_kernel_module", lambda name: FakeDecode if name == "decode_attention" else None)
    query, kv, positions, tables, lens, rows, _, _ = _decode_case("cpu", 1, 64, torch.float32, False, 2)
    args = (query, kv, positions, tables, lens, rows, 0.125)
    ops.paged_decode_attention(*args)
    assert calls == ["triton"]
    probs: list[torch.Tensor] = []
    out = ops.paged_decode_attention(*args, probs_out=probs)
    assert calls == ["triton"] and len(probs) == 1  # the kernel never materialises probabilities
    torch.testing.assert_close(out, reference.paged_decode_attention(*args))


@pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="only for interpreter runs on machines without a GPU")
def test_interpreter_tests_in_a_fresh_process() -> None:
    """The interpreter tests, in a process where TRITON_INTERPRET=1 precedes every triton import."""
    if _interpreter_usable():
        pytest.skip("the interpreter tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-m", "not slow", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary


def test_package_imports_and_falls_back_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import vllm_kvpress_ext.attention as attention, vllm_kvpress_ext.engine\n"
        "from vllm_kvpress_ext.attention import ops\n"
        "assert not ops._triton_importable() and ops.backend(torch.empty(1)) == 'reference'\n"
        "q = torch.randn(4, 2, 8); k = torch.randn(4, 1, 8)\n"
        "adm = torch.ones(1, 4, dtype=torch.bool)\n"
        "out = attention.vertical_slash_attention(q, k, k, adm, 2, 0.3)\n"
        "torch.testing.assert_close(out, attention.causal_attention(q[None], k[None], k[None], 0.3)[0])\n"
        "from vllm_kvpress_ext.cli import main\n"
        "assert main(['bench', 'kernels']) == 2\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs a CUDA device" in result.stderr


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU refusal")
def test_bench_kernels_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.cli import main

    assert main(["bench", "kernels"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs CUDA and triton")
def test_bench_kernels_runs_on_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.bench.kernels_bench import KernelsBenchConfig, run_kernels_bench

    figures = run_kernels_bench(
        KernelsBenchConfig(
            requests=4,
            kept_tokens=512,
            full_context=1024,
            prefill_lens=(4096,),
            floor_lens=(1024,),
            copy_mib=64,
            repeats=2,
            warmup=1,
        )
    )
    out = capsys.readouterr().out
    assert "share of copy bandwidth" in out and "vertical-slash" in out
    assert figures["copy_GBps"] > 0 and figures["decode_speedup_r0.1"] > 0
    assert "against its floor" in out
    assert all(figures[f"floor_{k}_1024"] > 0 for k in ("decode", "kv_write", "compaction", "window_scores"))


# ------------------------------------------------------------------------------------------- CUDA (csrc)

NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if Path(p).is_file()), None
)


def _cuda_include() -> list[str]:
    assert NVCC is not None
    candidates = [Path(NVCC).resolve().parent.parent / "include", Path("/usr/local/cuda/include")]
    return [f"-I{p}" for p in candidates if (p / "cuda_runtime_api.h").is_file()][:1]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.skipif(NVCC is None or shutil.which("c++") is None, reason="nvcc or a C++ compiler not found")
def test_cuda_binding_compiles_against_torch_headers() -> None:
    """The binding parses and type-checks against this torch's headers (torch/extension.h: slow to parse)."""
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++")
    assert cxx is not None
    cmd = [
        cxx,
        "-std=c++20",
        "-fsyntax-only",
        "-DTORCH_EXTENSION_NAME=kvpress_paged_decode",
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        *_cuda_include(),
        str(ROOT / "csrc" / "binding.cpp"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA or NVCC is None, reason="needs a CUDA device and nvcc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_decode_matches_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPRESS_BUILD_CUDA", "1")
    cuda_decode = importlib.import_module("vllm_kvpress_ext.kernels.cuda_decode")
    for group in (1, 4, 8, 16):
        for head_dim in (64, 128):
            for ring in (False, True):
                query, kv, positions, tables, lens, rows, ring_tables, ring_lens = _decode_case(
                    "cuda", min(group, 8), head_dim, dtype, ring, seed=group + head_dim
                )
                if group == 16:
                    query = torch.cat([query, query], dim=1)
                rt, rl = (ring_tables, ring_lens) if ring else (None, None)
                expected = reference.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.1, rt, rl)
                for split_tokens in (None, 64, 1000):
                    out = cuda_decode.paged_decode_attention(
                        query, kv, positions, tables, lens, rows, 0.1, rt, rl, split_tokens=split_tokens
                    )
                    _close(out, expected, dtype)
    # And through the dispatcher.
    query, kv, positions, tables, lens, rows, rt, rl = _decode_case("cuda", 4, 128, dtype, True, 0)
    expected = reference.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.1, rt, rl)
    _close(ops.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.1, rt, rl), expected, dtype)
