"""Reference attention over the ragged paged cache equals dense masked SDPA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vllm_kvpress_ext.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    varlen_causal_attention,
)
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache


def _dense_reference(
    query: torch.Tensor, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]], scale: float
) -> torch.Tensor:
    """Per (request, KV head): SDPA of the group's query heads over that head's own keys, padded and masked."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = len(keys[0])
    group = num_q_heads // num_kv_heads
    max_len = max(k.shape[0] for row in keys for k in row)
    out = torch.empty_like(query)
    for b in range(batch):
        for h in range(num_kv_heads):
            n = keys[b][h].shape[0]
            k = torch.zeros(max_len, head_dim)
            v = torch.zeros(max_len, head_dim)
            k[:n], v[:n] = keys[b][h], values[b][h]
            mask = (torch.arange(max_len) < n).view(1, 1, max_len)
            q = query[b, h * group : (h + 1) * group].unsqueeze(1)  # [G, 1, d]
            o = F.scaled_dot_product_attention(
                q, k.expand(group, -1, -1), v.expand(group, -1, -1), attn_mask=mask, scale=scale
            )
            out[b, h * group : (h + 1) * group] = o[:, 0]
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_attention_matches_dense_sdpa(head_dim: int, group: int) -> None:
    torch.manual_seed(group * 1000 + head_dim)
    layers, kv_heads, page_size, requests = 2, 2, 16, 3
    cache = PagedKVCache(
        layers, kv_heads, head_dim, num_pages=256, page_size=page_size, max_requests=4, dtype=torch.float32
    )
    kept_k: dict[tuple[int, int, int], torch.Tensor] = {}
    kept_v: dict[tuple[int, int, int], torch.Tensor] = {}
    rows = []
    for r in range(requests):
        rid = f"req{r}"
        row = cache.add_request(rid)
        rows.append(row)
        n = int(torch.randint(20, 90, ()))
        slots = cache.append_slots([row], torch.arange(n).view(1, -1))
        k = torch.randn(*slots.shape, head_dim)
        v = torch.randn(*slots.shape, head_dim)
        cache.write(slots, k, v)
        # A different random subset per head gives ragged lengths (some heads keep a single entry).
        mask = torch.rand(layers, kv_heads, n) < torch.rand(layers, kv_heads, 1)
        mask[..., 0] = True
        cache.apply_keep_plan(rid, KeepPlan.from_mask(mask))
        for layer in range(layers):
            for h in range(kv_heads):
                kept_k[r, layer, h] = k[layer, 0, h][mask[layer, h]]
                kept_v[r, layer, h] = v[layer, 0, h][mask[layer, h]]
    assert len({int(x) for x in cache.seq_lens[0, rows].flatten()}) > 1, "lengths should be ragged"
    scale = head_dim**-0.5
    order = [2, 0, 1]  # batch order differs from row order
    for layer in range(layers):
        query = torch.randn(len(order), kv_heads * group, head_dim)
        out = paged_decode_attention(
            query,
            cache.pool.kv,
            cache.pool.positions,
            cache.block_tables[layer],
            cache.seq_lens[layer],
            torch.tensor([rows[r] for r in order]),
            scale,
        )
        expected = _dense_reference(
            query,
            [[kept_k[r, layer, h] for h in range(kv_heads)] for r in order],
            [[kept_v[r, layer, h] for h in range(kv_heads)] for r in order],
            scale,
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _gated_row(
    head_dim: int, page_size: int, n: int, window: int
) -> tuple[PagedKVCache, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer, two-KV-head cache whose row "r" holds `n` random entries, about 40 % of them admitted to the
    global region and the last `window` in the local ring (WG-KV's layout after a prompt)."""
    cache = PagedKVCache(1, 2, head_dim, num_pages=64, page_size=page_size, max_requests=2, dtype=torch.float32)
    row = cache.add_request("r")
    slots = cache.append_slots([row], torch.arange(n).view(1, -1))
    k, v = torch.randn(*slots.shape, head_dim), torch.randn(*slots.shape, head_dim)
    cache.write(slots, k, v)
    admitted = torch.rand(1, 2, n) < 0.4
    cache.start_ring("r", window, admitted)
    return cache, row, k, v, admitted


def test_decode_attention_reads_ring_and_global() -> None:
    torch.manual_seed(1)
    head_dim, group, window, n = 32, 2, 16, 40
    cache, row, k, v, admitted = _gated_row(head_dim, 8, n, window)
    query = torch.randn(1, 2 * group, head_dim)
    out = paged_decode_attention(
        query,
        cache.pool.kv,
        cache.pool.positions,
        cache.block_tables[0],
        cache.seq_lens[0],
        torch.tensor([row]),
        head_dim**-0.5,
        cache.rings.tables[0],
        cache.rings.lens(),
    )
    keep = admitted[0].clone()
    keep[:, n - window :] = True
    expected = _dense_reference(
        query, [[k[0, 0, h][keep[h]] for h in range(2)]], [[v[0, 0, h][keep[h]] for h in range(2)]], head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_matches_causal_sdpa(group: int) -> None:
    torch.manual_seed(2)
    head_dim, kv_heads, n, chunk = 64, 2, 45, 17
    cache = PagedKVCache(1, kv_heads, head_dim, num_pages=64, page_size=16, max_requests=1, dtype=torch.float32)
    row = cache.add_request("r")
    q = torch.randn(n, kv_heads * group, head_dim)
    k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
    outs = []
    for start in range(0, n, chunk):  # chunked prefill: each chunk attends to the cached prefix
        end = min(n, start + chunk)
        slots = cache.append_slots([row], torch.arange(start, end).view(1, -1))
        cache.write(slots[0, 0].T, k[start:end], v[start:end])
        outs.append(
            paged_prefill_attention(
                q[start:end],
                torch.arange(start, end),
                cache.pool.kv,
                cache.pool.positions,
                cache.block_tables[0, row],
                cache.seq_lens[0, row],
                head_dim**-0.5,
            )
        )
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-5, rtol=1e-5)
    packed = varlen_causal_attention(
        torch.cat([q, q[:10]]), torch.cat([k, k[:10]]), torch.cat([v, v[:10]]), [0, n, n + 10], head_dim**-0.5
    )
    torch.testing.assert_close(packed[:n], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[n:], expected[:10], atol=1e-5, rtol=1e-5)


def test_decode_attention_buckets_by_length_like_one_dense_batch() -> None:
    """A batch mixing a long request with short ones (and an empty head) runs in length buckets: outputs
    match one batch padded to the longest, and so do the probabilities over the global entries (shorter
    padding may change the last bits of a softmax sum, nothing more)."""
    from vllm_kvpress_ext.attention.reference import _dense_decode, length_buckets

    torch.manual_seed(3)
    head_dim, group, page_size, kv_heads = 16, 3, 4, 2
    cache = PagedKVCache(1, kv_heads, head_dim, num_pages=512, page_size=page_size, max_requests=8)
    rows = []
    for r, n in enumerate([300, 5, 40, 33, 150, 2, 64]):
        row = cache.add_request(f"r{r}")
        slots = cache.append_slots([row], torch.arange(n).view(1, -1))
        cache.write(slots, torch.randn(*slots.shape, head_dim), torch.randn(*slots.shape, head_dim))
        rows.append(row)
    cache.apply_keep_plan("r3", KeepPlan.from_mask(torch.arange(33).view(1, 1, -1) < torch.tensor([[[0], [33]]])))
    batch = torch.tensor(rows[::-1])
    lengths = cache.seq_lens[0][batch].amax(-1)
    assert len(length_buckets(lengths, page_size)) > 2
    assert sorted(torch.cat(length_buckets(lengths, page_size)).tolist()) == list(range(len(rows)))
    query = torch.randn(len(rows), kv_heads * group, head_dim)
    args = (query, cache.pool.kv, cache.pool.positions, cache.block_tables[0], cache.seq_lens[0], batch, 0.25)
    probs: list[torch.Tensor] = []
    dense_probs: list[torch.Tensor] = []
    out = paged_decode_attention(*args, probs_out=probs)
    dense = _dense_decode(*args, None, None, dense_probs)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)
    assert probs[0].shape == dense_probs[0].shape
    torch.testing.assert_close(probs[0], dense_probs[0], atol=1e-7, rtol=1e-6)
    assert torch.equal(out[rows[::-1].index(rows[3])][:group], torch.zeros(group, head_dim))  # the empty head


def test_length_buckets_single_and_empty_batches() -> None:
    from vllm_kvpress_ext.attention.reference import length_buckets

    assert [b.tolist() for b in length_buckets(torch.tensor([], dtype=torch.int64), 16)] == [[]]
    assert [b.tolist() for b in length_buckets(torch.tensor([0]), 16)] == [[0]]
    assert [b.tolist() for b in length_buckets(torch.tensor([17, 20, 31]), 16)] == [[0, 1, 2]]
    assert [b.tolist() for b in length_buckets(torch.tensor([16, 64, 0, 1000]), 16)] == [[0, 2], [1], [3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lse", [False, True])
def test_fused_prefill_attention_matches_the_einsum_oracle_on_ragged_compacted_heads(
    dtype: torch.dtype, with_lse: bool
) -> None:
    """The fused path the engine runs equals the oracle where the cache is not a plain prefix: heads of
    different lengths, entries out of position order with gaps (as after compaction), and cached entries
    whose positions lie past some queries (they must stay hidden from those queries)."""
    torch.manual_seed(5)
    kv_heads, group, head_dim, page_size, pages = 3, 3, 64, 16, 6
    kv_pool = torch.randn(kv_heads * pages, 2, page_size, head_dim).to(dtype)
    position_pool = torch.zeros(kv_heads * pages, page_size, dtype=torch.int32)
    tables = torch.arange(kv_heads * pages).view(kv_heads, pages)
    lens = torch.tensor([90, 61, 77])
    for h in range(kv_heads):
        held = torch.randperm(140)[: int(lens[h])].sort().values  # gaps: dropped positions
        held = held[torch.randperm(held.numel())]  # storage order is not position order
        flat = position_pool[tables[h]].view(-1)
        flat[: held.numel()] = held.to(torch.int32)
        position_pool[tables[h]] = flat.view(pages, page_size)
    n = 24
    query_positions = torch.arange(120, 120 + n) - 20  # some cached positions lie in the queries' future
    query = torch.randn(n, kv_heads * group, head_dim).to(dtype)
    lse_oracle: list[torch.Tensor] | None = [] if with_lse else None
    lse_fused: list[torch.Tensor] | None = [] if with_lse else None
    expected = reference.paged_prefill_attention(
        query, query_positions, kv_pool, position_pool, tables, lens, 0.125, lse_out=lse_oracle
    )
    out = paged_prefill_attention(
        query, query_positions, kv_pool, position_pool, tables, lens, 0.125, lse_out=lse_fused
    )
    assert out.dtype == dtype and out.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if lse_oracle is not None and lse_fused is not None:
        assert lse_fused[0].shape == (n, kv_heads * group)
        torch.testing.assert_close(lse_fused[0], lse_oracle[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lse", [False, True])
def test_chunk_over_a_plain_prefix_splits_into_prefix_and_causal_parts(
    dtype: torch.dtype, with_lse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later prefill chunk over an uncompressed prefix (every head the same entries, the chunk's own last)
    takes the split path: the prefix unmasked and the chunk causal, merged by log-sum-exp. It equals the
    einsum oracle; a cache that is not such a prefix (a head shorter, a future position) does not take it."""
    calls = []
    split = reference._prefix_then_causal_chunk
    monkeypatch.setattr(reference, "_prefix_then_causal_chunk", lambda *a: calls.append(1) or split(*a))
    torch.manual_seed(7)
    kv_heads, group, head_dim, page_size = 3, 3, 64, 16
    cache = PagedKVCache(1, kv_heads, head_dim, num_pages=128, page_size=page_size, max_requests=1, dtype=dtype)
    row = cache.add_request("r")
    n_total, start = 150, 107  # the chunk is positions 107..149, its prefix 0..106
    slots = cache.append_slots([row], torch.arange(n_total).view(1, -1))
    cache.write(slots[0, 0].T, *(torch.randn(n_total, kv_heads, head_dim).to(dtype) for _ in range(2)))
    query = torch.randn(n_total - start, kv_heads * group, head_dim).to(dtype)
    args = (query, torch.arange(start, n_total), cache.pool.kv, cache.pool.positions)
    tables, lens = cache.block_tables[0, row], cache.seq_lens[0, row]
    lse_oracle: list[torch.Tensor] | None = [] if with_lse else None
    lse_split: list[torch.Tensor] | None = [] if with_lse else None
    expected = reference.paged_prefill_attention(*args, tables, lens, 0.125, lse_out=lse_oracle)
    out = reference.paged_prefill_attention_sdpa(*args, tables, lens, 0.125, lse_out=lse_split)
    assert calls == [1]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if lse_oracle is not None and lse_split is not None:
        torch.testing.assert_close(lse_split[0], lse_oracle[0], atol=1e-4, rtol=1e-4)
    # The first chunk (no prefix) is the causal part alone.
    first = reference.paged_prefill_attention_sdpa(
        query[:5], torch.arange(5), cache.pool.kv, cache.pool.positions, tables, torch.full_like(lens, 5), 0.125
    )
    oracle = reference.paged_prefill_attention(
        query[:5], torch.arange(5), cache.pool.kv, cache.pool.positions, tables, torch.full_like(lens, 5), 0.125
    )
    torch.testing.assert_close(first, oracle, atol=tol, rtol=tol)
    assert calls == [1, 1]
    # Not a plain prefix: one head shorter, or the queries placed before some cached entries.
    ragged = lens.clone()
    ragged[1] -= 3
    reference.paged_prefill_attention_sdpa(*args, tables, ragged, 0.125)
    reference.paged_prefill_attention_sdpa(query, torch.arange(start, n_total) - 5, *args[2:], tables, lens, 0.125)
    assert calls == [1, 1]


def _dense_window_reference(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Every query over the whole sequence's keys `[m, Hkv, d]` (position = index) under HF's window mask, in
    float64, the soft cap written out."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, m, d]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    logits = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, n, m]
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    distance = query_positions.view(-1, 1) - torch.arange(keys.shape[0]).view(1, -1)
    allowed = (distance >= 0) & (distance < window)
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1).float()


@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize(("start", "count"), [(0, 12), (5, 3), (5, 12), (19, 1), (19, 30)])
def test_a_chunk_over_its_ring_equals_dense_windowed_attention(start: int, count: int, soft_cap: float | None) -> None:
    """A ring of window 8 holding the tokens before `start` (written as the cache writes them), then a chunk
    read against it before being written: HF's sliding-window attention over the whole sequence."""
    window, heads, kv_heads, dim = 8, 4, 2, 16
    generator = torch.Generator().manual_seed(start * 100 + count)
    total = start + count
    keys = torch.randn(total, kv_heads, dim, generator=generator)
    values = torch.randn(total, kv_heads, dim, generator=generator)
    query = torch.randn(count, heads, dim, generator=generator)
    cache = PagedKVCache(1, kv_heads, dim, 64, page_size=4, dtype=torch.float32, layer_windows=[window])
    row = cache.add_request("r")
    for position in range(start):  # one token at a time: the ring wraps as it would during decode
        slots = cache.append_slots([row], torch.tensor([[position]]))[0, 0].transpose(0, 1)  # [1, Hkv]
        cache.write(slots, keys[position : position + 1], values[position : position + 1])
    positions = torch.arange(start, total)
    out = reference.ring_chunk_attention(
        cache.pool.kv,
        cache.pool.positions,
        cache.block_tables[0, row],
        start,
        query,
        positions,
        keys[start:],
        values[start:],
        window,
        0.25,
        soft_cap=soft_cap,
    )
    expected = _dense_window_reference(query, positions, keys, values, window, 0.25, soft_cap)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def _capped_dense(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """Queries `[n, Hq, d]` over keys `[m, Hkv, d]`, key j visible to query i of KV head h where `allowed[h, i, j]`,
    in float64 with the logit soft cap written out."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, m, d]
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    logits = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, n, m]
    logits = soft_cap * torch.tanh(logits / soft_cap)
    weights = logits.masked_fill(~allowed.repeat_interleave(group, 0), float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1).float()


@pytest.mark.parametrize("with_probs", [False, True])
def test_a_soft_capped_decode_reads_ring_and_global_under_the_cap(with_probs: bool) -> None:
    """Gemma 2's cap on a write-gated row (WG-KV): the decode over the admitted global entries and the local ring
    equals dense attention under the cap, and the probabilities a policy reads are the capped ones."""
    torch.manual_seed(2)
    head_dim, group, window, n, cap, scale = 16, 2, 8, 30, 2.0, 0.25
    cache, row, k, v, admitted = _gated_row(head_dim, 4, n, window)
    query = torch.randn(1, 2 * group, head_dim)
    probs: list[torch.Tensor] | None = [] if with_probs else None

    def decode(**capping: Any) -> torch.Tensor:
        tables, lens, rows = cache.block_tables[0], cache.seq_lens[0], torch.tensor([row])
        rings = (cache.rings.tables[0], cache.rings.lens())
        return paged_decode_attention(
            query, cache.pool.kv, cache.pool.positions, tables, lens, rows, scale, *rings, **capping
        )

    out = decode(probs_out=probs, soft_cap=cap)
    visible = admitted[0].clone()
    visible[:, n - window :] = True
    expected = _capped_dense(query, k[0, 0].transpose(0, 1), v[0, 0].transpose(0, 1), visible.unsqueeze(1), scale, cap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(decode(), expected, atol=1e-3)  # the cap matters at this scale
    if probs is not None:  # [1, Hkv, G, global entries]: each admitted entry's capped weight, summing below 1
        (weights,) = probs
        held = int(cache.seq_lens[0, row].max())
        assert weights.shape == (1, 2, group, held) and bool((weights.sum(-1) < 1).all())


@pytest.mark.parametrize("query_start", [0, 300])
def test_soft_capped_vertical_slash_attention_equals_the_dense_mask(query_start: int) -> None:
    """A write-gated prompt (or its later chunk) under Gemma 2's cap, in query blocks: dense attention under the
    capped logits and the vertical-slash mask (the band of `window`, and every admitted key)."""
    generator = torch.Generator().manual_seed(query_start)
    total, window, cap, scale = 600, 32, 2.0, 0.25
    n = total - query_start
    query = torch.randn(n, 4, 16, generator=generator)
    keys, values = torch.randn(total, 2, 16, generator=generator), torch.randn(total, 2, 16, generator=generator)
    admitted = torch.rand(2, total, generator=generator) < 0.3
    out = reference.vertical_slash_attention(query, keys, values, admitted, window, scale, query_start, soft_cap=cap)
    i = torch.arange(query_start, total).view(-1, 1)
    j = torch.arange(total).view(1, -1)
    allowed = (j <= i) & ((i - j < window) | admitted.unsqueeze(1))  # [Hkv, n, total]
    torch.testing.assert_close(out, _capped_dense(query, keys, values, allowed, scale, cap), atol=1e-5, rtol=1e-5)
