"""Pure-torch reference attention ops over the ragged per-head paged cache.

These are the correctness oracles for the Triton and CUDA kernels and the CPU execution path.
Each (request, KV head) is its own sequence: a KV head's pages and length are independent of its
neighbours', and the query heads of its GQA group (`Hq / Hkv` of them) are its queries.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F


def gather_paged(
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Densify ragged paged sequences.

    `tables[..., P]` page ids and `lens[...]` lengths for any batch shape `S`; returns
    K, V `[*S, N, d]`, positions `[*S, N]` and a validity mask `[*S, N]` with N = max length.
    """
    page_size = kv_pool.shape[2]
    max_len = int(lens.max()) if lens.numel() else 0
    entry = torch.arange(max_len, device=tables.device)
    valid = entry < lens.unsqueeze(-1).to(tables.device)
    page_slot = torch.div(entry, page_size, rounding_mode="floor").expand(*tables.shape[:-1], max_len)
    pages = torch.where(valid, tables.gather(-1, page_slot.to(torch.int64)), torch.zeros_like(page_slot)).to(
        device=kv_pool.device, dtype=torch.int64
    )
    offsets = (entry % page_size).to(kv_pool.device).expand_as(pages)
    # Gather rows of kv viewed as [pages * 2 * page_size, d]: K of slot (p, o) is row p*2*ps + o, V is ps further.
    rows = (pages * (2 * page_size) + offsets).reshape(-1)
    flat = kv_pool.view(-1, kv_pool.shape[-1])
    shape = (*pages.shape, kv_pool.shape[-1])
    # index_select copies whole rows; advanced indexing (`flat[rows]`) gives the same tensor, slower on a CPU.
    keys = torch.index_select(flat, 0, rows).view(shape)
    values = torch.index_select(flat, 0, rows + page_size).view(shape)
    slots = (pages * page_size + offsets).reshape(-1)
    positions = torch.index_select(position_pool.view(-1), 0, slots).view(pages.shape)
    return keys, values, positions, valid.to(kv_pool.device)


