"""The per-layer decode attention the engine hands decode-step policies equals transformers' attention.

A policy that evicts nothing records what every decode step gives it; transformers' eager attention
over the same tokens is the reference, layer by layer and query head by query head. Two requests of
different lengths share each decode batch, so a mix-up of layers or of batch rows shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import tiny_hf_model
from transformers import PreTrainedModel

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies.base import DecodeEviction, DecodeStep, KVPolicy

NEW_TOKENS = 6


@dataclass
class RecordingPolicy(KVPolicy):
    """Keeps everything; records each decode step's (position, per-layer positions, per-layer attention)."""

    steps: dict[str, list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]] = field(default_factory=dict)

    @property
    def wants_decode_steps(self) -> bool:
        return True

    @property
    def wants_decode_attention(self) -> bool:
        return True

    def on_decode_step(self, step: DecodeStep, state: dict[str, Any]) -> DecodeEviction | None:
        assert all(layer.attention is not None for layer in step.layers)
        self.steps.setdefault(step.request_id, []).append(
            (
                step.position,
                [layer.positions.clone() for layer in step.layers],
                [layer.attention.clone() for layer in step.layers],  # type: ignore[union-attr]
            )
        )
        return None


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    model = tiny_hf_model("llama3", seed=11)
    path = tmp_path_factory.mktemp("decode_attention")
    model.save_pretrained(path)
    model.set_attn_implementation("eager")  # the only implementation that returns attention weights
    return model, path


def test_each_layer_gets_its_own_decode_attention(model_pair: tuple[PreTrainedModel, Path]) -> None:
    model, path = model_pair
    policy = RecordingPolicy()
    engine = LLMEngine(path, dtype=torch.float32, num_pages=256, page_size=4)
    g = torch.Generator().manual_seed(4)
    prompts = {"short": torch.randint(0, 128, (9,), generator=g).tolist()}
    prompts["long"] = torch.randint(0, 128, (23,), generator=g).tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=request_id, policy=policy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    num_layers, hq = model.config.num_hidden_layers, model.config.num_attention_heads
    hkv = model.config.num_key_value_heads
    for request_id, prompt in prompts.items():
        tokens = prompt + outputs[request_id]
        with torch.no_grad():
            reference = model(input_ids=torch.tensor([tokens]), output_attentions=True).attentions
        steps = policy.steps[request_id]
        # Decode steps process the first NEW_TOKENS - 1 generated tokens (the last one is never fed back).
        assert [position for position, _, _ in steps] == list(range(len(prompt), len(prompt) + NEW_TOKENS - 1))
        for position, positions, attentions in steps:
            assert len(attentions) == num_layers
            for layer in range(num_layers):
                want = reference[layer][0, :, position, : position + 1]  # [Hq, position + 1] over positions
                got = attentions[layer]  # [Hkv, G, N] over the layer's entries
                assert got.shape[:2] == (hkv, hq // hkv)
                for kv_head in range(hkv):
                    held = positions[layer][kv_head]
                    assert sorted(held[held >= 0].tolist()) == list(range(position + 1))
                    entries = (held >= 0).nonzero().view(-1)
                    for g_index in range(hq // hkv):
                        q_head = kv_head * (hq // hkv) + g_index
                        torch.testing.assert_close(
                            got[kv_head, g_index, entries],
                            want[q_head, held[entries]],
                            atol=1e-5,
                            rtol=1e-4,
                            msg=f"{request_id} position {position} layer {layer} head {q_head}",
                        )
    assert engine.cache.pool.num_used == 0
