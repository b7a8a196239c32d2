"""Gemma 3 in the embedded engine: its sliding-window layers live in a ring of exactly their window.

A random Gemma 3 checkpoint (written here with transformers: two sliding layers of window 8, two global
layers, GQA) runs prompts several windows long. With the full cache the engine's greedy tokens are
transformers', whether the prompt runs as one chunk or as chunks shorter than the window. Under every
policy, right after compression and when the request finishes, each sliding layer holds exactly the
last `window` positions, every global entry is a position the request wrote, and every page comes back.
WG-KV's local ring and admission apply to the global layers only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import hf_greedy, randomised, write_random_gates, write_suite_gemma3
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel

from vllm_kvpress_ext.engine import LLM, KeptEntries, LLMEngine, SamplingParams
from vllm_kvpress_ext.models.write_gate import WriteGates
from vllm_kvpress_ext.policies.registry import create_policy, policy_names
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY

WINDOW = 8
PAGE_SIZE = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SLIDING = [i for i, kind in enumerate(LAYER_TYPES) if kind == "sliding_attention"]
GLOBAL = [i for i, kind in enumerate(LAYER_TYPES) if kind == "full_attention"]
NEW_TOKENS = 6
POLICIES = [name for name in policy_names()]
GATE_WINDOW = 8  # WG-KV's local ring (a multiple of the page size)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    model, path = write_suite_gemma3(tmp_path_factory.mktemp("gemma3"), window=WINDOW, layer_types=tuple(LAYER_TYPES))
    write_random_gates(path, GATE_WINDOW)  # WG-KV's gates, beside the model, where they are found by default
    return model, path


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, len(VOCABULARY), (length,), generator=g).tolist()


@pytest.mark.parametrize("chunk", [2048, 5])
def test_full_cache_greedy_tokens_equal_transformers(gemma: tuple[PreTrainedModel, Path], chunk: int) -> None:
    model, path = gemma
    batch = [prompt(45, 0), prompt(23, 1)]
    engine = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=PAGE_SIZE, max_num_batched_tokens=chunk)
    for i, ids in enumerate(batch):
        engine.add_request(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), request_id=str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    for i, ids in enumerate(batch):
        assert outputs[str(i)] == hf_greedy(model, ids, 12), f"prompt {i}, chunk {chunk}"
    assert engine.cache.pool.num_used == 0


def assert_sliding_layers_hold_their_window(kept: KeptEntries, written: int) -> None:
    last = list(range(written - WINDOW, written))
    heads = kept.lengths.shape[1]
    for layer in SLIDING:
        for head in range(heads):
            assert kept.head(layer, head) == last, f"layer {layer} head {head}"


def assert_global_entries_in_range(kept: KeptEntries, written: int) -> None:
    for layer in GLOBAL:
        for head in range(kept.lengths.shape[1]):
            held = kept.head(layer, head)
            assert len(set(held)) == len(held) and all(0 <= p < written for p in held)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_leaves_sliding_layers_their_window(gemma: tuple[PreTrainedModel, Path], name: str) -> None:
    _, path = gemma
    llm = LLM(path, dtype=torch.float32, num_pages=1024, page_size=PAGE_SIZE, max_num_batched_tokens=32)
    batch = [prompt(64, 2), prompt(50, 3)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True)
    outputs = llm.generate(batch, params, policy=name)
    for ids, out in zip(batch, outputs, strict=True):
        assert out.error is None and len(out.output_token_ids) == NEW_TOKENS
        at_compression, at_end = out.kv.kept_at_compression, out.kv.kept
        assert at_end is not None
        written = len(ids) + NEW_TOKENS - 1  # the last sampled token never enters the cache
        assert_sliding_layers_hold_their_window(at_end, written)
        assert_global_entries_in_range(at_end, written)
        if create_policy(name).compresses:
            assert at_compression is not None
            assert_sliding_layers_hold_their_window(at_compression, len(ids))
            assert_global_entries_in_range(at_compression, len(ids))
            assert int(at_compression.counts[GLOBAL].sum()) < len(GLOBAL) * 2 * len(ids), "nothing was compressed"
    assert llm.engine.cache.pool.num_used == 0


@pytest.mark.parametrize("chunk", [2048, 16])
def test_wgkv_rings_the_global_layers_and_leaves_the_sliding_ones_their_window(
    gemma: tuple[PreTrainedModel, Path], chunk: int
) -> None:
    """WG-KV (random gates, about half the keys admitted): a global layer holds the last `GATE_WINDOW` positions
    in its local ring and only admitted older ones, fewer than the prompt; a sliding layer holds its window and
    no local ring, with the prompt whole or in chunks shorter than the window."""
    _, path = gemma
    llm = LLM(path, dtype=torch.float32, num_pages=1024, page_size=PAGE_SIZE, max_num_batched_tokens=chunk)
    batch = [prompt(64, 2), prompt(50, 3)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True)
    outputs = llm.generate(batch, params, policy={"name": "wgkv", "tau": 0.5})
    for ids, out in zip(batch, outputs, strict=True):
        assert out.error is None and len(out.output_token_ids) == NEW_TOKENS
        kept = out.kv.kept_at_compression
        assert kept is not None
        assert_sliding_layers_hold_their_window(kept, len(ids))
        assert bool((kept.ring_positions[SLIDING] == -1).all())
        recent = list(range(len(ids) - GATE_WINDOW, len(ids)))
        for layer in GLOBAL:
            for head in range(kept.lengths.shape[1]):
                assert sorted(kept.ring_positions[layer, head].tolist()) == recent
                older = kept.positions[layer, head, : int(kept.lengths[layer, head])].tolist()
                assert all(0 <= p < len(ids) - GATE_WINDOW for p in older)
        admitted = int(kept.lengths[GLOBAL].sum())
        assert 0 < admitted < len(GLOBAL) * 2 * (len(ids) - GATE_WINDOW)  # the gates admit some, not all
        written = len(ids) + NEW_TOKENS - 1
        assert out.kv.kept is not None
        assert_sliding_layers_hold_their_window(out.kv.kept, written)
        assert_global_entries_in_range(out.kv.kept, written)
    assert llm.engine.cache.pool.num_used == 0


def test_wgkv_with_every_gate_open_is_exactly_full_attention(
    gemma: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    """Gates that admit every key: the global layers' vertical-slash mask is causal and the ring promotes every
    token, so WG-KV gives transformers' greedy tokens on a model with sliding-window layers too."""
    model, path = gemma
    config = json.loads((path / "config.json").read_text())
    gates = WriteGates(config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])
    with torch.no_grad():
        gates.w2.zero_()
        gates.b2.fill_(10.0)  # g = sigmoid(10) > tau for every key
    gate_file = gates.save(tmp_path / "open.wgkv.safetensors", {"local_window": GATE_WINDOW})
    engine = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=PAGE_SIZE, max_num_batched_tokens=16)
    ids = prompt(45, 4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request(ids, params, request_id="open", policy={"name": "wgkv", "gates": str(gate_file)})
    output: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                output = out.output_token_ids
    assert output == hf_greedy(model, ids, 12)
    assert engine.cache.pool.num_used == 0


def test_a_model_whose_every_layer_slides_runs_every_policy_as_full(tmp_path: Path) -> None:
    """Mistral 7B v0.1's shape: every layer slides, so no layer is a policy's and the ring bounds the cache."""
    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
    )
    model = randomised(MistralForCausalLM(config), seed=6)
    model.save_pretrained(tmp_path)
    ids = [t % 128 for t in prompt(40, 7)]
    expected = hf_greedy(model, ids, 10)
    llm = LLM(tmp_path, dtype=torch.float32, num_pages=256, page_size=PAGE_SIZE)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, return_kept=True)
    for policy in ("full", "snapkv", "h2o", "wgkv"):  # a write gate needs no gates here: no global layer
        (out,) = llm.generate([ids], params, policy=policy)
        assert out.output_token_ids == expected, policy
        assert out.kv.kept is not None and out.kv.kept.per_layer == [2 * WINDOW] * 2
    assert llm.engine.cache.pool.num_used == 0


