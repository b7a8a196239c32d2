"""Ragged paged decode attention (Triton), split-K.

Must match `vllm_kvpress_ext.attention.reference.paged_decode_attention` (without `probs_out`).

Layout (one layer):

- `query[B, Hq, d]`: one decode query per request; query heads `h * G .. h * G + G - 1` form the GQA
  group of KV head `h` (G = Hq / Hkv).
- `kv_pool[P, 2, page_size, d]`, contiguous: viewed as rows `[P * 2 * page_size, d]`, the key of slot
  (page p, offset o) is row `p * 2 * page_size + o` and its value `page_size` rows further.
- `block_tables[R, Hkv, max_pages]` int32 and `seq_lens[R, Hkv]`: each (request row, KV head) is its
  own sequence of `seq_lens` entries; entry e sits at page `block_tables[r, h, e // page_size]`.
- `rows[B]`: the cache row of each query.
- optional ring: `ring_tables[R, Hkv, ring_pages]` and `ring_lens[R]`; the first `ring_lens[r]` ring
  slots are attended to as extra keys after the global entries (order is irrelevant to softmax).

Each (row, head) is a virtual sequence of `seq_len + ring_len` tokens; token t < seq_len is global
entry t, the rest are ring slot t - seq_len. The page of every token in a tile is looked up from the
table, so a tile may straddle pages and the two segments, and `BLOCK_N` is independent of the page
size.

Grid of the partial kernel: `(B, Hkv, num_splits)`. Program (b, h, s) takes the whole GQA group as
its query block (`BLOCK_G` rows, padded to 16 for `tl.dot`) and runs an online softmax (base-2
exponent, fp32 running max, sum and accumulator) over tokens `[s * split_tokens, (s + 1) *
split_tokens)` of its head. Splits are what let one long head use many SMs while short heads finish
early: their programs past the head's end return after writing an empty partial. With a single
split the program normalises and writes the output directly; otherwise it writes partial
`(max, sum, acc)` and `_decode_reduce_kernel` (grid `(B, Hq)`) merges the splits of every query head.

Inputs may be fp16, bf16 or fp32; when query and pool share a dtype the dot products run in it with
fp32 accumulation (fp32 uses IEEE dot products, not TF32, to stay on the reference), otherwise both
are promoted to fp32. The output has the query's dtype. A head with nothing to attend to yields
zeros, as in the reference.
"""

# Triton kernel parameters cannot carry Python annotations (Triton reads them), hence:
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from vllm_kvpress_ext.kernels.common import choose_splits, multiprocessor_count, next_power_of_2

LOG2E = 1.4426950408889634
# 128-token tiles: the fastest of 32/64/128 on an H100 at head_dim 128 (docs/gpu.md).
DEFAULT_BLOCK_N = 128


