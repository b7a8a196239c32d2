"""Environment report: what this install can run on."""

from __future__ import annotations

import importlib.util
import platform

import torch

from vllm_kvpress_ext import __version__


def triton_available() -> bool:
    """True when the `triton` package imports (kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


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
    return "\n".join(lines)