def test_gate_training_serves_the_sliding_windows_and_gates_the_global_layers(
    gemma: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    """`kvpress train-gate` distils from the model as it is served: its training attention (each sliding layer
    within its window, the model's softmax scale) gives transformers' final hidden states on sequences longer
    than the window, which attending to the whole prefix would not. The gates are trained and measured in the
    global layers only, since a sliding layer keeps its window ungated."""
    from vllm_kvpress_ext.models import load_model
    from vllm_kvpress_ext.train.gate import GateTrainConfig, train_gates
    from vllm_kvpress_ext.train.model import BatchedCausalContext

    model, path = gemma
    ours = load_model(path, dtype=torch.float32)
    config = ours.config
    batch, length = 2, 5 * WINDOW
    ids = torch.stack([torch.tensor(prompt(length, seed)) for seed in (1, 2)])
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states[-1]

        def hidden(context: BatchedCausalContext) -> torch.Tensor:
            return ours(ids.reshape(-1), torch.arange(length).repeat(batch), context).view(batch, length, -1)

        served = hidden(BatchedCausalContext(batch, length, config.layer_windows, config.attention_scale))
        unwindowed = hidden(BatchedCausalContext(batch, length, (), config.attention_scale))
    torch.testing.assert_close(served, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unwindowed, expected, atol=1e-3)
    out = tmp_path / "gemma.wgkv.safetensors"
    train = GateTrainConfig(
        model_dir=str(path),
        out=str(out),
        steps=2,
        batch_size=2,
        context_len=64,
        local_window=GATE_WINDOW,
        eval_samples=2,
        tasks={"niah_multikey": 1.0},
    )
    _, summary = train_gates(train, progress=False)
    assert summary["gated_layers"] == GLOBAL
    per_layer = summary["admitted_per_layer_head"]
    assert all(
        per_layer[layer] == [1.0] * config.num_key_value_heads for layer in range(len(per_layer)) if layer not in GLOBAL
    )
    assert 0.0 <= summary["admitted_fraction"] <= 1.0
