"""The model runner's public interface: a schedule in, logits out, per-request failures confined.

The embedded engine is one driver of `ModelRunner`; the vLLM worker is the other. These tests drive
the runner by hand and check that a request whose policy raises fails alone: the others in its
batch produce exactly the tokens they produce without it, and every page returns to the pool.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.model_runner import ModelRunner, Schedule, ScheduledChunk
from vllm_kvpress_ext.engine.request import Request, RequestStatus
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.policies.base import DecodeEviction, DecodeStep, LayerPrefill
from vllm_kvpress_ext.policies.h2o import H2OPolicy
from vllm_kvpress_ext.policies.snapkv import SnapKVPolicy
from vllm_kvpress_ext.policies.xkv import XKVPolicy
from vllm_kvpress_ext.server.engine_loop import EngineLoop, EngineStepError
from vllm_kvpress_ext.server.metrics import ServerMetrics

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MODEL = default_model_dir()


def prompts(count: int, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 200, (length + 7 * i,), generator=g).tolist() for i in range(count)]


@dataclass
class RaisingAtPrefill(SnapKVPolicy):
    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> Any:
        raise RuntimeError("scoring failed")


@dataclass
class RaisingInLayerwisePrefill(XKVPolicy):
    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> Any:
        if layer.layer == 1:
            raise RuntimeError("layer 1 failed")
        return super().on_layer_prefilled(layer, state)


@dataclass
class RaisingAtDecode(H2OPolicy):
    def on_decode_step(self, step: DecodeStep, state: dict[str, Any]) -> DecodeEviction | None:
        if step.position >= 45:
            raise RuntimeError("eviction failed")
        return super().on_decode_step(step, state)


def run(engine: LLMEngine, batch: list[tuple[list[int], Any]]) -> dict[str, Any]:
    for i, (prompt, policy) in enumerate(batch):
        engine.add_request(prompt, GREEDY, request_id=str(i), policy=policy)
    done: dict[str, Any] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return done


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(MODEL, num_pages=2000, max_num_batched_tokens=256)


def test_runner_driven_by_hand_matches_the_engine(engine: LLMEngine) -> None:
    prompt = prompts(1)[0]
    expected = run(engine, [(prompt, "snapkv")])["0"]
    runner = ModelRunner(MODEL, num_pages=500)
    request = Request("r", prompt, GREEDY, policy=load_policy("snapkv"))
    runner.start(request)
    # Two prefill chunks, then decodes, as a driver with a small token budget would schedule them.
    schedule = [
        Schedule(prefill=[ScheduledChunk(request, 0, 16)]),
        Schedule(prefill=[ScheduledChunk(request, 16, len(prompt))]),
    ]
    tokens: list[int] = []
    for step in range(2 + GREEDY.max_tokens - 1):
        plan = schedule[step] if step < 2 else Schedule(decode=[request])
        out = runner.execute(plan)
        assert not out.failed
        if out.logits is not None:
            assert out.sample == [request]
            tokens.append(int(out.logits.argmax(-1)[0]))
            request.output_token_ids.append(tokens[-1])
    assert step >= 1 and request.status is RequestStatus.RUNNING
    assert tokens == expected.output_token_ids
    runner.update_kv_stats(request)
    assert request.seat.kv.retention == pytest.approx(expected.kv.retention)
    runner.release(request)
    assert runner.cache.pool.num_used == 0


@pytest.mark.parametrize(
    "broken", [RaisingAtPrefill(ratio=0.5), RaisingInLayerwisePrefill(ratio=0.5), RaisingAtDecode()], ids=type
)
def test_a_raising_policy_fails_only_its_own_request(engine: LLMEngine, broken: Any) -> None:
    batch = prompts(3)
    healthy = run(engine, [(batch[0], "snapkv"), (batch[2], "full")])
    mixed = run(engine, [(batch[0], "snapkv"), (batch[1], broken), (batch[2], "full")])
    assert mixed["1"].finish_reason == "error"
    assert "RuntimeError" in (mixed["1"].error or "")
    assert mixed["0"].output_token_ids == healthy["0"].output_token_ids
    assert mixed["2"].output_token_ids == healthy["1"].output_token_ids
    assert mixed["0"].error is None and mixed["0"].finish_reason == "length"
    assert engine.cache.pool.num_used == 0


def test_the_server_loop_fails_only_the_request_whose_policy_raised(engine: LLMEngine) -> None:
    loop = EngineLoop(engine, ServerMetrics())
    loop.start()
    batch = prompts(2)

    async def serve() -> list[int]:
        bad = await loop.submit(batch[0], GREEDY, RaisingAtPrefill(ratio=0.5), time.monotonic())
        good = await loop.submit(batch[1], GREEDY, None, time.monotonic())
        with pytest.raises(EngineStepError, match="scoring failed"):
            async for _ in bad.updates():
                pass
        updates = [u async for u in good.updates()]
        assert updates[-1].finished and updates[-1].finish_reason == "length"
        return updates[-1].token_ids

    try:
        tokens = asyncio.run(serve())
    finally:
        loop.stop()
    assert tokens == run(engine, [(batch[1], "full")])["0"].output_token_ids
    assert engine.cache.pool.num_used == 0
