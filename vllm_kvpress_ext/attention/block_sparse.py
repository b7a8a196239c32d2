"""Vertical-slash prefill attention on the CPU, block-sparse: only the keys a block of queries can see.

The write gate's mask (`reference.vertical_slash_attention`) lets query i see key j of its KV head iff
j <= i and (i - j < window or admitted[h, j]). The reference hands the whole boolean square to one
fused SDPA call, which computes every (query, key) pair -- twice the causal prefill's work, whatever
the gates admitted. Here the queries go in blocks of `block_size` rows, positions [s, e), and each
block attends to two disjoint key ranges, the split the Triton kernel (`kernels/vertical_slash.py`)
makes per tile:

- **far** keys, j <= s - window: every query of the block is at least `window` past them, so the band
  never reaches them and each is seen by the whole block iff admitted. They are the first c_h entries
  of the head's admitted keys in position order (gathered once per call), c_h counted by a binary
  search; heads admit different counts, so the shorter heads' tails are masked off.
- **near** keys, s - window < j < e: the band and the block's own causal triangle, under the exact
  mask, at most window + block_size - 1 columns.

One masked SDPA call per block over the two ranges side by side; the softmax over their union is the
reference's row softmax with the hidden keys left out, so outputs equal the reference's to float
rounding (tests/test_block_sparse_attention.py). The work is about admitted_fraction x n^2 / 2 +
n x (window + block_size) pairs instead of n^2: at 25% admission a quarter of the reference's and
under the causal prefill's. float32 throughout, as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kvpress_ext.attention.reference import check_vertical_slash_arguments

DEFAULT_BLOCK_SIZE = 128  # 64-512 measured within 20% of each other at 2K-8K on SmolLM2's shape; 128 at about the best


def _admitted_keys_in_order(
    keys: torch.Tensor, values: torch.Tensor, admitted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's admitted keys and values in position order, padded to the longest head:
    `[Hkv, A, d]` twice, and the positions `[Hkv, A]` (padding at `N`, past every key)."""
    heads, total = admitted.shape
    positions = torch.arange(total, device=admitted.device).expand(heads, total)
    # Admitted positions first, in order, then the rest pushed past the end: one sort per call.
    order = torch.where(admitted, positions, positions + total).sort(dim=-1).values
    count = int(admitted.sum(dim=-1).max())
    order = order[:, :count]
    padded = order >= total
    rows = order.masked_fill(padded, 0)
    head_keys = keys.transpose(0, 1)  # [Hkv, N, d]
    head_values = values.transpose(0, 1)
    index = rows.unsqueeze(-1).expand(heads, count, keys.shape[-1])
    far_keys = torch.gather(head_keys, 1, index).float()
    far_values = torch.gather(head_values, 1, index).float()
    return far_keys, far_values, order.masked_fill(padded, total)


def vertical_slash_attention_blocks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    admitted: torch.Tensor,
    window: int,
    scale: float,
    query_start: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """`reference.vertical_slash_attention`'s result (same arguments, same checks), computed block-sparse.

    query `[n, Hq, d]` at positions `query_start + i`; keys/values `[N, Hkv, d]` at 0..N-1 with
    N = query_start + n; `admitted[Hkv, N]` bool. Returns `[n, Hq, d]` in the query's dtype.
    """
    check_vertical_slash_arguments(query, keys, admitted, window, query_start)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n, num_q_heads, head_dim = query.shape
    total, num_kv_heads = keys.shape[0], keys.shape[1]
    device = query.device
    admitted = admitted.to(device, torch.bool)
    group = num_q_heads // num_kv_heads
    q_all = query.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).float()  # [Hkv, G, n, d]
    k_all = keys.transpose(0, 1).float().contiguous()  # [Hkv, N, d]
    v_all = values.transpose(0, 1).float().contiguous()
    far_keys, far_values, far_positions = _admitted_keys_in_order(keys, values, admitted)
    out = torch.empty(num_kv_heads, group, n, head_dim, dtype=torch.float32, device=device)
    for row in range(0, n, block_size):
        start, end = query_start + row, min(query_start + row + block_size, total)
        near_start = max(0, start - window + 1)
        i = torch.arange(start, end, device=device).view(-1, 1)
        j = torch.arange(near_start, end, device=device).view(1, -1)
        causal = j <= i  # [b, L]
        near_mask = (causal & (i - j < window)).unsqueeze(0) | (causal.unsqueeze(0) & admitted[:, None, near_start:end])
        # Far keys: admitted positions <= start - window, a prefix of each head's ordered list.
        seen = far_positions <= start - window  # [Hkv, A]
        far_count = int(seen.sum(dim=-1).max())
        block_keys, block_values, mask = k_all[:, near_start:end], v_all[:, near_start:end], near_mask
        if far_count > 0:
            block_keys = torch.cat((far_keys[:, :far_count], block_keys), dim=1)
            block_values = torch.cat((far_values[:, :far_count], block_values), dim=1)
            far_mask = seen[:, None, :far_count].expand(num_kv_heads, end - start, far_count)
            mask = torch.cat((far_mask, near_mask), dim=-1)
        out[:, :, row : row + end - start] = F.scaled_dot_product_attention(
            q_all[:, :, row : row + end - start],
            block_keys.unsqueeze(1),
            block_values.unsqueeze(1),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=True,
        )
    return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim).to(query.dtype)
