"""`kvpress bench cache`: decode-step bookkeeping cost and compaction throughput.

Decode-step bookkeeping is everything the cache does per step before attention can run: decide
which (layer, request, head) crosses a page boundary, pop pages, update the block tables and
lengths, and produce the slot of every new token. It is timed for the vectorised cache and for a
naive per-(layer, request, head) Python loop over lists, side by side in one run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache


@dataclass(frozen=True)
class CacheBenchConfig:
    num_requests: int = 64
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    prompt_len: int = 256
    decode_steps: int = 64
    keep_ratio: float = 0.25
    dtype: torch.dtype = torch.float16
    seed: int = 0


def _naive_decode_bookkeeping(
    tables: list[list[list[list[int]]]], lens: list[list[list[int]]], free: list[int], page_size: int
) -> torch.Tensor:
    """The loop a first implementation would write: one Python iteration per (layer, request, head)."""
    slots = []
    for layer_tables, layer_lens in zip(tables, lens, strict=True):
        for req_tables, req_lens in zip(layer_tables, layer_lens, strict=True):
            for h, table in enumerate(req_tables):
                n = req_lens[h]
                if n % page_size == 0:
                    table.append(free.pop())
                slots.append(table[n // page_size] * page_size + n % page_size)
                req_lens[h] = n + 1
    return torch.tensor(slots)


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def run_cache_bench(config: CacheBenchConfig) -> dict[str, float]:
    """Run the benchmark, print its tables, and return the figures."""
    torch.manual_seed(config.seed)
    cache, rows = _filled_cache(config)
    fast_ms, naive_ms = _time_decode_bookkeeping(cache, rows, config)
    compaction_tokens_per_s = _time_compaction(cache, rows, config)
    evict_ms = _time_eviction(cache, rows, config)
    return {
        "decode_bookkeeping_ms": fast_ms,
        "naive_bookkeeping_ms": naive_ms,
        "compaction_tokens_per_s": compaction_tokens_per_s,
        "evict_ms": evict_ms,
    }


def _filled_cache(c: CacheBenchConfig) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache sized for the whole run, every request's prompt appended; (cache, request rows)."""
    pages_per_head = -(-(c.prompt_len + c.decode_steps) // c.page_size) + 1
    num_pages = c.num_layers * c.num_requests * c.num_kv_heads * pages_per_head
    cache = PagedKVCache(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        num_pages=num_pages,
        page_size=c.page_size,
        max_requests=c.num_requests,
        dtype=c.dtype,
        initial_pages_per_head=pages_per_head,
    )
    print(f"config: {asdict(c)}")
    pool_mib = num_pages * cache.pool.bytes_per_page / 2**20
    print(f"pool: {num_pages} pages x {cache.pool.bytes_per_page} B = {pool_mib:,.1f} MiB")
    rows = torch.tensor([cache.add_request(i) for i in range(c.num_requests)])
    prefill_positions = torch.arange(c.prompt_len).view(1, -1)
    for row in rows.tolist():
        cache.append_slots([row], prefill_positions)
    return cache, rows


def _time_decode_bookkeeping(cache: PagedKVCache, rows: torch.Tensor, c: CacheBenchConfig) -> tuple[float, float]:
    """Median ms per decode step of the vectorised append and of the naive loop over the same shapes."""
    fast: list[float] = []
    for step in range(c.decode_steps):
        positions = torch.full((c.num_requests, 1), c.prompt_len + step)
        start = time.perf_counter()
        cache.append_slots(rows, positions)
        fast.append(time.perf_counter() - start)
    tables = [
        [[[0] * (-(-c.prompt_len // c.page_size)) for _ in range(c.num_kv_heads)] for _ in range(c.num_requests)]
        for _ in range(c.num_layers)
    ]
    lens = [[[c.prompt_len] * c.num_kv_heads for _ in range(c.num_requests)] for _ in range(c.num_layers)]
    free = list(range(c.num_layers * c.num_requests * c.num_kv_heads * (c.decode_steps // c.page_size + 2)))
    naive: list[float] = []
    for _ in range(min(c.decode_steps, 16)):  # fewer steps: it is slow
        start = time.perf_counter()
        _naive_decode_bookkeeping(tables, lens, free, c.page_size)
        naive.append(time.perf_counter() - start)
    fast_ms, naive_ms = _median_ms(fast), _median_ms(naive)
    triples = c.num_layers * c.num_requests * c.num_kv_heads
    print()
    print(
        f"decode-step bookkeeping ({c.num_requests} requests x {c.num_layers} layers x {c.num_kv_heads} KV heads "
        f"= {triples} (layer, request, head) appends per step), median over steps"
    )
    per_1k = lambda ms: f"{1000 * ms / triples * 1000:.2f}"  # noqa: E731
    print(
        format_table(
            ["implementation", "ms / step", "us / 1k appends", "vs naive"],
            [
                ["vectorised cache", f"{fast_ms:.3f}", per_1k(fast_ms), f"{naive_ms / fast_ms:.1f}x"],
                ["naive per-head loop", f"{naive_ms:.3f}", per_1k(naive_ms), "1.0x"],
            ],
        )
    )
    return fast_ms, naive_ms


def _time_compaction(cache: PagedKVCache, rows: torch.Tensor, c: CacheBenchConfig) -> float:
    """Tokens examined per second applying a different random keep mask per (layer, head) at `keep_ratio`."""
    compaction: list[float] = []
    examined = moved_pages = 0
    for row_id in range(c.num_requests):
        n = int(cache.seq_lens[0, int(rows[row_id]), 0])
        mask = torch.rand(c.num_layers, c.num_kv_heads, n) < c.keep_ratio
        plan = KeepPlan.from_mask(mask)
        start = time.perf_counter()
        moved_pages += cache.apply_keep_plan(row_id, plan)
        compaction.append(time.perf_counter() - start)
        examined += c.num_layers * c.num_kv_heads * n
    total_s = sum(compaction)
    kept = int(cache.seq_lens.sum())
    print()
    print(f"compaction (keep plans at ratio {c.keep_ratio}, per-head random masks), {c.num_requests} requests")
    print(
        format_table(
            ["metric", "value"],
            [
                ["tokens examined / s", f"{examined / total_s:,.0f}"],
                ["tokens kept / s", f"{kept / total_s:,.0f}"],
                ["ms per request (median)", f"{_median_ms(compaction):.2f}"],
                ["pages freed", f"{moved_pages:,}"],
                ["pool used after", f"{cache.pool.num_used:,} / {cache.pool.num_pages:,} pages"],
            ],
        )
    )
    return examined / total_s


def _time_eviction(cache: PagedKVCache, rows: torch.Tensor, c: CacheBenchConfig) -> float:
    """Median ms of a decode-time eviction of one entry per (layer, request, head), H2O style."""
    evict_times: list[float] = []
    for _ in range(8):
        lens_now = cache.seq_lens[:, rows].to(torch.int64)
        victim = (torch.rand(lens_now.shape) * lens_now).to(torch.int64)
        l_idx, b_idx, h_idx = torch.meshgrid(
            torch.arange(c.num_layers), torch.arange(c.num_requests), torch.arange(c.num_kv_heads), indexing="ij"
        )
        start = time.perf_counter()
        cache.evict(rows[b_idx].flatten(), l_idx.flatten(), h_idx.flatten(), victim.flatten())
        evict_times.append(time.perf_counter() - start)
    print()
    print(
        format_table(
            ["decode eviction (1 entry per (layer, request, head))", "ms / step"],
            [["vectorised cache", f"{_median_ms(evict_times):.3f}"]],
        )
    )
    return _median_ms(evict_times)
