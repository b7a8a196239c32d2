"""When the plugin's platform takes over vLLM, decided deliberately.

vLLM lets an out-of-tree platform plugin win over every built-in platform, CUDA included, so merely
installing this package must not hijack a GPU user's `vllm serve` that did not ask for compression.
The rule, from `KVPRESS_VLLM` (default `auto`):

- `off`: never; vLLM behaves as if the package were not installed.
- `on`: always (the CUDA variant where CUDA is present, the CPU platform elsewhere).
- `auto`: when the command line asks for compression (`--kv-policy`, or `kv_policy` inside
  `--additional-config`); otherwise only where no built-in vLLM platform can run (a CPU-only host
  with vLLM's CUDA wheel, like the one this project tests on), since vLLM could not serve there at all.

Once activated in the first process, the decision is written to the environment so that vLLM's
engine-core and worker processes, which resolve the platform again, make the same one.
"""

from __future__ import annotations

import os
import sys

ENV = "KVPRESS_VLLM"
CPU_PLATFORM = "vllm_kvpress_ext.vllm_plugin.platform.KVPressCpuPlatform"
CUDA_PLATFORM = "vllm_kvpress_ext.vllm_plugin.cuda_platform.KVPressCudaPlatform"
_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    if value in ("", "auto"):
        return "auto"
    raise ValueError(f"{ENV} must be auto, on or off, got {value!r}")


def compression_requested(argv: list[str]) -> bool:
    """Whether a command line asks for a KV policy (`--kv-policy X`, `--kv-policy=X`, or in `--additional-config`)."""
    for i, arg in enumerate(argv):
        if arg == "--kv-policy" or arg.startswith("--kv-policy="):
            return True
        if arg.startswith("--additional-config"):
            value = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            if "kv_policy" in value:
                return True
    return False


def _cuda_present() -> bool:
    from vllm.platforms import cuda_platform_plugin  # NVML-based: does not initialise CUDA before vLLM forks

    return cuda_platform_plugin() is not None


def _builtin_cpu_platform_works() -> bool:
    from vllm.platforms import cpu_platform_plugin

    return cpu_platform_plugin() is not None


def platform_to_activate() -> str | None:
    """The plugin platform's qualified name, or None to leave vLLM's platform choice untouched."""
    chosen = mode()
    if chosen == "off":
        return None
    cuda = _cuda_present()
    if chosen == "auto" and not compression_requested(sys.argv) and (cuda or _builtin_cpu_platform_works()):
        return None
    os.environ[ENV] = "on"  # child processes re-resolve the platform; they must agree
    return CUDA_PLATFORM if cuda else CPU_PLATFORM


def plugin_active() -> bool:
    try:
        return platform_to_activate() is not None
    except Exception:  # a broken probe must not break vLLM for someone who did not ask for the plugin
        return False
