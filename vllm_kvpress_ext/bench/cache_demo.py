"""`kvpress demo`: watch the paged per-head cache give memory back.

No model is involved: synthetic requests are written into a pool sized to hold exactly them,
a keep plan with a different budget per (layer, KV head) is applied, and the pool shows the
pages returned -- enough room to admit more requests of the same size.
"""

from __future__ import annotations

import torch

from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache, PoolExhaustedError


def run_demo(num_requests: int = 4, prompt_len: int = 512, keep_ratio: float = 0.25, seed: int = 0) -> None:
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must lie in (0, 1], got {keep_ratio}")
    torch.manual_seed(seed)
    layers, heads, head_dim, page_size = 8, 4, 64, 16
    pages_per_request = layers * heads * -(-prompt_len // page_size)
    cache = PagedKVCache(
        layers,
        heads,
        head_dim,
        num_pages=num_requests * pages_per_request,
        page_size=page_size,
        max_requests=4 * num_requests,
        dtype=torch.float16,
    )
    mib = cache.pool.bytes_per_page * cache.pool.num_pages / 2**20
    print(
        f"pool: {cache.pool.num_pages} pages of {page_size} tokens ({mib:.1f} MiB), "
        f"{layers} layers x {heads} KV heads, head_dim {head_dim}"
    )
    rows: list[list[object]] = []
    for rid in range(num_requests):
        row = cache.add_request(rid)
        slots = cache.append_slots([row], torch.arange(prompt_len).view(1, -1))
        cache.write(slots, torch.randn(*slots.shape, head_dim), torch.randn(*slots.shape, head_dim))
        rows.append([f"request {rid}", prompt_len, cache.usage(rid).pages, f"{cache.usage(rid).bytes / 2**20:.2f}"])
    print(f"\nafter prefill: {cache.pool.num_used} pages used, {cache.pool.num_free} free")
    try:
        cache.append_slots([cache.add_request("extra")], torch.arange(prompt_len).view(1, -1))
    except PoolExhaustedError as err:
        print(f"a new {prompt_len}-token request does not fit: {err}")
        cache.free_request("extra")

    # Each (layer, head) keeps its own share: budgets vary between 0.5x and 1.5x the mean ratio.
    for rid in range(num_requests):
        share = keep_ratio * (0.5 + torch.rand(layers, heads, 1))
        keep = torch.rand(layers, heads, prompt_len) < share.clamp(max=1.0)
        cache.apply_keep_plan(rid, KeepPlan.from_mask(keep))
        usage = cache.usage(rid)
        rows[rid] += [usage.tokens // (layers * heads), usage.pages, f"{usage.bytes / 2**20:.2f}"]
    print(f"\nafter compression (mean keep ratio {keep_ratio}):")
    print(
        format_table(
            ["request", "prompt", "pages before", "MiB before", "tokens/head after", "pages after", "MiB after"], rows
        )
    )
    print(f"\npool: {cache.pool.num_used} pages used, {cache.pool.num_free} free")
    admitted = 0
    while True:
        new_id = f"new{admitted}"
        row = cache.add_request(new_id)
        try:
            cache.append_slots([row], torch.arange(prompt_len).view(1, -1))
        except PoolExhaustedError:
            cache.free_request(new_id)
            break
        admitted += 1
        if admitted >= 3 * num_requests:
            break
    print(f"the freed pages now hold {admitted} more uncompressed {prompt_len}-token requests")
