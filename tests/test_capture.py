"""Prefill capture records exactly what the model computed, and costs nothing when no policy asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from model_utils import DenseContext, tiny_hf_model

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine import model_runner as engine_module
from vllm_kvpress_ext.models import load_model
from vllm_kvpress_ext.policies.base import KVPolicy, LayerPrefill
from vllm_kvpress_ext.policies.capture import CaptureSpec


@dataclass
class Recorder(KVPolicy):
    """Keeps everything, records what each layer was given."""

    name = "recorder"
    window: int = 6

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(window=self.window, hidden_stats=True, keys_pre_rope=True)

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> None:
        state.setdefault("layers", []).append(layer)


@pytest.mark.parametrize("chunk", [1000, 9])
def test_capture_matches_the_dense_forward(tmp_path, chunk: int) -> None:  # type: ignore[no-untyped-def]
    hf = tiny_hf_model("qwen3", seed=3)
    hf.save_pretrained(tmp_path)
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    model = load_model(tmp_path)
    dense = DenseContext([40])
    with torch.no_grad():
        model(prompt, torch.arange(40), dense)

    engine = LLMEngine(tmp_path, dtype=torch.float32, num_pages=256, page_size=4, max_num_batched_tokens=chunk)
    policy = Recorder()
    engine.add_request(prompt.tolist(), SamplingParams(max_tokens=1, temperature=0), request_id="r", policy=policy)
    request = engine.requests["r"]
    while engine.has_unfinished_requests():
        engine.step()
    layers = request.policy_state["layers"]
    assert len(layers) == 2
    for i, layer in enumerate(layers):
        ref = dense.captured[i]
        cap = layer.capture
        torch.testing.assert_close(cap.queries, ref.q[-6:], atol=1e-5, rtol=1e-5)
        assert cap.query_positions.tolist() == list(range(34, 40))
        torch.testing.assert_close(cap.hidden_mean, ref.hidden.double().mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cap.hidden_var, ref.hidden.double().var(0, unbiased=False), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(cap.keys_pre_rope), ref.k_pre_rope, atol=1e-5, rtol=1e-5)
        # Keys and values handed to the policy are the cached ones, i.e. the model's post-RoPE keys.
        torch.testing.assert_close(layer.keys, ref.k.transpose(0, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.v.transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert layer.positions.tolist() == list(range(40))


def test_no_capture_without_a_policy(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tiny_hf_model("llama3").save_pretrained(tmp_path)
    created = []
    original = engine_module.PrefillCapture

    def spy(*args: Any, **kwargs: Any) -> Any:
        created.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_module, "PrefillCapture", spy)
    engine = LLMEngine(tmp_path, dtype=torch.float32, num_pages=256, page_size=4)
    for policy in (None, "full"):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=2, temperature=0), policy=policy)
    while engine.has_unfinished_requests():
        engine.step()
    assert not created
    engine.add_request(list(range(30)), SamplingParams(max_tokens=2, temperature=0), policy=Recorder())
    while engine.has_unfinished_requests():
        engine.step()
    assert created


def test_capture_spec_merge_takes_the_union() -> None:
    a = CaptureSpec(window=4, hidden_stats=True)
    b = CaptureSpec(window=9, keys_pre_rope=True)
    assert a.merge(b) == b.merge(a) == CaptureSpec(window=9, hidden_stats=True, keys_pre_rope=True)
    assert CaptureSpec().merge(CaptureSpec()) == CaptureSpec() and CaptureSpec().empty
    assert not CaptureSpec(keys_pre_rope=True).empty and not CaptureSpec(hidden_stats=True).empty