def _grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    probs_out: list[torch.Tensor] | None = None,
    lse_out: list[torch.Tensor] | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`query[B, Hkv, G, Q, d]` against `keys/values[B, Hkv, N, d]` under `mask[B, Hkv, G or 1, Q, N]`, the
    logits under `soft_cap` where there is one (`soft_capped`)."""
    scores = soft_capped(torch.einsum("bhgqd,bhnd->bhgqn", query.float(), keys.float()) * scale, soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if lse_out is not None:
        lse_out.append(torch.logsumexp(scores, dim=-1))  # [B, Hkv, G, Q]
    probs = torch.softmax(scores, dim=-1)
    # A query with nothing to attend to (empty head) yields zeros rather than NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    if probs_out is not None:
        probs_out.append(probs)
    return torch.einsum("bhgqn,bhnd->bhgqd", probs, values.float())


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
    """One decode query per request over the ragged paged cache of one layer.

    query `[B, Hq, d]`; `block_tables[R, Hkv, P]`, `seq_lens[R, Hkv]` for the layer; `rows[B]`
    selects each query's cache row. With `ring_tables[R, Hkv, Pr]` and `ring_lens[R]`, the local
    ring is attended to as a second segment. Returns `[B, Hq, d]` in the query's dtype.
    If `probs_out` is a list, the attention probabilities `[B, Hkv, G, N]` over the global
    entries (in storage order, N = longest head) are appended to it, for policies that score
    entries by the attention they receive. With `soft_cap` (Gemma 2) the logits are capped first.

    Requests are densified in buckets of similar length (`length_buckets`), so a batch that mixes a
    full cache with compressed ones does not pad every request to the longest: the dense work is
    about the entries held rather than batch size x longest request.
    """
    batch, num_q_heads = query.shape[:2]
    rows = rows.to(block_tables.device, torch.int64)
    num_kv_heads = block_tables.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    has_ring = ring_tables is not None and ring_lens is not None and ring_tables.shape[-1] > 0
    lengths = seq_lens[rows].amax(-1).to(torch.int64) if batch else torch.zeros(0, dtype=torch.int64)
    if has_ring:
        assert ring_lens is not None
        lengths = lengths + ring_lens.to(lengths.device, torch.int64)[rows.to(ring_lens.device)].to(lengths.device)
    buckets = length_buckets(lengths, kv_pool.shape[2])
    if len(buckets) <= 1:
        return _dense_decode(
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
    out = torch.empty_like(query)
    probs = None
    if probs_out is not None:
        global_len = int(seq_lens[rows].max())
        group = num_q_heads // num_kv_heads
        probs = torch.zeros(batch, num_kv_heads, group, global_len, device=query.device)
    for index in buckets:
        part: list[torch.Tensor] | None = [] if probs is not None else None
        device_index = index.to(query.device)
        out[device_index] = _dense_decode(
            query[device_index],
            kv_pool,
            position_pool,
            block_tables,
            seq_lens,
            rows[index.to(rows.device)],
            scale,
            ring_tables,
            ring_lens,
            part,
            soft_cap,
        )
        if probs is not None and part:
            probs[device_index, ..., : part[0].shape[-1]] = part[0].to(probs.dtype)
    if probs_out is not None and probs is not None:
        probs_out.append(probs)
    return out


def length_buckets(lengths: torch.Tensor, page_size: int) -> list[torch.Tensor]:
    """Batch indices grouped by length class: requests of [2^k, 2^(k+1)) pages share one dense block.

    Padding each request only to its bucket's longest wastes less than half of a bucket's work,
    while the number of buckets (each a few tensor ops) stays logarithmic in the longest request.
    """
    if lengths.numel() <= 1:
        return [torch.arange(lengths.numel())]
    pages = torch.div(lengths.cpu() + page_size - 1, page_size, rounding_mode="floor").clamp_min(1)
    classes = torch.floor(torch.log2(pages.double())).to(torch.int64)
    distinct = torch.unique(classes)
    if distinct.numel() == 1:
        return [torch.arange(lengths.numel())]
    return [torch.nonzero(classes == c).view(-1) for c in distinct.tolist()]


def _dense_decode(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    ring_tables: torch.Tensor | None,
    ring_lens: torch.Tensor | None,
    probs_out: list[torch.Tensor] | None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention of requests densified together (padded to the longest of them)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = block_tables.shape[1]
    keys, values, _, valid = gather_paged(kv_pool, position_pool, block_tables[rows], seq_lens[rows])
    if ring_tables is not None and ring_lens is not None and ring_tables.shape[-1] > 0:
        ring_len = ring_lens.to(ring_tables.device)[rows].view(-1, 1).expand(batch, num_kv_heads)
        ring_k, ring_v, _, ring_valid = gather_paged(kv_pool, position_pool, ring_tables[rows], ring_len)
        keys, values = torch.cat([keys, ring_k], dim=2), torch.cat([values, ring_v], dim=2)
        valid = torch.cat([valid, ring_valid], dim=2)
    group = num_q_heads // num_kv_heads
    if probs_out is None and soft_cap is None:
        # Fused SDPA, one batch entry per (request, KV head) with its G query heads: the einsum path below
        # makes three fp32 passes over the scores and is kept for the probabilities a policy reads, and for a
        # soft cap, which SDPA does not apply.
        n = keys.shape[2]
        fused = F.scaled_dot_product_attention(
            query.float().view(batch * num_kv_heads, group, 1, head_dim),
            keys.float().reshape(batch * num_kv_heads, 1, n, head_dim).expand(-1, group, -1, -1),
            values.float().reshape(batch * num_kv_heads, 1, n, head_dim).expand(-1, group, -1, -1),
            attn_mask=valid.reshape(batch * num_kv_heads, 1, 1, n),
            scale=scale,
        )
        # A head with nothing to attend to yields zeros, as in the einsum path, not NaN.
        return torch.nan_to_num(fused, nan=0.0).view(batch, num_q_heads, head_dim).to(query.dtype)
    q = query.view(batch, num_kv_heads, group, 1, head_dim)
    mask = valid.view(batch, num_kv_heads, 1, 1, -1)
    out = _grouped_attention(q, keys, values, mask, scale, probs_out, soft_cap=soft_cap)
    if probs_out is not None:
        global_len = int(seq_lens[rows].max()) if rows.numel() else 0
        probs_out[-1] = probs_out[-1][..., 0, :global_len]
    return out.view(batch, num_q_heads, head_dim).to(query.dtype)


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
    """Causal attention of one request's new tokens over everything cached for it (chunked prefill).

    query `[n, Hq, d]` at `query_positions[n]`; `block_table[Hkv, P]`, `seq_len[Hkv]` for the
    request in one layer, already holding the new tokens. Causality uses the stored positions,
    so it stays right after compaction reorders or drops entries. With `lse_out`, each query's
    log-sum-exp `[n, Hq]` (float32) is appended to it.
    """
    n, num_q_heads, head_dim = query.shape
    num_kv_heads = block_table.shape[0]
    keys, values, positions, valid = gather_paged(kv_pool, position_pool, block_table, seq_len)
    group = num_q_heads // num_kv_heads
    q = query.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)  # [1, Hkv, G, n, d]
    causal = positions.unsqueeze(-2) <= query_positions.to(positions.device).view(1, n, 1)  # [Hkv, n, N]
    mask = (causal & valid.unsqueeze(-2)).view(1, num_kv_heads, 1, n, -1)
    out = _grouped_attention(q, keys.unsqueeze(0), values.unsqueeze(0), mask, scale, lse_out=lse_out)
    if lse_out is not None:
        lse_out[-1] = lse_out[-1][0].permute(2, 0, 1).reshape(n, num_q_heads)  # [1, Hkv, G, n] -> [n, Hq]
    return out[0].permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)


def paged_prefill_attention_sdpa(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float,
    lse_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention` through torch's fused SDPA: same inputs, same mask, same result to rounding.

    The einsum oracle above materialises every score of the chunk against the whole prefix in fp32
    (three passes over `n x N x Hq` floats); at 1,552 queries over 3,600 cached tokens that is about
    three times slower on a CPU than torch's flash attention, which streams the scores block by block.
    Each KV head is one SDPA batch entry whose `G` query heads share its keys, and the mask (stored
    positions up to the query's, valid entries only) is the oracle's, so compacted or ragged heads work
    the same. With `lse_out`, the log-sum-exps come from the CPU flash kernel (free there); elsewhere
    this falls back to the oracle for them.
    """
    n, num_q_heads, head_dim = query.shape
    num_kv_heads = block_table.shape[0]
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if lse_out is not None and (flash is None or query.device.type != "cpu"):
        return paged_prefill_attention(
            query, query_positions, kv_pool, position_pool, block_table, seq_len, scale, lse_out
        )
    keys, values, positions, valid = gather_paged(kv_pool, position_pool, block_table, seq_len)
    group = num_q_heads // num_kv_heads
    # fp32 math, as in the oracle, whatever the pool's dtype.
    q = query.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, d]
    if flash is not None and query.device.type == "cpu" and _chunk_after_its_prefix(query_positions, positions, valid):
        out, lse = _prefix_then_causal_chunk(flash, q, keys.float(), values.float(), scale)
        if lse_out is not None:
            lse_out.append(lse.permute(2, 0, 1).reshape(n, num_q_heads))
        return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)
    keys = keys.float().unsqueeze(1).expand(num_kv_heads, group, -1, head_dim)  # [Hkv, G, N, d], no copy
    values = values.float().unsqueeze(1).expand(num_kv_heads, group, -1, head_dim)
    visible = positions.unsqueeze(-2) <= query_positions.to(positions.device).view(1, n, 1)  # [Hkv, n, N]
    mask = (visible & valid.unsqueeze(-2)).unsqueeze(1)  # [Hkv, 1, n, N]
    if lse_out is not None:
        assert flash is not None
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
        out, lse = flash(q, keys, values, 0.0, False, attn_mask=bias, scale=scale)[:2]
        lse_out.append(lse.float().permute(2, 0, 1).reshape(n, num_q_heads))  # [Hkv, G, n] -> [n, Hq]
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)


