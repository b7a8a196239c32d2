"""Launch-shape helpers shared by the Triton and CUDA kernels. Imports no Triton.

Kept apart from the kernel files so that the CUDA extension's wrapper (`cuda_decode.py`) and the
dispatcher can size a split-K launch on machines without Triton.
"""

from __future__ import annotations

import functools

import torch

# Programs wanted per streaming multiprocessor for a decode launch: enough that a batch of a few
# short requests still fills the GPU once every long head is cut into chunks, and that ragged heads
# balance across SMs. Measured on an H100 (64 requests x 8 KV heads x ~8K ragged tokens, fp16): 16
# reached 91% of the device's copy bandwidth, 4 reached 83% (docs/gpu.md).
PROGRAMS_PER_SM = 16
MAX_SPLITS = 64


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1): Triton block shapes must be powers of two."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; a nominal 4 elsewhere (the Triton interpreter on CPU)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_splits(
    batch: int,
    num_kv_heads: int,
    max_tokens: int,
    block_n: int,
    num_sms: int,
    split_tokens: int | None = None,
) -> tuple[int, int]:
    """(num_splits, tokens per split) for a split-K decode launch.

    `max_tokens` is an upper bound on any head's length (the block-table width times the page
    size, plus the ring): taking it from the table shape rather than `seq_lens.max()` avoids a
    device-to-host sync per layer. Each split covers a multiple of `block_n` tokens. The number of
    splits grows until the launch has about `PROGRAMS_PER_SM` programs per SM, so a few long heads
    are cut into chunks that run side by side, while a large batch keeps one program per head
    (no partials to reduce). Programs past a short head's length exit at once.
    An explicit `split_tokens` (rounded up to a multiple of `block_n`) overrides the heuristic.
    """
    tiles = max(1, cdiv(max_tokens, block_n))
    if split_tokens is not None:
        tiles_per_split = max(1, cdiv(split_tokens, block_n))
    else:
        wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(1, batch * num_kv_heads))
        wanted = max(1, min(wanted, MAX_SPLITS, tiles))
        tiles_per_split = cdiv(tiles, wanted)
    return cdiv(tiles, tiles_per_split), tiles_per_split * block_n
