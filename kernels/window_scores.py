"""Observation-window scores (Triton), two passes, never more than a tile of the w x n matrix.

Must match `vllm_kvpress_ext.attention.reference.window_scores`, which is the SnapKV family's
`reduce_group(reduce_window(window_attention(...)))` from `policies/base.py`.

Inputs: window queries `queries[w, Hq, d]` at `query_positions[w]`; one layer's keys `keys[Hkv, n, d]`
at `key_positions[n]` (shared by the heads, as right after prefill) or `[Hkv, n]`. Query head i reads
KV head i // G (G = Hq / Hkv). Query q sees key k iff `pos(k) <= pos(q)`. Output `[Hkv, n]` fp32:
softmax probabilities over the keys, reduced over the window (`sum` as SnapKV's votes, or `mean`)
and then over each KV head's G query heads (`mean` or `max`).

Why two passes: a softmax row needs its normaliser before any of its probabilities can be summed
into a key's score, and the full `[Hq, w, n]` probability tensor is what the reference materialises
(n = 128K, w = 64, Hq = 32 makes it 1 GiB of fp32 per layer).

- Pass 1, grid `(Hkv, cdiv(w, BLOCK_W))`: a program takes `BLOCK_G x BLOCK_W` query rows (the whole
  GQA group for a slice of the window, flattened into one `tl.dot` operand) and streams over every
  key tile with an online max / sum, writing the base-2 log-sum-exp of each row (`lse[Hq, w]`).
- Pass 2, grid `(Hkv, cdiv(n, BLOCK_N))`: a program owns one key tile and streams over the window,
  recomputing the score tile, normalising it with the row's lse, and summing over the window into a
  `[BLOCK_G, BLOCK_N]` accumulator; the group reduction happens in registers before the store.

Only one `[BLOCK_G * BLOCK_W, BLOCK_N]` score tile exists at a time in either pass. A query with no
visible key contributes nothing (the reference would produce NaN there; the policies never ask).
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from vllm_kvpress_ext.kernels.common import next_power_of_2

LOG2E = 1.4426950408889634
WINDOW_REDUCTIONS = ("sum", "mean")
GROUP_REDUCTIONS = ("mean", "max")


@triton.jit
def _lse_kernel(
    q_ptr,
    qpos_ptr,
    k_ptr,
    kpos_ptr,
    lse_ptr,
    window,
    n,
    scale_log2,
    stride_qw,
    stride_qh,
    stride_kh,
    stride_kn,
    stride_ph,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    r = tl.arange(0, BLOCK_G * BLOCK_W)
    g = r // BLOCK_W
    wi = tl.program_id(1) * BLOCK_W + r % BLOCK_W
    r_mask = (g < GROUP) & (wi < window)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + wi[:, None] * stride_qw + (h * GROUP + g)[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    qpos = tl.load(qpos_ptr + wi, mask=wi < window, other=-1)
    m_i = tl.full([BLOCK_G * BLOCK_W], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G * BLOCK_W], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, n, BLOCK_N):
        kn = n0 + offs_n
        k_mask = kn < n
        k = tl.load(
            k_ptr + h * stride_kh + kn[:, None] * stride_kn + offs_d[None, :],
            mask=k_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        kpos = tl.load(kpos_ptr + h * stride_ph + kn, mask=k_mask, other=0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = k_mask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; shift by 0 so no inf - inf appears.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_ref) + tl.sum(tl.exp2(s - m_ref[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + (h * GROUP + g) * window + wi, lse, mask=r_mask)


@triton.jit
def _scores_kernel(
    q_ptr,
    qpos_ptr,
    k_ptr,
    kpos_ptr,
    lse_ptr,
    out_ptr,
    window,
    n,
    scale_log2,
    stride_qw,
    stride_qh,
    stride_kh,
    stride_kn,
    stride_ph,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW_MEAN: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    kn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = kn < n
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(
        k_ptr + h * stride_kh + kn[:, None] * stride_kn + offs_d[None, :],
        mask=k_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    kpos = tl.load(kpos_ptr + h * stride_ph + kn, mask=k_mask, other=0)
    r = tl.arange(0, BLOCK_G * BLOCK_W)
    g = r // BLOCK_W
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for w0 in range(0, window, BLOCK_W):
        wi = w0 + r % BLOCK_W
        r_mask = (g < GROUP) & (wi < window)
        q = tl.load(
            q_ptr + wi[:, None] * stride_qw + (h * GROUP + g)[:, None] * stride_qh + offs_d[None, :],
            mask=r_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        qpos = tl.load(qpos_ptr + wi, mask=wi < window, other=-1)
        lse = tl.load(lse_ptr + (h * GROUP + g) * window + wi, mask=r_mask, other=float("-inf"))
        row_ok = r_mask & (lse != float("-inf"))
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = row_ok[:, None] & k_mask[None, :] & (kpos[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp2(s - tl.where(row_ok, lse, 0.0)[:, None]), 0.0)
        acc += tl.sum(tl.reshape(p, (BLOCK_G, BLOCK_W, BLOCK_N)), 1)
    if WINDOW_MEAN:
        acc = acc / window
    # Padded group rows hold zeros: they add nothing to the mean and, probabilities being >= 0,
    # never win the max.
    scores = tl.sum(acc, 0) / GROUP
    if GROUP_MAX:
        scores = tl.max(acc, 0)
    tl.store(out_ptr + h * n + kn, scores, mask=k_mask)


def window_scores(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    window_reduction: str = "sum",
    group_reduction: str = "mean",
    *,
    block_n: int | None = None,
    rows_per_tile: int | None = None,
) -> torch.Tensor:
    """Observation-window scores `[Hkv, n]` fp32 (see the module docstring for shapes and semantics).

    `rows_per_tile` bounds `BLOCK_G * BLOCK_W`, the query rows of one score tile. Both default to 64 in
    fp16 / bf16 and to 16 in fp32, whose dot products run on FMA units in registers: at 64 x 64 fp32 tiles
    spill 5 to 25 KiB per thread on sm_90, at 16 x 16 none at head_dim 64 and 0.3 / 2.5 KiB at 128 / 256
    (`kvpress bench kernels --compile-only`).
    """
    if window_reduction not in WINDOW_REDUCTIONS:
        raise ValueError(f"window_reduction must be one of {WINDOW_REDUCTIONS}, got {window_reduction!r}")
    if group_reduction not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduction must be one of {GROUP_REDUCTIONS}, got {group_reduction!r}")
    window, num_q_heads, head_dim = queries.shape
    num_kv_heads, n, _ = keys.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    device = keys.device
    out = torch.zeros(num_kv_heads, n, device=device, dtype=torch.float32)
    if n == 0 or window == 0:
        return out
    if queries.dtype != keys.dtype:
        queries, keys = queries.float(), keys.float()
    tile = 16 if keys.dtype == torch.float32 else 64
    block_n = tile if block_n is None else block_n
    rows_per_tile = tile if rows_per_tile is None else rows_per_tile
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    qpos = query_positions.to(device=device, dtype=torch.int64).contiguous()
    kpos = key_positions.to(device=device, dtype=torch.int64)
    if kpos.dim() == 1:
        kpos = kpos.view(1, n).contiguous()
        stride_ph = 0
    else:
        kpos = kpos.contiguous()
        stride_ph = kpos.stride(0)
    block_g = next_power_of_2(group)
    # tl.dot needs >= 16 rows: widen the window slice when the group is small.
    block_w = max(max(1, 16 // block_g), min(next_power_of_2(window), max(1, rows_per_tile // block_g)))
    block_n = max(16, next_power_of_2(block_n))
    block_d = max(16, next_power_of_2(head_dim))
    lse = torch.empty(num_q_heads, window, device=device, dtype=torch.float32)
    common = (
        window,
        n,
        scale * LOG2E,
        queries.stride(0),
        queries.stride(1),
        keys.stride(0),
        keys.stride(1),
        stride_ph,
    )
    meta = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_G": block_g,
        "BLOCK_W": block_w,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "DOT_PRECISION": "ieee" if keys.dtype == torch.float32 else "tf32",
        "num_warps": 4,
    }
    _lse_kernel[(num_kv_heads, triton.cdiv(window, block_w))](queries, qpos, keys, kpos, lse, *common, **meta)
    _scores_kernel[(num_kv_heads, triton.cdiv(n, block_n))](
        queries,
        qpos,
        keys,
        kpos,
        lse,
        out,
        *common,
        WINDOW_MEAN=window_reduction == "mean",
        GROUP_MAX=group_reduction == "max",
        **meta,
    )
    return out
