"""Host memory that every decode step reads whole, on 2 MB pages where Linux allows it.

A decode step on the CPU streams all of the model's weights and, for its requests, most of the KV
pool; on SmolLM2-135M in fp32 with 16 requests of about 570 tokens, 0.4 GB of each per step, and the
pool's pages in no particular order. On 4 KB pages that is a translation miss every 4 KB. Where
transparent huge pages are in `madvise` mode (the usual default), memory advised with
`MADV_HUGEPAGE` *before* it is first written is faulted in as 2 MB pages. So:

- `huge_page_tensor` allocates an advised, zeroed tensor (the KV pool);
- `move_to_huge_pages` copies a module's CPU parameters into one advised arena (the weights, right
  after loading) and points each parameter at its place in it.

Both take their memory from an anonymous mapping of their own, 2 MB aligned, never from malloc's
heap: the engine raises glibc's mmap threshold to 32 MB (engine/host_allocator.py), so a smaller
tensor from `torch.empty` could be memory the heap had already touched, on 4 KB pages that the
advice no longer changes. Whether the pages did come out huge depends on the kernel (its THP mode,
its defrag mode, how fragmented free memory is, a container runtime that turned THP off for the
process); `huge_page_placement` reads the answer back from `/proc/self/smaps` and says why when
they did not. The engine logs it at startup and `kvpress info` reports it.

Measured on the development machine (AMD EPYC, 2 cores), a decode step of 16 requests at 512 to 632
tokens in process (median of 120): the projections 28.1 -> 26.1 ms, the decode attention 23.8 ->
22.4 ms, the step 69.2 -> 64.8 ms. Where the advice is refused (another OS, huge pages off) the
memory is ordinary and nothing else changes. `KVPRESS_DISABLE_HUGE_PAGES=1` skips both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_kvpress_ext.utils.flags import env_flag

DISABLE_ENV = "KVPRESS_DISABLE_HUGE_PAGES"
MADV_HUGEPAGE = 14  # linux/mman.h
PR_GET_THP_DISABLE = 42  # linux/prctl.h
HUGE_PAGE_BYTES = 2 * 2**20
THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
SMAPS = Path("/proc/self/smaps")
BUDDYINFO = Path("/proc/buddyinfo")
_HUGE_PAGE_ORDER = 9  # a 2 MB block is 2^9 pages of 4 KB
_ALIGN = 64  # each parameter starts on a cache line
_RELEASE_EVERY_BYTES = 256 * 2**20


def disabled() -> bool:
    return env_flag(DISABLE_ENV)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = madvise
    return advise


def _release_free_heap() -> None:
    """`malloc_trim(0)`: glibc hands its free pages back now, where the engine's raised trim threshold
    (engine/host_allocator.py) would keep the weights' old blocks resident beside their copies."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def huge_page_span(address: int, size: int) -> tuple[int, int]:
    """The 2 MB-aligned part of `size` bytes at `address`, as (start, length); length 0 if none."""
    start = _round_up(address, HUGE_PAGE_BYTES)
    end = (address + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return start, max(0, end - start)


def _advised_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh, never-touched memory starting on a 2 MB boundary, advised `MADV_HUGEPAGE`, as
    a uint8 tensor (the mapping lives as long as any view of it); None where huge pages are not asked for
    (disabled, not Linux, under one huge page) or the advice is refused."""
    madvise = _madvise()
    if disabled() or madvise is None or nbytes < HUGE_PAGE_BYTES:
        return None
    # Private and anonymous: zero-filled, nothing resident yet. (mmap's default, MAP_SHARED, would be shmem,
    # whose huge pages follow another setting, shmem_enabled, usually never.)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    offset = _round_up(whole.data_ptr(), HUGE_PAGE_BYTES) - whole.data_ptr()
    tensor = whole[offset : offset + nbytes]
    start, length = huge_page_span(tensor.data_ptr(), nbytes)
    if madvise(start, length, MADV_HUGEPAGE) != 0:
        return None
    return tensor


def huge_page_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU, faulted in on 2 MB pages where Linux allows it."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    memory = _advised_bytes(nbytes)
    if memory is None:
        return torch.zeros(shape, dtype=dtype)
    # The mapping reads as zeros already; writing them faults every page in now, as 2 MB pages, so the
    # pool's memory is resident from startup and its first decode steps pay no faults.
    return memory.view(dtype).view(shape).zero_()


def move_to_huge_pages(module: nn.Module) -> torch.Tensor | None:
    """Copy the module's CPU parameters into one arena on 2 MB pages and point them at it; returns the
    arena (uint8), None if it was not made (disabled, advice refused, or under two huge pages).

    Parameters are replaced by views of the arena with the same values, shape and dtype; anything that
    held the old tensors keeps the old memory. Call it right after loading, before anything does.
    """
    params = [p for p in module.parameters() if p.is_cpu and p.is_contiguous()]
    sizes = [_round_up(p.numel() * p.element_size(), _ALIGN) for p in params]
    total = sum(sizes)
    if total < 2 * HUGE_PAGE_BYTES:
        return None
    arena = _advised_bytes(total)
    if arena is None:
        return None
    offset = 0
    since_release = 0
    for param, size in zip(params, sizes, strict=True):
        nbytes = param.numel() * param.element_size()
        place = arena[offset : offset + nbytes].view(param.dtype).view(param.shape)
        place.copy_(param.data)
        param.data = place
        offset += size
        since_release += size
        if since_release >= _RELEASE_EVERY_BYTES:  # the copies and the originals are never all resident
            _release_free_heap()
            since_release = 0
    _release_free_heap()
    return arena


def _thp_setting(name: str) -> str | None:
    """The selected word of a THP setting (`enabled`: always / madvise / never), None if unreadable."""
    try:
        chosen = re.search(r"\[(\w[\w+]*)\]", (THP_DIR / name).read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def thp_mode() -> str | None:
    return _thp_setting("enabled")


def thp_defrag() -> str | None:
    return _thp_setting("defrag")


def _thp_disabled_for_process() -> bool:
    """`prctl(PR_GET_THP_DISABLE)`: a container runtime or a parent can turn THP off for the process."""
    prctl = getattr(_libc(), "prctl", None)
    if prctl is None:
        return False
    prctl.restype = ctypes.c_int
    return bool(prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1)


def free_huge_blocks() -> int | None:
    """Free 2 MB blocks the kernel holds now, all zones (`/proc/buddyinfo`); None if unreadable."""
    try:
        lines = BUDDYINFO.read_text().splitlines()
    except OSError:
        return None
    blocks = 0
    for line in lines:
        counts = [int(v) for v in line.split()[4:]]  # "Node 0, zone Normal" then the count per order 0, 1, ...
        blocks += sum(count << (order - _HUGE_PAGE_ORDER) for order, count in enumerate(counts) if order >= 9)
    return blocks


@dataclass(frozen=True)
class HugePagePlacement:
    """Where a CPU tensor's memory lies: how much of its 2 MB-aligned span is resident on 2 MB pages."""

    span_bytes: int  # the tensor's 2 MB-aligned part: what could be on huge pages
    huge_bytes: int | None  # of it, on 2 MB pages, as /proc/self/smaps says; None where it cannot say
    reason: str | None  # why not all of the span is huge; None when it is

    @property
    def all_huge(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        mib = 2**20
        if self.all_huge:
            return f"{self.span_bytes / mib:.0f} MiB on 2 MB pages"
        huge = "?" if self.huge_bytes is None else f"{self.huge_bytes / mib:.0f}"
        return f"{huge} of {self.span_bytes / mib:.0f} MiB on 2 MB pages ({self.reason})"


def resident_huge_bytes(address: int, size: int) -> int | None:
    """Bytes of [address, address + size) in anonymous 2 MB pages, from `/proc/self/smaps` (the
    mappings that overlap the range, each counted only over the overlap); None if smaps is unreadable."""
    try:
        lines = SMAPS.read_text().splitlines()
    except OSError:
        return None
    end = address + size
    total, overlap = 0, 0
    for line in lines:
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            low, high = (int(v, 16) for v in head.groups())
            overlap = max(0, min(high, end) - max(low, address))
        elif overlap and line.startswith("AnonHugePages:"):
            total += min(int(line.split()[1]) * 1024, overlap)
    return total


def huge_page_placement(tensor: torch.Tensor) -> HugePagePlacement:
    """How much of a CPU tensor is on 2 MB pages, and, where not all of it, the first reason found."""
    start, span = huge_page_span(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    huge = resident_huge_bytes(start, span) if span else 0
    if huge is not None and span and huge >= span:
        return HugePagePlacement(span, huge, None)
    return HugePagePlacement(span, huge, _why_not_huge(span, huge))


def _why_not_huge(span: int, huge: int | None) -> str:
    if disabled():
        return f"{DISABLE_ENV} is set"
    if _madvise() is None:
        return "no madvise on this platform"
    if span == 0:
        return "smaller than one aligned 2 MB page"
    mode = thp_mode()
    if mode is None:
        return f"this kernel has no transparent huge pages ({THP_DIR} is missing)"
    if mode == "never":
        return f"transparent huge pages are off ({THP_DIR / 'enabled'}: never)"
    if _thp_disabled_for_process():
        return "transparent huge pages are turned off for this process (prctl PR_SET_THP_DISABLE)"
    if huge is None:
        return f"{SMAPS} is not readable, so it cannot be told"
    return (
        f"the kernel had too few free 2 MB blocks when the memory was faulted in (defrag: {thp_defrag()}, "
        f"{free_huge_blocks()} free now); free memory is fragmented, or the container's memory limit is near"
    )
