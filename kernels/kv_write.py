"""KV write by slot mapping (Triton): one op for prefill bulk writes and decode appends.

Must match `vllm_kvpress_ext.attention.reference.write_kv`, which is `PagedKVCache.write` (plus the
position write `append_slots` does) as a free function.

Layout: `kv_pool[P, 2, page_size, d]` contiguous, viewed as rows `[P * 2 * page_size, d]`; flat slot
`s = page * page_size + offset` keeps its key in row `(s // page_size) * 2 * page_size + s % page_size`
(the manager's `_kv_rows`) and its value `page_size` rows further; its position in
`position_pool.view(-1)[s]`. Inputs: `slots[N]` (int), `keys`/`values[N, d]` in any float dtype
(cast to the pool's), optional `positions[N]` (cast to int32). A negative slot is skipped, so a
caller may pad a batch with -1 (the manager never produces one).

Grid: `(cdiv(N, BLOCK_T),)`; a program moves `BLOCK_T` tokens, a whole padded head row each. The
op is pure data movement: bandwidth is the only thing that matters, so tokens are the parallel
axis and every row is one contiguous load and store.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from vllm_kvpress_ext.kernels.common import next_power_of_2


@triton.jit
def _kv_write_kernel(
    slots_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    kv_ptr,
    pool_pos_ptr,
    num_tokens,
    stride_k,
    stride_v,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_mask = offs_t < num_tokens
    slot = tl.load(slots_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
    valid = t_mask & (slot >= 0)
    k_row = (slot // PAGE_SIZE) * (2 * PAGE_SIZE) + slot % PAGE_SIZE
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_t = offs_t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + src_t * stride_k + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src_t * stride_v + offs_d[None, :], mask=mask)
    dst = kv_ptr + k_row[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + PAGE_SIZE * HEAD_DIM, v.to(kv_ptr.dtype.element_ty), mask=mask)
    if HAS_POS:
        pos = tl.load(pos_ptr + offs_t, mask=valid)
        tl.store(pool_pos_ptr + slot, pos.to(tl.int32), mask=valid)


def write_kv(
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position_pool: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    *,
    block_t: int = 32,
) -> None:
    """Store `keys`/`values[..., d]` at flat `slots[...]` (and `positions[...]` if both are given), in place."""
    head_dim = kv_pool.shape[-1]
    page_size = kv_pool.shape[2]
    if keys.shape != values.shape or keys.shape[:-1] != slots.shape or keys.shape[-1] != head_dim:
        raise ValueError(
            f"write shapes disagree: slots {tuple(slots.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)}, pool head_dim {head_dim}"
        )
    if not kv_pool.is_contiguous() or (position_pool is not None and not position_pool.is_contiguous()):
        raise ValueError("kv_pool and position_pool must be contiguous")
    flat_slots = slots.reshape(-1).to(kv_pool.device)
    num_tokens = flat_slots.numel()
    if num_tokens == 0:
        return
    k = keys.reshape(-1, head_dim)
    v = values.reshape(-1, head_dim)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    has_pos = position_pool is not None and positions is not None
    pos = positions.reshape(-1).to(kv_pool.device) if has_pos and positions is not None else flat_slots
    _kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        flat_slots.contiguous(),
        k,
        v,
        pos.contiguous(),
        kv_pool,
        position_pool if position_pool is not None else kv_pool,
        num_tokens,
        k.stride(0),
        v.stride(0),
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_D=next_power_of_2(head_dim),
        HAS_POS=has_pos,
        num_warps=4,
    )
