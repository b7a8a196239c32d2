"""WG-KV admission during a chunked prefill: what the gates do not admit leaves the cache with its chunk."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.model_runner import ModelRunner
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.models.write_gate import WriteGates

PAGE = 8
WINDOW = 16
PROMPT = 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("wgkv-chunked") / "model", hidden=64, max_positions=1024)


@pytest.fixture(scope="module")
def gates(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random gates spread widely around 0.5, so that about half the keys are admitted at tau 0.5."""
    config = load_config(model_dir)
    torch.manual_seed(7)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, init_bias=0.0)
    with torch.no_grad():
        gates.w2.normal_(0.0, 3.0)
    return gates.save(tmp_path_factory.mktemp("gates") / "random.wgkv.safetensors", {"local_window": WINDOW})


def prompt(seed: int = 0, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def cache_after_prefill(engine: LLMEngine, tokens: list[int], policy: Any) -> dict[str, Any]:
    """Every (layer, head, region)'s keys, values and positions once the prefill is over, and the page peak."""
    request_id = engine.add_request(
        tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), policy=policy
    )
    cache = engine.cache
    while not any(o.request_id == request_id for o in engine.step()):
        pass
    state = {
        (layer, head, region): cache.gather(request_id, layer, head, region)
        for layer in range(cache.num_layers)
        for head in range(cache.num_kv_heads)
        for region in ("global", "ring")
    }
    peak = cache.peak_pages(request_id)
    held = int(cache.pages_per_head(request_id).sum())
    output: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                output = list(o.output_token_ids)
    return {"state": state, "peak": peak, "held": held, "output": output}


def run(model_dir: Path, gates: Path, chunk: int, tokens: list[int], **policy: Any) -> dict[str, Any]:
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE, max_num_batched_tokens=chunk)
    return cache_after_prefill(engine, tokens, {"name": "wgkv", "gates": str(gates), "tau": 0.5, **policy})


@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 64, 99, 100])
def test_chunkwise_admission_gives_exactly_the_prefill_completion_cache(
    model_dir: Path, gates: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(chunk)
    with monkeypatch.context() as patch:
        # The prefill-completion path: every chunk written whole, admission applied once by `start_ring`.
        patch.setattr(ModelRunner, "_drop_unadmitted", lambda self, request: None)
        whole = run(model_dir, gates, chunk, tokens)
    chunked = run(model_dir, gates, chunk, tokens)
    assert chunked["state"].keys() == whole["state"].keys()
    for key, (keys, values, positions) in whole["state"].items():
        got_keys, got_values, got_positions = chunked["state"][key]
        assert torch.equal(got_positions, positions), key
        assert torch.equal(got_keys, keys), key  # bit for bit: the dropped keys were never attended to
        assert torch.equal(got_values, values), key
    assert chunked["output"] == whole["output"]
    assert chunked["held"] == whole["held"]
    # Some keys were admitted, some not: the test exercises both (else both paths are trivially equal).
    admitted_old = sum(len(p) for (_, _, region), (_, _, p) in whole["state"].items() if region == "global")
    assert 0 < admitted_old < (PROMPT - WINDOW) * len(whole["state"]) // 2
    if chunk < PROMPT - WINDOW:
        assert chunked["peak"] < whole["peak"]  # the saving happens during the prefill, not after it
    else:
        assert chunked["peak"] == whole["peak"]  # one chunk (or a last chunk reaching into the window)
