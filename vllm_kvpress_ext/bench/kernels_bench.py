"""`kvpress bench kernels`: what the Triton kernels buy on a GPU (CUDA only).

Four tables:

1. Decode bandwidth. The GPU's copy bandwidth (a large tensor clone; read + write bytes over time)
   is the ceiling; decode attention over a ragged paged cache (default 32 requests, about 8K kept
   tokens per (request, KV head), lengths jittered +-50 % so heads are ragged) reads every kept K
   and V once, so its effective bandwidth (kept K/V bytes / time) as a share of the copy bandwidth
   says how close the kernel is to the memory roofline. The torch reference (gather, then einsum)
   and, with `--cuda-ext`, the CUDA kernel from `csrc/` are timed on the same cache.
2. Decode speedup from compression: at retention r of a `full_context`-token cache, paged decode
   over the kept r * full_context tokens per head against dense SDPA over the unpruned cache (a
   contiguous `[B, Hkv, full_context, d]` tensor, the layout most favourable to the dense side).
3. Vertical-slash prefill: the block-sparse kernel against dense causal SDPA (flash) at 25 %
   admission, for two admission patterns: whole 64-token blocks (what the block skipping exploits)
   and tokens drawn uniformly (nearly every block holds an admitted column: the worst case).
4. Each kernel against its floor, at every length of `floor_lens` (tokens per KV head): decode over
   ragged heads of that mean length, the KV write of a prefill of that length, the compaction that
   keeps a quarter of it (staged, as `apply_keep_plan` runs it), and the observation-window scores of
   a 64-query window over it. The floor is the larger of bytes / copy bandwidth and FLOPs / the
   measured matmul peak (a large bf16 / fp16 product); a kernel at 1.0x its floor could not be faster.
   Bytes count what the op must move at least once: every K and V read (and written, for a write or a
   copy), positions and slot indices; the two-pass window scores count their keys once.

Timing: CUDA events around each call, `warmup` untimed calls first, median of `repeats`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from vllm_kvpress_ext.bench.report import format_table


class KernelsBenchUnavailableError(RuntimeError):
    """The bench needs a CUDA device and Triton; the message says which is missing."""


@dataclass(frozen=True)
class KernelsBenchConfig:
    requests: int = 32
    kept_tokens: int = 8192
    jitter: float = 0.5  # per-head kept lengths drawn uniformly in kept_tokens * (1 +- jitter)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    full_context: int = 16384
    retentions: tuple[float, ...] = (0.1, 0.25, 0.5)
    prefill_lens: tuple[int, ...] = (32768, 65536, 131072)
    admission: float = 0.25
    window: int = 1024
    copy_mib: int = 2048
    warmup: int = 3
    repeats: int = 10
    prefill_repeats: int = 3
    floor_lens: tuple[int, ...] = (8192, 32768)
    score_window: int = 64
    cuda_ext: bool = False
    seed: int = 0


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        raise KernelsBenchUnavailableError(
            "kvpress bench kernels measures GPU kernels and needs a CUDA device; none is visible "
            "(torch.cuda.is_available() is False). The kernels' correctness tests run on CPU: "
            "pytest tests/test_kernels.py"
        )
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise KernelsBenchUnavailableError(
            f"kvpress bench kernels needs triton (pip install '.[triton]'): {exc}"
        ) from exc


def time_cuda(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` calls, each bracketed by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth(num_bytes: int, warmup: int, repeats: int, device: str | torch.device = "cuda") -> float:
    """Copy bandwidth in bytes/s: a clone reads and writes `num_bytes` each. CUDA events time it on a GPU,
    the wall clock elsewhere (the median of `repeats` either way)."""
    x = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    if x.device.type == "cuda":
        ms = time_cuda(x.clone, warmup, repeats)
    else:
        for _ in range(warmup):
            x.clone()
        samples = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            x.clone()
            samples.append(1000.0 * (time.perf_counter() - start))
        ms = statistics.median(samples)
    return 2 * x.numel() * 4 / (ms / 1000.0)


@dataclass
class RaggedCache:
    kv_pool: torch.Tensor
    position_pool: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a decode step must read: every kept entry of every head, once."""
        d, elem = self.kv_pool.shape[-1], self.kv_pool.element_size()
        return int(self.seq_lens.sum()) * 2 * d * elem