def _chunk_after_its_prefix(query_positions: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> bool:
    """True when every head holds the same entries count, ending with the chunk's own n entries in query
    order, after entries that all lie before the chunk: then each query sees the whole prefix and the chunk
    causally, and the attention splits into those two unmasked parts (`_prefix_then_causal_chunk`)."""
    n = query_positions.shape[0]
    if not bool(valid.all()) or positions.shape[-1] < n:
        return False
    query_positions = query_positions.to(positions.device)
    own = positions[:, positions.shape[-1] - n :]
    prefix = positions[:, : positions.shape[-1] - n]
    in_order = bool((own == query_positions.view(1, -1)).all())
    return in_order and (prefix.numel() == 0 or int(prefix.max()) < int(query_positions.min()))


def _prefix_then_causal_chunk(
    flash: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk's queries `q[Hkv, G, n, d]` over keys `[Hkv, N, d]` whose last n are the chunk's
    own: the prefix without a mask, the chunk causally (both through the CPU flash kernel, which skips the
    masked-out half of a causal block instead of computing and discarding it), merged by their log-sum-exps.

    Returns the output `[Hkv, G, n, d]` and its log-sum-exp `[Hkv, G, n]` (fp32), equal to the masked
    SDPA's to rounding: softmax over the union = the two partial softmaxes weighted by exp(lse_part - lse).
    """
    heads, group, n, head_dim = q.shape
    split = keys.shape[1] - n

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).expand(heads, group, x.shape[1], head_dim)  # no copy

    chunk_out, chunk_lse = flash(q, grouped(keys[:, split:]), grouped(values[:, split:]), 0.0, True, scale=scale)[:2]
    if split == 0:
        return chunk_out, chunk_lse.float()
    prefix_out, prefix_lse = flash(q, grouped(keys[:, :split]), grouped(values[:, :split]), 0.0, False, scale=scale)[:2]
    lse = torch.logaddexp(prefix_lse.float(), chunk_lse.float())
    prefix_weight = (prefix_lse - lse).exp().unsqueeze(-1)
    chunk_weight = (chunk_lse - lse).exp().unsqueeze(-1)
    return prefix_out * prefix_weight + chunk_out * chunk_weight, lse


def varlen_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal self-attention over sequences packed back to back (`cu_seqlens` = [0, n0, n0+n1, ...]).

    query `[T, Hq, d]`, keys/values `[T, Hkv, d]`; returns `[T, Hq, d]`.
    """
    total, num_q_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {cu_seqlens}")
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for start, end in itertools.pairwise(cu_seqlens):
        n = end - start
        q = query[start:end].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)
        k = keys[start:end].transpose(0, 1).unsqueeze(0)
        v = values[start:end].transpose(0, 1).unsqueeze(0)
        causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        o = _grouped_attention(q, k, v, causal.view(1, 1, 1, n, n), scale)
        out[start:end] = o[0].permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)
    return out


def causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal self-attention of B equal-length fresh sequences, no cache involved.

    query `[B, n, Hq, d]`, keys/values `[B, n, Hkv, d]` -> `[B, n, Hq, d]`. The inputs reach SDPA 4-D:
    torch's fused CPU / GPU kernels need the batch dimension, and without it the math path
    materialises the whole n x n score matrix (4 s instead of 0.3 s at 8K tokens on a CPU). With `window`
    (a sliding-window layer, for training) a query at i reads the keys at i - window < j <= i only.
    """
    n = query.shape[1]
    mask = None
    if window is not None and window < n:
        distance = torch.arange(n, device=query.device).view(n, 1) - torch.arange(n, device=query.device)
        mask = (distance >= 0) & (distance < window)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def sliding_window_attention(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    window: int,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention within a sliding window: the query at position p reads the keys at p - window < k <= p.

    query `[n, Hq, d]` at ascending `query_positions[n]`; keys/values `[m, Hkv, d]` at distinct
    `key_positions[m]` in any order (a ring's and a chunk's together). This is HF transformers' window
    (a key is seen while the distance is below `window`). Queries go in blocks of about a window, each
    against the keys its block can reach only, so the work is O(n * window), not O(n * m). With
    `soft_cap` (Gemma 2) the scores are `soft_cap * tanh(score / soft_cap)` before the softmax.
    """
    n = query.shape[0]
    out = torch.empty_like(query)
    block = max(256, window)
    key_positions = key_positions.to(torch.int64)
    query_positions = query_positions.to(device=key_positions.device, dtype=torch.int64)
    for first in range(0, n, block):
        last = min(n, first + block)
        q_pos = query_positions[first:last]
        lowest, highest = int(q_pos[0]) - window, int(q_pos[-1])
        reach = ((key_positions > lowest) & (key_positions <= highest)).nonzero().reshape(-1)
        k_pos = key_positions[reach]
        distance = q_pos.view(-1, 1) - k_pos.view(1, -1)
        mask = (distance >= 0) & (distance < window)
        block_queries = query[first:last].transpose(0, 1)  # [Hq, b, d]
        block_keys, block_values = keys[reach].transpose(0, 1), values[reach].transpose(0, 1)  # [Hkv, r, d]
        if soft_cap is None:
            attended = F.scaled_dot_product_attention(
                block_queries.unsqueeze(0),
                block_keys.unsqueeze(0),
                block_values.unsqueeze(0),
                attn_mask=mask.view(1, 1, *mask.shape),
                scale=scale,
                enable_gqa=True,
            )[0]
        else:
            group = query.shape[1] // keys.shape[1]
            block_keys = block_keys.repeat_interleave(group, 0)
            block_values = block_values.repeat_interleave(group, 0)
            scores = soft_capped(torch.matmul(block_queries, block_keys.transpose(-1, -2)).float() * scale, soft_cap)
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            attended = torch.matmul(weights.to(block_values.dtype), block_values)
        out[first:last] = attended.transpose(0, 1)
    return out


