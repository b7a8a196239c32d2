"""`profile_xkv`: measure XKV's per-layer cache fractions by running sampled prompts through the engine.

It lives beside the benches rather than in `policies/xkv.py` because it drives an `LLMEngine`, and the
engine imports the policies: the policies depend only on the cache, attention and models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies.base import RequestPrefill
from vllm_kvpress_ext.policies.xkv import XKVPolicy, XKVProfile


@dataclass
class _RecordingXKV(XKVPolicy):
    """XKV that also records each request's allocation (for `profile_xkv`; not registered)."""

    records: list[tuple[list[int], int]] = field(default_factory=list, compare=False, repr=False)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        plan = super().plan(request, layer_results, state)
        self.records.append((list(state["allocation"]), int(state["capacity"])))
        return plan


def profile_xkv(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    target_ratio: float = 0.9,
    window: int = 8,
    kernel_size: int = 7,
    pooling: str = "avgpool",
    **engine_kwargs: Any,
) -> XKVProfile:
    """Run `prompts` (token ids) once each with XKV's R_avg mode and return the mean per-layer fractions.

    `kvpress profile xkv` calls this on sampled suite prompts; save the result with `XKVProfile.save`.
    """
    recorder = _RecordingXKV(target_ratio=target_ratio, window=window, kernel_size=kernel_size, pooling=pooling)
    recorder.validate()
    engine = LLMEngine(model_dir, **engine_kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(list(prompt), params, policy=recorder)
    while engine.has_unfinished_requests():
        engine.step()
    allocations = [a for a, _ in recorder.records]
    capacities = [c for _, c in recorder.records]
    return XKVProfile.from_allocations(
        allocations,
        capacities,
        window=window,
        kernel_size=kernel_size,
        pooling=pooling,
        metadata={"target_ratio": target_ratio, "model": str(model_dir)},
    )
