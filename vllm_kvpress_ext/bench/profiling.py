"""Where a stretch of engine work goes, from `torch.profiler`: device time, launches, host syncs, host ops.

Shared by `kvpress bench decode-step` (a decode step) and `kvpress bench policies --profile` (a policy's
compression). The counts are what make a GPU step slower than its bytes allow:
- device busy: the summed time of the device's kernels and copies (on a CPU: the summed self time of
  torch's ops, which run on the calling thread; the project's C++ attention kernels are called outside
  torch's dispatcher and are not in it);
- launches: kernel launches (CUDA only);
- host syncs: the device-to-host waits (`cudaStreamSynchronize`, `cudaMemcpy`, `.item()` and friends),
  each a point where the host stops issuing work until the device catches up;
- the host ops with most self time: what a launch-bound stretch spends its time on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

HOST_SYNC_EVENTS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def profiled(device: torch.device, into: list[Any]) -> Iterator[None]:
    """Profile the block on `device`; its `key_averages()` is appended to `into` when the block ends."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities, acc_events=True) as prof:
        yield
        sync(device)
    into.append(prof.key_averages())


def summarize(events: Any, per: int, on_cuda: bool, top: int = 5) -> dict[str, Any]:
    """Per-`per` (steps, requests) figures from a profile's `key_averages()`."""
    if on_cuda:
        busy_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
    else:
        busy_us = sum(e.self_cpu_time_total for e in events)
    syncs = sum(e.count for e in events if e.key.startswith(HOST_SYNC_EVENTS))
    launches = sum(e.count for e in events if e.key in LAUNCH_EVENTS)
    host_ops = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total)
    return {
        "device_busy_ms": busy_us / 1000.0 / per,
        "launches": launches / per,
        "host_syncs": syncs / per,
        "top_host_ops": [(e.key, e.self_cpu_time_total / 1000.0 / per) for e in reversed(host_ops[-top:])],
    }


def wrap_profiled(obj: Any, method: str, device: torch.device, into: list[Any]) -> Callable[[], None]:
    """Profile every call of `obj.method` (appending to `into`); returns the function that undoes it."""
    original = getattr(obj, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with profiled(device, into):
            return original(*args, **kwargs)

    setattr(obj, method, wrapper)
    return lambda: setattr(obj, method, original)


def format_top_ops(ops: list[tuple[str, float]]) -> str:
    return ", ".join(f"{key} {ms:.2f} ms" for key, ms in ops)