def ring_chunk_attention(
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    ring_table: torch.Tensor,
    start: int,
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """A sliding-window layer's prompt chunk at positions `start`.. over its ring and its own keys.

    The ring (`ring_table [Hkv, P]`, a row's pages in one layer) holds entry e = the latest position before
    `start` that is e modulo `window`; it is read here, so call this before the chunk is written into the ring
    (the chunk's tokens overwrite entries its own first queries still see). The ring's positions are worked
    out, not read: the chunk's slots already carry its own. query `[n, Hq, d]`, keys/values `[n, Hkv, d]`.
    """
    all_keys, all_values, key_positions = keys, values, query_positions
    if start > 0:
        held = min(start, window)
        lens = torch.full(ring_table.shape[:1], held, dtype=torch.int32, device=ring_table.device)
        ring_keys, ring_values, _, _ = gather_paged(kv_pool, position_pool, ring_table, lens)
        entry = torch.arange(held, device=query_positions.device)
        ring_positions = start - 1 - (start - 1 - entry) % window
        all_keys = torch.cat([ring_keys.transpose(0, 1).to(keys.dtype), keys])
        all_values = torch.cat([ring_values.transpose(0, 1).to(values.dtype), values])
        key_positions = torch.cat([ring_positions.to(query_positions.dtype), query_positions])
    return sliding_window_attention(
        query, query_positions, all_keys, all_values, key_positions, window, scale, soft_cap=soft_cap
    )


def causal_attention_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`causal_attention` plus each query's log-sum-exp `[B, n, Hq]` (natural log, float32) where it is free.

    On a CPU, torch's flash attention (`aten._scaled_dot_product_flash_attention_for_cpu`, the kernel
    SDPA itself dispatches to there) returns it beside the output at no extra cost; H2O's column
    sums need it (`policies/h2o.py`). Elsewhere, or if that op is missing, the log-sum-exp is None.
    """
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or query.device.type != "cpu":
        return causal_attention(query, keys, values, scale), None
    out, lse = flash(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), 0.0, True, scale=scale)[:2]
    return out.transpose(1, 2), lse.float().transpose(1, 2)


def check_vertical_slash_arguments(
    query: torch.Tensor, keys: torch.Tensor, admitted: torch.Tensor, window: int, query_start: int
) -> None:
    """The shapes every vertical-slash attention (this one, `block_sparse.py`'s) accepts, or a ValueError."""
    n, total, num_kv_heads = query.shape[0], keys.shape[0], keys.shape[1]
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if total != query_start + n:
        raise ValueError(f"keys must cover positions 0..{query_start + n - 1}, got {total} of them")
    if admitted.shape != (num_kv_heads, total):
        raise ValueError(f"admitted must be [{num_kv_heads}, {total}], got {list(admitted.shape)}")


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
    """Causal prefill attention under the write-gate's vertical-slash mask, one sequence.

    query `[n, Hq, d]` at positions `query_start + i`; keys/values `[N, Hkv, d]` at positions 0..N-1
    (N = query_start + n: a prefill chunk attends to the uncompressed prompt so far); `admitted[Hkv, N]`
    bool. Query at position i sees key j of its KV head iff `j <= i` and (`i - j < window` -- the
    slash: the local band every token keeps -- or `admitted[h, j]` -- the verticals: columns the gate
    wrote to the global cache). The diagonal is inside the band for any `window >= 1`, so no row is
    empty. With `soft_cap` (Gemma 2) the logits are capped before the mask, in query blocks of 256. Returns
    `[n, Hq, d]`.
    """
    check_vertical_slash_arguments(query, keys, admitted, window, query_start)
    n, num_q_heads, head_dim = query.shape
    total, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_q_heads // num_kv_heads
    i = torch.arange(query_start, total, device=query.device).view(n, 1)
    j = torch.arange(total, device=query.device).view(1, total)
    causal = j <= i  # [n, N]
    band = causal & (i - j < window)
    mask = band.unsqueeze(0) | (causal.unsqueeze(0) & admitted.to(query.device, torch.bool).unsqueeze(1))
    # One SDPA call with the KV heads as its batch and each head's group as its heads: torch's fused
    # kernel never holds the [Hkv, G, n, N] scores (the einsum form held them in float32 several times
    # over, 8x the causal prefill's CPU time on SmolLM2 at 2K). float32 throughout, as before.
    q = query.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).float()  # [Hkv, G, n, d]
    k = keys.transpose(0, 1).unsqueeze(1).float()  # [Hkv, 1, N, d]
    v = values.transpose(0, 1).unsqueeze(1).float()
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    else:  # SDPA takes no cap: the capped logits of a block of queries at a time ([Hkv, G, 256, N] at most)
        out = torch.empty_like(q)
        for first in range(0, n, 256):
            rows = slice(first, first + 256)
            logits = soft_capped(torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale, soft_cap)
            weights = logits.masked_fill(~mask[:, rows].unsqueeze(1), float("-inf")).softmax(-1)
            out[:, :, rows] = torch.matmul(weights, v)
    return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)


