"""Environment report: what this install can run on, and which CPU paths it chose.

`kvpress info` prints `environment_report()`, the text to paste into a bug report. On the CPU the
engine logs `cpu_paths_summary()` once at startup. Every fast path that depends on the CPU is
chosen once per process and named here:

- ATen's vector kernels: the capability torch picked (`ATEN_CPU_CAPABILITY` can lower it);
- the model's projections (`models/linear.py`): oneDNN per dtype where it runs, else `F.linear`;
- the C++ decode and column-sum kernels (`attention/cpu_kernels.py`): the instruction set they were
  built for, or why they are off;
- transparent huge pages (`utils/huge_pages.py`): the kernel's mode, and where the memory landed.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
from pathlib import Path

import torch

from vllm_kvpress_ext.version import __version__

#: The /proc/cpuinfo flags that decide which vector code runs, in the order a reader expects them.
VECTOR_FEATURES = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
)
#: Environment variables that change what the CPU paths choose.
CPU_PATH_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "KVPRESS_DISABLE_ONEDNN_LINEAR",
    "KVPRESS_DISABLE_CPU_KERNELS",
    "KVPRESS_CPU_KERNEL_ARCH",
    "KVPRESS_DISABLE_HUGE_PAGES",
    "OMP_NUM_THREADS",
)


def triton_available() -> bool:
    """True when the `triton` package imports (kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_vector_features() -> list[str]:
    """This CPU's flags among `VECTOR_FEATURES` (empty off Linux/x86)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [feature for feature in VECTOR_FEATURES if feature in flags]


def onednn_version() -> str | None:
    found = re.search(r"MKL-DNN v(\S+)", torch.__config__.show())
    return found.group(1) if found else None


def projection_paths(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> str:
    """Which op runs the model's projections per dtype, e.g. `float32 oneDNN, bfloat16 oneDNN`."""
    from vllm_kvpress_ext.models import linear

    return ", ".join(f"{str(dtype).removeprefix('torch.')} {linear.path_for(dtype)}" for dtype in dtypes)


def cpu_kernel_status() -> str:
    from vllm_kvpress_ext.attention import cpu_kernels

    cpu_kernels.available()  # builds (or loads the cached build) on first call
    return cpu_kernels.status()


def cpu_paths_summary(dtype: torch.dtype, pool: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> str:
    """One line for the engine's startup log: the CPU paths a model in `dtype` runs on here."""
    from vllm_kvpress_ext.utils.huge_pages import huge_page_placement

    parts = [
        f"ATen {torch.backends.cpu.get_cpu_capability()}",
        f"projections {projection_paths((dtype,))}",
        f"C++ kernels {cpu_kernel_status()}",
    ]
    for name, tensor in (("weights", weights), ("KV pool", pool)):
        if tensor is not None:
            parts.append(f"{name} {huge_page_placement(tensor).describe()}")
    return "; ".join(parts)


def huge_page_report() -> str:
    from vllm_kvpress_ext.utils.huge_pages import (
        HUGE_PAGE_BYTES,
        huge_page_placement,
        huge_page_tensor,
        thp_defrag,
        thp_mode,
    )

    probe = huge_page_tensor((2 * HUGE_PAGE_BYTES,), torch.uint8)  # what a pool of 4 MiB would get
    return f"THP {thp_mode()}, defrag {thp_defrag()}; a 4 MiB pool: {huge_page_placement(probe).describe()}"


def environment_report() -> str:
    lines = [
        f"vllm-kvpress-ext {__version__}",
        f"python           {platform.python_version()} ({platform.machine()})",
        f"torch            {torch.__version__}",
        f"cuda available   {torch.cuda.is_available()}",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"  cuda:{index}         {props.name}, {props.total_memory / 2**30:.1f} GiB")
    if triton_available():
        import triton

        lines.append(f"triton           {triton.__version__}")
    else:
        lines.append("triton           not installed (install the `triton` extra for kernels)")
    lines += [
        f"cpu              {cpu_model()}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
        f"cpu features     {' '.join(cpu_vector_features()) or 'none of ' + ', '.join(VECTOR_FEATURES[:3])}",
        f"ATen kernels     {torch.backends.cpu.get_cpu_capability()}",
        f"oneDNN           {onednn_version() or 'not built in'}",
        f"projections      {projection_paths()}",
        f"C++ kernels      {cpu_kernel_status()}",
        f"huge pages       {huge_page_report()}",
    ]
    chosen = [f"{name}={os.environ[name]}" for name in CPU_PATH_ENV if os.environ.get(name)]
    lines.append(f"cpu path env     {' '.join(chosen) or '(none set)'}")
    return "\n".join(lines)
