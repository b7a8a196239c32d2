"""Slot-to-slot copy of K, V and positions (Triton): compaction and hole filling.

Must match `vllm_kvpress_ext.attention.reference.copy_slots`, which is `PagedKVCache._copy_slots` as
a free function: every source is read before any destination is written.

Layout: `kv_pool[P, 2, page_size, d]` contiguous (key of slot s in row
`(s // page_size) * 2 * page_size + s % page_size` of the `[P * 2 * page_size, d]` view, value
`page_size` rows further) and `position_pool[P, page_size]` int32 (`view(-1)[s]`). `src[N]`, `dst[N]`
are flat slots; entry i moves from `src[i]` to `dst[i]`.

The two uses differ in whether a slot can be both read and written:

- order-preserving compaction (`apply_keep_plan`): kept entry e moves to e' <= e, so a slot is often
  the destination of one entry and the source of the next. Copying in place in parallel would race,
  so the default is two passes through a staging buffer `[N, 2, d]` (+ positions): gather every
  source, then scatter every destination. That is the reference's read-before-write semantics.
- tail entries into holes (`evict`): sources are kept entries past the new length, destinations are
  dropped entries below it, never the same slot. `disjoint=True` copies directly in one pass and
  halves the traffic. The caller vouches for disjointness; it is not checked (checking would cost a
  sort, more than the copy).

Grid: `(cdiv(N, BLOCK_T),)` for each pass; a program moves `BLOCK_T` entries, K, V and position each.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from vllm_kvpress_ext.kernels.common import next_power_of_2


@triton.jit
def _move_kernel(
    src_idx_ptr,
    dst_idx_ptr,
    src_kv_ptr,
    dst_kv_ptr,
    src_pos_ptr,
    dst_pos_ptr,
    num_entries,
    SRC_PAGED: tl.constexpr,
    DST_PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Move entries between the pool (PAGED: index = flat slot) and a staging buffer (index = i)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_mask = offs_t < num_entries
    mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if SRC_PAGED:
        src = tl.load(src_idx_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
        src_k = (src // PAGE_SIZE) * (2 * PAGE_SIZE) + src % PAGE_SIZE
        src_v = src_k + PAGE_SIZE
    else:
        src = offs_t.to(tl.int64)
        src_k = 2 * src
        src_v = src_k + 1
    if DST_PAGED:
        dst = tl.load(dst_idx_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
        dst_k = (dst // PAGE_SIZE) * (2 * PAGE_SIZE) + dst % PAGE_SIZE
        dst_v = dst_k + PAGE_SIZE
    else:
        dst = offs_t.to(tl.int64)
        dst_k = 2 * dst
        dst_v = dst_k + 1
    k = tl.load(src_kv_ptr + src_k[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    v = tl.load(src_kv_ptr + src_v[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    pos = tl.load(src_pos_ptr + src, mask=t_mask)
    tl.store(dst_kv_ptr + dst_k[:, None] * HEAD_DIM + offs_d[None, :], k, mask=mask)
    tl.store(dst_kv_ptr + dst_v[:, None] * HEAD_DIM + offs_d[None, :], v, mask=mask)
    tl.store(dst_pos_ptr + dst, pos, mask=t_mask)


def copy_slots(
    kv_pool: torch.Tensor,
    position_pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    disjoint: bool = False,
    block_t: int = 32,
) -> None:
    """Copy K, V and positions from flat slots `src[N]` to `dst[N]` in place (see the module docstring)."""
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    if not kv_pool.is_contiguous() or not position_pool.is_contiguous():
        raise ValueError("kv_pool and position_pool must be contiguous")
    src = src.reshape(-1).to(kv_pool.device).contiguous()
    dst = dst.reshape(-1).to(kv_pool.device).contiguous()
    num_entries = src.numel()
    if num_entries == 0:
        return
    head_dim = kv_pool.shape[-1]
    meta = {
        "PAGE_SIZE": kv_pool.shape[2],
        "HEAD_DIM": head_dim,
        "BLOCK_T": block_t,
        "BLOCK_D": next_power_of_2(head_dim),
        "num_warps": 4,
    }
    grid = (triton.cdiv(num_entries, block_t),)
    if disjoint:
        _move_kernel[grid](
            src,
            dst,
            kv_pool,
            kv_pool,
            position_pool,
            position_pool,
            num_entries,
            SRC_PAGED=True,
            DST_PAGED=True,
            **meta,
        )
        return
    staged_kv = torch.empty(num_entries, 2, head_dim, device=kv_pool.device, dtype=kv_pool.dtype)
    staged_pos = torch.empty(num_entries, device=kv_pool.device, dtype=position_pool.dtype)
    _move_kernel[grid](
        src, dst, kv_pool, staged_kv, position_pool, staged_pos, num_entries, SRC_PAGED=True, DST_PAGED=False, **meta
    )
    _move_kernel[grid](
        src, dst, staged_kv, kv_pool, staged_pos, position_pool, num_entries, SRC_PAGED=False, DST_PAGED=True, **meta
    )
