"""The request limits both servers enforce: vLLM's own, so a request `vllm serve` takes `kvpress serve` takes too.

vLLM reads three of them from the environment (`vllm/envs.py`); they are read here from the same variables,
with vLLM's defaults, so that an operator who raises one raises it for both servers. The rest are bounds vLLM
writes into its request checks (`vllm/sampling_params.py`).
"""

from __future__ import annotations

import os


def _from_env(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


# Read once, when the server starts (a bad value stops it there, naming the variable), not on every request.
#: `n`, samples per prompt (`VLLM_MAX_N_SEQUENCES`).
MAX_SAMPLES = _from_env("VLLM_MAX_N_SEQUENCES", 16384)
#: Prompts in one completions request (`VLLM_MAX_COMPLETION_PROMPTS`).
MAX_PROMPTS = _from_env("VLLM_MAX_COMPLETION_PROMPTS", 1024)
#: Strings in `stop` (`VLLM_MAX_STOP_STRINGS`).
MAX_STOP_STRINGS = _from_env("VLLM_MAX_STOP_STRINGS", 4)
#: `temperature` lies in [0, MAX_TEMPERATURE].
MAX_TEMPERATURE = 2.0
