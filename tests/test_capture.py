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
        return CaptureSpec(window=self.window, hidden_stats=True, keys_pre_rope=True, query_lse=True)

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
    layers = request.seat.policy_state["layers"]
    assert len(layers) == 2
    for i, layer in enumerate(layers):
        ref = dense.captured[i]
        cap = layer.capture
        torch.testing.assert_close(cap.queries, ref.q[-6:], atol=1e-5, rtol=1e-5)
        assert cap.query_positions.tolist() == list(range(34, 40))
        # The log-sum-exps come from the prefill's own attention: flash on the first chunk, the paged path after.
        heads = ref.k.shape[1]
        logits = torch.einsum("qhd,khd->hqk", ref.q, ref.k.repeat_interleave(ref.q.shape[1] // heads, dim=1))
        causal = torch.ones(40, 40, dtype=torch.bool).tril()
        lse = torch.logsumexp((logits * layer.scale).masked_fill(~causal, float("-inf")), dim=-1).T  # [n, Hq]
        assert not cap.lse_missing
        torch.testing.assert_close(cap.query_lse, lse[-6:], atol=1e-5, rtol=1e-5)
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


def test_a_chunk_without_log_sum_exps_leaves_them_missing() -> None:
    """One chunk whose attention yielded none (a gated prefill) drops them for the request: no partial set."""
    from vllm_kvpress_ext.policies.capture import PrefillCapture

    capture = PrefillCapture(CaptureSpec(window=100, query_lse=True), num_layers=1)
    rows = torch.zeros(3, 4)

    def chunk(start: int, lse: torch.Tensor | None) -> None:
        q = torch.randn(3, 2, 4)
        capture.record(0, torch.arange(start, start + 3), rows, q, q[:, :1], q[:, :1], lse)

    chunk(0, torch.randn(3, 2))
    assert capture.layers[0].query_lse is not None and capture.layers[0].query_lse.shape == (3, 2)
    chunk(3, None)
    chunk(6, torch.randn(3, 2))
    assert capture.layers[0].query_lse is None and capture.layers[0].lse_missing
    assert capture.layers[0].queries is not None and capture.layers[0].queries.shape[0] == 9
