"""Vertical-slash block-sparse prefill attention (Triton), one sequence, FlashAttention-style.

Must match `vllm_kvpress_ext.attention.reference.vertical_slash_attention`.

Inputs: `query[m, Hq, d]` at positions `query_start .. query_start + m - 1` (0 and m = n for a whole
prompt; a later prefill chunk passes its start), `keys`/`values[n, Hkv, d]` (one dtype: fp16, bf16 or
fp32), `admitted[Hkv, n]` bool, `window >= 1`. The query at position i of KV head h sees key j iff
`j <= i` and (`i - j < window`, the slash, or `admitted[h, j]`, the verticals). Output `[m, Hq, d]`
in the query's dtype.

Grid: `(cdiv(m, BLOCK_M), Hq)`. Program (m, hq) holds `BLOCK_M` queries of query head hq (KV head
hq // G) and an online-softmax accumulator (base-2 exponent, fp32), and visits key blocks of
`BLOCK_N` in two loops:

1. verticals below the band: key blocks that end before the first query's band starts
   (`block < band_lo`) are causal for every query of the tile and outside every band, so only their
   admitted columns count. Such a block is visited only if it holds any admitted column: on the host,
   per (KV head, key block), an "any admitted" flag is reduced from `admitted`, and turned into a
   sorted list of flagged block ids plus a prefix count, so the program reads how many flagged blocks
   lie below `band_lo` and walks exactly those (no test-and-skip over empty blocks).
2. the band: blocks `band_lo .. diagonal` get the full mask (causal, band or admitted).

Work per query tile is therefore (window + BLOCK_M) / BLOCK_N band blocks plus the flagged blocks, not
i / BLOCK_N: the speedup over dense causal attention depends on how clustered the admitted columns
are at block granularity, not on the admitted fraction alone (25 % of columns scattered uniformly
flag nearly every block).
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from vllm_kvpress_ext.kernels.common import next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    adm_base,
    start_n,
    offs_m,
    n,
    window,
    scale_log2,
    stride_kn,
    stride_vn,
    BAND: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key block of the online softmax; BAND=False for blocks wholly below every query's band."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < n
    kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    admitted = tl.load(adm_base + offs_n, mask=n_mask, other=0) != 0
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if BAND:
        diff = offs_m[:, None] - offs_n[None, :]
        visible = (diff >= 0) & ((diff < window) | admitted[None, :]) & n_mask[None, :]
    else:
        visible = admitted[None, :] & n_mask[None, :] & (offs_m[:, None] >= 0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no key yet keep m = -inf; shift by 0 there so no inf - inf appears.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _vertical_slash_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    adm_ptr,
    blk_ids_ptr,
    blk_cum_ptr,
    n_q,
    n,
    query_start,
    window,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    stride_ah,
    stride_bh,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    local_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    hq = tl.program_id(1)
    h = hq // GROUP
    # Absolute positions of the tile's queries: the mask compares them with key indices.
    m0 = query_start + tl.program_id(0) * BLOCK_M
    offs_m = query_start + local_m
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (local_m < n_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + local_m[:, None].to(tl.int64) * stride_qn + hq * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    adm_base = adm_ptr + h * stride_ah

    # First key of the first query's band, as a block index: blocks below it are verticals only.
    band_lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N
    num_vertical = tl.load(blk_cum_ptr + h * stride_ch + band_lo)
    for t in range(0, num_vertical):
        block = tl.load(blk_ids_ptr + h * stride_bh + t)
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_base,
            v_base,
            adm_base,
            block * BLOCK_N,
            offs_m,
            n,
            window,
            scale_log2,
            stride_kn,
            stride_vn,
            BAND=False,
            HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            DOT_PRECISION=DOT_PRECISION,
        )
    hi = tl.cdiv(tl.minimum(m0 + BLOCK_M, tl.minimum(query_start + n_q, n)), BLOCK_N)
    for block in range(band_lo, hi):
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_base,
            v_base,
            adm_base,
            block * BLOCK_N,
            offs_m,
            n,
            window,
            scale_log2,
            stride_kn,
            stride_vn,
            BAND=True,
            HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            DOT_PRECISION=DOT_PRECISION,
        )
    # The diagonal is in every row's band, so l_i > 0 for every real row; padded rows divide by 1.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + local_m[:, None].to(tl.int64) * stride_on + hq * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=io_mask,
    )


def default_tiles(head_dim: int, fp32: bool) -> tuple[int, int]:
    """(block_m, block_n) for sm_90 (`kvpress bench kernels --compile-only`, docs/gpu.md).

    fp16 / bf16 up to head_dim 128: 128 x 64 with 4 warps, the fastest of 24 configurations on an H100
    at head_dim 128 (docs/gpu.md), although with this Triton it spills 168 B per thread there (8 warps
    do not spill, and were slower in that sweep). At head_dim
    256, 128 x 64 spills 1.4 KiB per thread; 64 x 32 does not. fp32 runs its dot products on FMA units
    in registers: 32 x 32 up to head_dim 128 (clean at 64; 496 B of spills at 128, the least of the tiles
    tried), 16 x 16 at 256 (32 x 32 spills 9.6 KiB; 128 x 64 needs more shared memory than sm_90 has).
    """
    if fp32:
        return (32, 32) if head_dim <= 128 else (16, 16)
    return (128, 64) if head_dim <= 128 else (64, 32)


def admitted_blocks(admitted: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the key blocks holding any admitted column: (sorted ids `[Hkv, NB]`, counts `[Hkv, NB + 1]`).

    `ids[h, :counts[h, NB]]` are the flagged blocks of head h in increasing order (the rest is padding);
    `counts[h, b]` is how many flagged blocks lie below block b. All device-side, no host sync.
    """
    num_kv_heads, n = admitted.shape
    num_blocks = -(-n // block_n)
    padded = torch.zeros(num_kv_heads, num_blocks * block_n, dtype=torch.bool, device=admitted.device)
    padded[:, :n] = admitted
    flags = padded.view(num_kv_heads, num_blocks, block_n).any(-1)
    counts = torch.zeros(num_kv_heads, num_blocks + 1, dtype=torch.int32, device=admitted.device)
    counts[:, 1:] = flags.cumsum(-1)
    block_index = torch.arange(num_blocks, device=admitted.device).expand(num_kv_heads, num_blocks)
    ids = torch.where(flags, block_index, num_blocks).sort(-1).values.to(torch.int32).contiguous()
    return ids, counts


def vertical_slash_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    admitted: torch.Tensor,
    window: int,
    scale: float,
    query_start: int = 0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton twin of the reference `vertical_slash_attention` (same arguments).

    With `query_start = s` the m queries are positions s .. s + m - 1 of the sequence whose n = s + m
    keys are given (a later prefill chunk over its cached prefix); s = 0 and m = n is a whole
    prompt.
    """
    num_queries, num_q_heads, head_dim = query.shape
    n, num_kv_heads, _ = keys.shape
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if admitted.shape != (num_kv_heads, n):
        raise ValueError(f"admitted must be [{num_kv_heads}, {n}], got {list(admitted.shape)}")
    if query_start < 0 or query_start + num_queries != n:
        raise ValueError(f"keys must cover positions 0..{query_start + num_queries - 1}, got {n} of them")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    if not query.dtype == keys.dtype == values.dtype:
        raise ValueError(f"query, keys and values must share a dtype, got {query.dtype}, {keys.dtype}, {values.dtype}")
    out = torch.empty_like(query)
    if num_queries == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    default_m, default_n = default_tiles(head_dim, query.dtype == torch.float32)
    block_m = max(16, next_power_of_2(block_m or default_m))
    block_n = max(16, next_power_of_2(block_n or default_n))
    adm = admitted.to(device=query.device, dtype=torch.bool).contiguous()
    ids, counts = admitted_blocks(adm, block_n)
    adm_u8 = adm.view(torch.uint8)
    block_d = max(16, next_power_of_2(head_dim))
    _vertical_slash_kernel[(triton.cdiv(num_queries, block_m), num_q_heads)](
        query,
        keys,
        values,
        out,
        adm_u8,
        ids,
        counts,
        num_queries,
        n,
        query_start,
        window,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        out.stride(0),
        out.stride(1),
        adm_u8.stride(0),
        ids.stride(0),
        counts.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,  # 4 beat 8 at head_dim 128 on an H100 (docs/gpu.md)
        num_stages=num_stages,
    )
    return out