def default_block_n(head_dim: int, compute_fp32: bool, upcast: bool) -> int:
    """The widest token tile that compiles for sm_90 without spilling (`kvpress bench kernels --compile-only`).

    fp16 / bf16 up to head_dim 128 keep the tuned 128 tokens; at 256 a 128-token tile spills (272 B per
    thread), 64 does not. fp32 dot products run on FMA units in registers: 64 tokens up to head_dim 128
    (128 spills 120 to 1,152 B), 32 at 256 (128 needs 281 KiB of shared memory, over sm_90's 227; 64
    spills 1 KiB). A cache in another dtype than the query (`UPCAST`) widens both to fp32 after loading:
    32 tokens up to head_dim 128, 16 at 256 (64 spills from 192 B at head_dim 64 to 9 KiB at 256; what
    is left is named in `bench/kernel_build.py`'s `ACCEPTED`).
    """
    if upcast:
        return 32 if head_dim <= 128 else 16
    if compute_fp32:
        return 64 if head_dim <= 128 else 32
    return DEFAULT_BLOCK_N if head_dim <= 128 else 64


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    kv_ptr,
    tables_ptr,
    lens_ptr,
    rows_ptr,
    ring_tables_ptr,
    ring_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    split_tokens,
    num_splits,
    stride_qb,
    stride_qh,
    stride_tr,
    stride_th,
    stride_lr,
    stride_lh,
    stride_rtr,
    stride_rth,
    stride_rl,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RING: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    row = tl.load(rows_ptr + b).to(tl.int64)
    glen = tl.load(lens_ptr + row * stride_lr + h * stride_lh).to(tl.int32)
    rlen = 0
    if HAS_RING:  # resolved at compile time
        rlen = tl.load(ring_lens_ptr + row * stride_rl).to(tl.int32)
    start = s * split_tokens
    end = tl.minimum(start + split_tokens, glen + rlen)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_heads = h * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table_base = tables_ptr + row * stride_tr + h * stride_th
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_n
        t_mask = t < end
        in_global = t < glen
        page = tl.load(table_base + t // PAGE_SIZE, mask=t_mask & in_global, other=0)
        offset = t % PAGE_SIZE
        if HAS_RING:
            rt = t - glen
            ring_page = tl.load(
                ring_tables_ptr + row * stride_rtr + h * stride_rth + rt // PAGE_SIZE,
                mask=t_mask & (t >= glen),
                other=0,
            )
            page = tl.where(in_global, page, ring_page)
            offset = tl.where(in_global, offset, rt % PAGE_SIZE)
        # int64 before the multiply: pools past 2^31 elements are ordinary on large GPUs.
        k_row = page.to(tl.int64) * (2 * PAGE_SIZE) + offset
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + k_row[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + (k_row + PAGE_SIZE)[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if DIRECT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (b * num_q_heads + q_heads) * num_splits + s  # [BLOCK_G]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (b * tl.num_programs(1) + hq) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    # An empty head has every split at -inf: weight 0 everywhere, output 0.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_ref)
    total = tl.sum(l_s * weight, 0)
    # other=0: masked lanes are undefined on a GPU, and 0 * NaN would poison the sum.
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


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
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton twin of the reference `paged_decode_attention` (same arguments, no `probs_out`).

    `position_pool` is accepted for signature parity and unused: decode attends to every cached
    entry. `block_n` (the token tile) defaults to `default_block_n` for the dtypes and head dim.
    `split_tokens` forces the split size (tests use it to exercise split-K on small inputs);
    by default `choose_splits` sizes the launch from the table width, without a host sync.
    """
    batch, num_q_heads, head_dim = query.shape
    _rows_total, num_kv_heads, max_pages = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    if kv_pool.shape[-1] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {kv_pool.shape[-1]}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")
    group = num_q_heads // num_kv_heads
    page_size = kv_pool.shape[2]
    out = torch.empty_like(query)
    if batch == 0:
        return out
    device = query.device
    query = query if query.stride(-1) == 1 else query.contiguous()
    rows = rows.to(device=device, dtype=torch.int64)
    has_ring = ring_tables is not None and ring_lens is not None and ring_tables.shape[-1] > 0
    if has_ring:
        assert ring_tables is not None and ring_lens is not None
        ring_t = ring_tables if ring_tables.stride(-1) == 1 else ring_tables.contiguous()
        ring_l = ring_lens.to(device)
        ring_tokens = ring_t.shape[-1] * page_size
        ring_args = (ring_t, ring_l, ring_t.stride(0), ring_t.stride(1), ring_l.stride(0))
    else:
        ring_tokens = 0
        ring_args = (block_tables, seq_lens, 0, 0, 0)  # never read
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()

    upcast = query.dtype != kv_pool.dtype
    compute_dtype = torch.float32 if upcast else query.dtype
    if block_n is None:
        block_n = default_block_n(head_dim, compute_dtype == torch.float32, upcast)
    block_n = max(16, next_power_of_2(block_n))
    num_splits, split = choose_splits(
        batch, num_kv_heads, max_pages * page_size + ring_tokens, block_n, multiprocessor_count(device), split_tokens
    )
    direct = num_splits == 1
    if direct:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty(batch, num_q_heads, num_splits, device=device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, device=device, dtype=torch.float32)
    block_d = max(16, next_power_of_2(head_dim))
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        query,
        kv_pool,
        tables,
        seq_lens,
        rows,
        ring_args[0],
        ring_args[1],
        out,
        part_m,
        part_l,
        part_acc,
        scale * LOG2E,
        split,
        num_splits,
        query.stride(0),
        query.stride(1),
        tables.stride(0),
        tables.stride(1),
        seq_lens.stride(0),
        seq_lens.stride(1),
        ring_args[2],
        ring_args[3],
        ring_args[4],
        out.stride(0),
        out.stride(1),
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_RING=has_ring,
        DIRECT=direct,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=next_power_of_2(head_dim),
            num_warps=4,
        )
    return out