# ---------------------------------------------------------------------- cache data movement and scoring
# Oracles for the Triton kernels in `kernels/` (kv_write.py, compaction.py, window_scores.py).


def _kv_rows(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Row of each flat slot's key in `kv_pool` viewed as `[pages * 2 * page_size, d]` (value: `page_size` further)."""
    return torch.div(slots, page_size, rounding_mode="floor") * (2 * page_size) + slots % page_size


def write_kv(
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position_pool: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Store `keys`/`values[..., d]` at flat `slots[...]` in place, as `PagedKVCache.write` does.

    With `position_pool` and `positions[...]` the positions are stored too (what `append_slots` does).
    Negative slots are skipped, so a batch may be padded with -1.
    """
    page_size, head_dim = kv_pool.shape[2], kv_pool.shape[-1]
    if keys.shape != values.shape or keys.shape[:-1] != slots.shape or keys.shape[-1] != head_dim:
        raise ValueError(
            f"write shapes disagree: slots {tuple(slots.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)}, pool head_dim {head_dim}"
        )
    flat_slots = slots.reshape(-1).to(device=kv_pool.device, dtype=torch.int64)
    k, v = keys.reshape(-1, head_dim), values.reshape(-1, head_dim)
    pos = positions.reshape(-1) if position_pool is not None and positions is not None else None
    keep = flat_slots >= 0
    # This is the cache's CPU write path: skip the masking copies when nothing is padding (the cache's case).
    if not bool(keep.all()):
        flat_slots, k, v = flat_slots[keep], k[keep], v[keep]
        pos = pos[keep] if pos is not None else None
    rows = _kv_rows(flat_slots, page_size)
    flat = kv_pool.view(-1, head_dim)
    flat[rows] = k.to(flat.dtype)
    flat[rows + page_size] = v.to(flat.dtype)
    if position_pool is not None and pos is not None:
        position_pool.view(-1)[flat_slots] = pos.to(position_pool.device, position_pool.dtype)


def copy_slots(kv_pool: torch.Tensor, position_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy K, V and positions from flat slots `src` to `dst` in place; every read happens before any write.

    `PagedKVCache._copy_slots` as a free function: order-preserving compaction (a slot may be read by
    one entry and written by another) and tail-into-hole eviction both reduce to it.
    """
    page_size, head_dim = kv_pool.shape[2], kv_pool.shape[-1]
    src = src.reshape(-1).to(device=kv_pool.device, dtype=torch.int64)
    dst = dst.reshape(-1).to(device=kv_pool.device, dtype=torch.int64)
    src_rows, dst_rows = _kv_rows(src, page_size), _kv_rows(dst, page_size)
    flat = kv_pool.view(-1, head_dim)
    # Destinations are distinct (each moved entry lands in its own slot). index_select then index_copy_ reads
    # every source before writing, and on a CPU takes 0.4x the time of `flat[dst] = flat[src]`.
    moved = torch.index_select(flat, 0, torch.cat([src_rows, src_rows + page_size]))
    flat.index_copy_(0, torch.cat([dst_rows, dst_rows + page_size]), moved)
    pos = position_pool.view(-1)
    pos.index_copy_(0, dst, torch.index_select(pos, 0, src))


def soft_capped(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """Attention logits under a logit soft cap (Gemma 2): `soft_cap * tanh(logits / soft_cap)`; unchanged without."""
    return logits if soft_cap is None else soft_cap * torch.tanh(logits / soft_cap)


def grouped_logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """`scale * q . k` of queries `[w, Hq, d]` over keys `[Hkv, n, d]`, as `[Hq, w, n]` fp32: query head i reads KV
    head i // (Hq / Hkv). One matrix product per KV head over its query heads' rows, so the keys are not repeated
    per query head (the same dot products: equal to the per-query-head product, and about twice as fast on a CPU
    at SnapKV's window)."""
    w, num_q_heads, d = queries.shape
    num_kv_heads, n, _ = keys.shape
    group = num_q_heads // num_kv_heads
    rows = queries.float().reshape(w, num_kv_heads, group, d).permute(1, 2, 0, 3).reshape(num_kv_heads, group * w, d)
    return torch.matmul(rows, keys.float().transpose(1, 2)).mul_(scale).view(num_q_heads, w, n)


def mask_future_(scores: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Set `scores[..., w, n]` to -inf where key position > query position, in place; returns `scores`.

    `key_positions` `[n]` or `[H, n]` (broadcast over the leading dimension), `query_positions` `[w]`.
    When the key positions are one ascending row (a prompt before compression, the usual case), the
    keys at or before the first query are visible to every query, so only the columns after them are
    compared and masked: the same result as masking the whole `[w, n]` block, for a fraction of the work.
    """
    n, window = scores.shape[-1], query_positions.shape[0]
    keys = key_positions.reshape(-1, n)
    query_positions = query_positions.to(keys.device)  # captured positions may sit on the host
    if keys.shape[0] == 1 and n > 1 and bool((keys[0, 1:] >= keys[0, :-1]).all()):
        lowest = query_positions.min().to(keys.dtype) if window else None
        first = int(torch.searchsorted(keys[0].contiguous(), lowest, right=True)) if lowest is not None else n
        tail = keys[0, first:]
        future = tail.view(1, -1) > query_positions.view(-1, 1)  # [w, n - first]
        scores[..., first:].masked_fill_(future, float("-inf"))
        return scores
    return scores.masked_fill_(keys.view(-1, 1, n) > query_positions.view(1, window, 1), float("-inf"))


def window_scores(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    window_reduction: str = "sum",
    group_reduction: str = "mean",
) -> torch.Tensor:
    """Observation-window scores `[Hkv, n]` (fp32): what SnapKV-family policies rank entries by.

    queries `[w, Hq, d]` at `query_positions[w]`, keys `[Hkv, n, d]` at `key_positions` (`[n]` or
    `[Hkv, n]`); query head i reads KV head i // (Hq / Hkv), causal by position. The softmax
    probabilities `[Hq, w, n]` are reduced over the window (`sum` or `mean`), then over each KV head's
    query heads (`mean` or `max`) -- `policies.base.window_attention` followed by the policies'
    reductions, materialising the whole probability tensor (the Triton kernel does not).
    """
    if window_reduction not in ("sum", "mean"):
        raise ValueError(f"window_reduction must be 'sum' or 'mean', got {window_reduction!r}")
    if group_reduction not in ("mean", "max"):
        raise ValueError(f"group_reduction must be 'mean' or 'max', got {group_reduction!r}")
    num_q_heads = queries.shape[1]
    num_kv_heads, n, _ = keys.shape
    group = num_q_heads // num_kv_heads
    scores = grouped_logits(queries, keys, scale)  # [Hq, w, n]
    key_pos = key_positions.to(keys.device).reshape(-1, n)  # [1 or Hkv, n]
    if key_pos.shape[0] > 1:
        key_pos = key_pos.repeat_interleave(group, dim=0)  # [Hq, n]
    probs = torch.softmax(mask_future_(scores, key_pos, query_positions.to(keys.device)), dim=-1)
    reduced = probs.sum(dim=1) if window_reduction == "sum" else probs.mean(dim=1)  # [Hq, n]
    grouped = reduced.view(num_kv_heads, group, n)
    return grouped.mean(dim=1) if group_reduction == "mean" else grouped.amax(dim=1)