def ragged_cache(
    requests: int,
    num_kv_heads: int,
    mean_len: int,
    jitter: float,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> RaggedCache:
    """A one-layer ragged paged cache with pages scattered over the pool (as after compaction and churn)."""
    lo, hi = max(1, int(mean_len * (1 - jitter))), max(1, int(mean_len * (1 + jitter)))
    lens = torch.randint(lo, hi + 1, (requests, num_kv_heads), generator=generator)
    pages_per_head = (lens + page_size - 1) // page_size
    num_pages = int(pages_per_head.sum())
    width = int(pages_per_head.max())
    perm = torch.randperm(num_pages, generator=generator).to(torch.int32)
    tables = torch.full((requests, num_kv_heads, width), -1, dtype=torch.int32)
    starts = torch.cumsum(pages_per_head.view(-1), 0) - pages_per_head.view(-1)
    index = torch.arange(width).view(1, -1)
    valid = index < pages_per_head.view(-1, 1)
    flat = tables.view(-1, width)
    flat[valid] = perm[(starts.view(-1, 1) + index)[valid]]
    return RaggedCache(
        kv_pool=torch.randn(num_pages, 2, page_size, head_dim, device="cuda", dtype=dtype),
        position_pool=torch.zeros(num_pages, page_size, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        seq_lens=lens.to(torch.int32).cuda(),
        rows=torch.arange(requests, device="cuda"),
    )


def _decode_call(
    fn: Callable[..., torch.Tensor], cache: RaggedCache, query: torch.Tensor, scale: float
) -> Callable[[], torch.Tensor]:
    c = cache
    return functools.partial(fn, query, c.kv_pool, c.position_pool, c.block_tables, c.seq_lens, c.rows, scale)


def _decode_callables(
    cache: RaggedCache, query: torch.Tensor, scale: float, with_reference: bool, cuda_ext: bool
) -> dict[str, Callable[[], torch.Tensor]]:
    from vllm_kvpress_ext.attention import reference
    from vllm_kvpress_ext.kernels import decode_attention

    fns = {"triton": _decode_call(decode_attention.paged_decode_attention, cache, query, scale)}
    if cuda_ext:
        from vllm_kvpress_ext.kernels import cuda_decode

        fns["cuda (csrc)"] = _decode_call(cuda_decode.paged_decode_attention, cache, query, scale)
    if with_reference:
        fns["torch reference"] = _decode_call(reference.paged_decode_attention, cache, query, scale)
    return fns


def _admitted(pattern: str, num_kv_heads: int, n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    if pattern == "uniform tokens":
        return (torch.rand(num_kv_heads, n, generator=generator) < fraction).cuda()
    block = 64
    blocks = -(-n // block)
    chosen = torch.rand(num_kv_heads, blocks, generator=generator) < fraction
    return chosen.repeat_interleave(block, dim=1)[:, :n].contiguous().cuda()


def _dense_decode_ms(query: torch.Tensor, c: KernelsBenchConfig, scale: float) -> float:
    """SDPA of one query per request over a dense, unpruned `[B, Hkv, full_context, d]` cache."""
    keys = torch.randn(c.requests, c.num_kv_heads, c.full_context, c.head_dim, device="cuda", dtype=query.dtype)
    values = torch.randn_like(keys)
    q = query.view(c.requests, c.num_q_heads, 1, c.head_dim)
    return time_cuda(
        lambda: F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True), c.warmup, c.repeats
    )


def run_kernels_bench(config: KernelsBenchConfig) -> dict[str, float]:
    """Run the three measurements, print their tables and return the figures. CUDA only."""
    _require_gpu()
    c = config
    dtype = getattr(torch, c.dtype)
    if c.cuda_ext:
        import os

        from vllm_kvpress_ext.kernels import cuda_decode

        os.environ[cuda_decode.BUILD_ENV] = "1"
        cuda_decode.load_extension()
    gen = torch.Generator().manual_seed(c.seed)  # CPU-side layout draws; device tensors use the global seed
    torch.manual_seed(c.seed)
    scale = 1.0 / math.sqrt(c.head_dim)
    figures: dict[str, float] = {}
    print(f"config: {asdict(c)}")
    print(f"device: {torch.cuda.get_device_name()}")

    copy_bps = copy_bandwidth(c.copy_mib * 2**20, c.warmup, c.repeats)
    figures["copy_GBps"] = copy_bps / 1e9

    query = _decode_bandwidth(c, dtype, scale, copy_bps, gen, figures)
    _decode_speedup(c, query, dtype, scale, gen, figures)
    _vertical_slash_speedup(c, dtype, scale, gen, figures)
    if c.floor_lens:
        _kernel_floors(c, dtype, scale, copy_bps, gen, figures)
    return figures


def matmul_peak(dtype: torch.dtype, warmup: int, repeats: int, size: int = 8192) -> float:
    """FLOP/s of one `size`-cubed product in `dtype` (fp32 runs as IEEE fp32: TF32 is off by default)."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    ms = time_cuda(lambda: a @ b, warmup, repeats)
    return 2 * size**3 / (ms / 1000.0)


def _floor_row(
    name: str, n: int, ms: float, num_bytes: float, flops: float, copy_bps: float, peak: float
) -> tuple[list[object], float]:
    floor_ms = 1000.0 * max(num_bytes / copy_bps, flops / peak)
    bound = "memory" if num_bytes / copy_bps >= flops / peak else "compute"
    return [name, n, f"{ms:.3f}", f"{floor_ms:.3f}", bound, f"{ms / floor_ms:.2f}x"], ms / floor_ms


def _kernel_floors(
    c: KernelsBenchConfig,
    dtype: torch.dtype,
    scale: float,
    copy_bps: float,
    gen: torch.Generator,
    figures: dict[str, float],
) -> None:
    """4. Decode, KV write, compaction and window scores, each against max(bytes / copy bw, FLOPs / matmul peak)."""
    from vllm_kvpress_ext.kernels import compaction, decode_attention, kv_write, window_scores

    peak = matmul_peak(dtype, c.warmup, c.repeats)
    figures["matmul_TFLOPs"] = peak / 1e12
    elem = torch.empty((), dtype=dtype).element_size()
    d, hkv, hq = c.head_dim, c.num_kv_heads, c.num_q_heads
    rows: list[list[object]] = []
    for n in c.floor_lens:
        cache = ragged_cache(c.requests, hkv, n, c.jitter, c.page_size, d, dtype, gen)
        query = torch.randn(c.requests, hq, d, device="cuda", dtype=dtype)
        ms = time_cuda(_decode_call(decode_attention.paged_decode_attention, cache, query, scale), c.warmup, c.repeats)
        entries = int(cache.seq_lens.sum())
        flops = 4.0 * entries * (hq // hkv) * d
        row, ratio = _floor_row(f"decode ({c.requests} requests)", n, ms, cache.kv_bytes, flops, copy_bps, peak)
        rows.append(row)
        figures[f"floor_decode_{n}"] = ratio

        # One request's prefill of n tokens per head: every (token, KV head) written once.
        pages = hkv * (-(-n // c.page_size)) * 2
        kv_pool = torch.zeros(pages, 2, c.page_size, d, device="cuda", dtype=dtype)
        position_pool = torch.zeros(pages, c.page_size, dtype=torch.int32, device="cuda")
        slots = torch.randperm(pages * c.page_size, generator=gen)[: n * hkv].to("cuda")
        keys = torch.randn(n * hkv, d, device="cuda", dtype=dtype)
        values = torch.randn_like(keys)
        positions = torch.arange(n * hkv, device="cuda", dtype=torch.int32)
        write = functools.partial(kv_write.write_kv, kv_pool, slots, keys, values, position_pool, positions)
        ms = time_cuda(write, c.warmup, c.repeats)
        moved = n * hkv * (2 * 2 * d * elem + 8 + 4 + 4)  # K, V read and written; slot, position in, position out
        row, ratio = _floor_row("KV write (prefill)", n * hkv, ms, moved, 0.0, copy_bps, peak)
        rows.append(row)
        figures[f"floor_kv_write_{n}"] = ratio

        # Compaction keeping a quarter, order-preserving: kept entry e moves to slot rank(e).
        kept = n * hkv // 4
        src = torch.sort(torch.randperm(n * hkv, generator=gen)[:kept]).values.to("cuda")
        dst = torch.arange(kept, device="cuda")
        ms = time_cuda(functools.partial(compaction.copy_slots, kv_pool, position_pool, src, dst), c.warmup, c.repeats)
        moved = kept * (2 * 2 * d * elem + 2 * 4 + 2 * 8)  # K, V and position read and written; two slot lists
        row, ratio = _floor_row("compaction (keep 25%)", kept, ms, moved, 0.0, copy_bps, peak)
        rows.append(row)
        figures[f"floor_compaction_{n}"] = ratio

        # The observation-window scores of one layer (SnapKV's family): w queries over n keys per head.
        w = c.score_window
        key_tensor = torch.randn(hkv, n, d, device="cuda", dtype=dtype)
        window_queries = torch.randn(w, hq, d, device="cuda", dtype=dtype)
        key_positions = torch.arange(n, device="cuda")
        query_positions = torch.arange(n - w, n, device="cuda")
        scores = functools.partial(
            window_scores.window_scores, window_queries, query_positions, key_tensor, key_positions, scale
        )
        ms = time_cuda(scores, c.warmup, c.repeats)
        moved = hkv * n * (d * elem + 8 + 4) + w * hq * d * elem  # keys, key positions, the scores out
        flops = 2 * 2.0 * w * hq * n * d  # two passes each form every score
        row, ratio = _floor_row(f"window scores (w={w})", n, ms, moved, flops, copy_bps, peak)
        rows.append(row)
        figures[f"floor_window_scores_{n}"] = ratio
    print(
        f"\neach kernel against its floor: max(bytes / {copy_bps / 1e9:,.0f} GB/s copy, FLOPs / "
        f"{peak / 1e12:,.0f} TFLOP/s matmul), {hq}/{hkv} heads, d={d}, {c.dtype}"
    )
    print(format_table(["kernel", "tokens (per head) / entries", "ms", "floor ms", "bound", "x floor"], rows))


def _decode_bandwidth(
    c: KernelsBenchConfig,
    dtype: torch.dtype,
    scale: float,
    copy_bps: float,
    gen: torch.Generator,
    figures: dict[str, float],
) -> torch.Tensor:
    """1. Decode bandwidth at the nominal size, as a share of the device's copy bandwidth; returns the
    decode queries, which the speedup section reuses."""
    cache = ragged_cache(c.requests, c.num_kv_heads, c.kept_tokens, c.jitter, c.page_size, c.head_dim, dtype, gen)
    query = torch.randn(c.requests, c.num_q_heads, c.head_dim, device="cuda", dtype=dtype)
    rows: list[list[object]] = [["device copy (clone)", "-", f"{copy_bps / 1e9:,.0f}", "100.0%"]]
    for name, fn in _decode_callables(cache, query, scale, True, c.cuda_ext).items():
        ms = time_cuda(fn, c.warmup, c.repeats)
        bps = cache.kv_bytes / (ms / 1000.0)
        figures[f"decode_{name}_ms"] = ms
        figures[f"decode_{name}_share_of_copy"] = bps / copy_bps
        rows.append([name, f"{ms:.3f}", f"{bps / 1e9:,.0f}", f"{100 * bps / copy_bps:.1f}%"])
    print(
        f"\ndecode attention, {c.requests} requests x {c.num_kv_heads} KV heads x ~{c.kept_tokens} kept tokens "
        f"({cache.kv_bytes / 2**30:.2f} GiB of K/V), {c.num_q_heads} query heads, d={c.head_dim}, {c.dtype}"
    )
    print(format_table(["kernel", "ms", "GB/s", "share of copy bandwidth"], rows))
    del cache
    return query


def _decode_speedup(
    c: KernelsBenchConfig,
    query: torch.Tensor,
    dtype: torch.dtype,
    scale: float,
    gen: torch.Generator,
    figures: dict[str, float],
) -> None:
    """2. Decode speedup over dense attention on the unpruned cache, per retention."""
    from vllm_kvpress_ext.kernels import decode_attention

    dense_ms = _dense_decode_ms(query, c, scale)
    figures["decode_dense_ms"] = dense_ms
    rows = []
    for r in c.retentions:
        kept = max(1, round(r * c.full_context))
        cache = ragged_cache(c.requests, c.num_kv_heads, kept, c.jitter, c.page_size, c.head_dim, dtype, gen)
        ms = time_cuda(_decode_call(decode_attention.paged_decode_attention, cache, query, scale), c.warmup, c.repeats)
        figures[f"decode_speedup_r{r:g}"] = dense_ms / ms
        rows.append([f"{100 * r:g}%", kept, f"{dense_ms:.3f}", f"{ms:.3f}", f"{dense_ms / ms:.2f}x"])
        del cache
    print(
        f"\ndecode vs dense SDPA over the full {c.full_context}-token cache ({c.requests} requests, "
        f"kept lengths jittered +-{100 * c.jitter:g}%)"
    )
    print(format_table(["retention", "kept tokens/head", "dense ms", "paged triton ms", "speedup"], rows))


def _vertical_slash_speedup(
    c: KernelsBenchConfig, dtype: torch.dtype, scale: float, gen: torch.Generator, figures: dict[str, float]
) -> None:
    """3. Vertical-slash prefill against dense causal SDPA, for clustered and scattered admission."""
    from vllm_kvpress_ext.kernels import vertical_slash

    rows = []
    for n in c.prefill_lens:
        q = torch.randn(n, c.num_q_heads, c.head_dim, device="cuda", dtype=dtype)
        k = torch.randn(n, c.num_kv_heads, c.head_dim, device="cuda", dtype=dtype)
        v = torch.randn(n, c.num_kv_heads, c.head_dim, device="cuda", dtype=dtype)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        dense = time_cuda(
            functools.partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True),
            1,
            c.prefill_repeats,
        )
        for pattern in ("64-token blocks", "uniform tokens"):
            admitted = _admitted(pattern, c.num_kv_heads, n, c.admission, gen)
            ms = time_cuda(
                functools.partial(vertical_slash.vertical_slash_attention, q, k, v, admitted, c.window, scale),
                1,
                c.prefill_repeats,
            )
            figures[f"vs_{n}_{pattern.split()[0]}_speedup"] = dense / ms
            rows.append([n, pattern, f"{dense:.1f}", f"{ms:.1f}", f"{dense / ms:.2f}x"])
        del q, k, v, qt, kt, vt
    print(
        f"\nvertical-slash prefill vs dense causal SDPA, {100 * c.admission:g}% admitted, window {c.window}, "
        f"{c.num_q_heads}/{c.num_kv_heads} heads, d={c.head_dim}"
    )
    print(format_table(["tokens", "admission pattern", "dense ms", "vertical-slash ms", "speedup"], rows))
