"""WG-KV: write gates, vertical-slash prefill, the engine's ring + global cache, composition, training."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model
from safetensors import SafetensorError

from vllm_kvpress_ext.attention import causal_attention, vertical_slash_attention
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models.write_gate import (
    WriteGates,
    default_gate_path,
    gate_metadata,
    load_gates,
    write_gated_attention,
)
from vllm_kvpress_ext.policies import PolicyConfigError, WGKVPolicy, load_policy
from vllm_kvpress_ext.policies.base import DecodeLayer, DecodeStep, RequestPrefill
from vllm_kvpress_ext.policies.wgkv import GateAdmission

PAGE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("wgkv") / "model", hidden=64, max_positions=1024)


def constant_gates(path: Path, model_dir: Path, value_logit: float, window: int = 16) -> Path:
    """Gates whose output is sigmoid(value_logit) for every token (w2 = 0)."""
    from vllm_kvpress_ext.models import load_config

    config = load_config(model_dir)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    with torch.no_grad():
        gates.w2.zero_()
        gates.b2.fill_(value_logit)
    return gates.save(path, {"local_window": window})


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


def generate(engine: LLMEngine, token_lists: list[list[int]], policy: Any, max_tokens: int = 12) -> list[list[int]]:
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), policy=policy)
        for p in token_lists
    ]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.output_token_ids
    return [out[i] for i in ids]


# ---------------------------------------------------------------------- gates and the attention math


def test_gates_round_trip_and_shape_checks(tmp_path: Path) -> None:
    gates = WriteGates(3, 2, 16)
    assert gates.hidden == 64  # 4 x head_dim: the paper's ~0.4% of an 8B model, see the module docstring
    path = gates.save(tmp_path / "m.wgkv.safetensors", {"local_window": 32, "lambda": 0.1})
    loaded = load_gates(path)
    k_pre, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    assert torch.equal(loaded(1, k_pre, k), gates(1, k_pre, k).detach())
    assert gate_metadata(path)["local_window"] == 32
    with pytest.raises(ValueError, match="layers, KV heads, head_dim"):
        loaded.check_model(4, 2, 16)
    with pytest.raises(FileNotFoundError, match="train-gate"):
        load_gates(tmp_path / "missing.safetensors")
    (tmp_path / "other.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SafetensorError, match="deserializing header"):
        load_gates(tmp_path / "other.safetensors")
    assert default_gate_path(tmp_path / "model").name == "model.wgkv.safetensors"
    assert default_gate_path(tmp_path / "model").parent == tmp_path.resolve()


def test_gate_values_lie_in_unit_interval() -> None:
    g = WriteGates(2, 4, 8)(0, torch.randn(100, 4, 8) * 30, torch.randn(100, 4, 8))
    assert g.shape == (100, 4) and bool(((g >= 0) & (g <= 1)).all())


@pytest.mark.parametrize("group", [1, 4])
def test_vertical_slash_equals_write_gated_attention_with_binary_gates(group: int) -> None:
    torch.manual_seed(0)
    n, hkv, d, window = 37, 2, 16, 5
    q = torch.randn(1, n, hkv * group, d)
    k, v = torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
    admitted = torch.rand(hkv, n) < 0.3
    soft = write_gated_attention(q, k, v, admitted.T.float().unsqueeze(0), window, d**-0.5, eps=0.0)
    hard = vertical_slash_attention(q[0], k[0], v[0], admitted, window, d**-0.5)
    torch.testing.assert_close(hard, soft[0], atol=1e-5, rtol=1e-5)
    # A chunk of queries (later prefill chunk) is the matching slice of the whole.
    part = vertical_slash_attention(q[0, 20:], k[0], v[0], admitted, window, d**-0.5, query_start=20)
    torch.testing.assert_close(part, hard[20:], atol=1e-6, rtol=1e-6)


def test_all_admitted_or_wide_window_is_causal_attention() -> None:
    torch.manual_seed(1)
    n, d = 24, 8
    q, k, v = torch.randn(n, 4, d), torch.randn(n, 2, d), torch.randn(n, 2, d)
    causal = causal_attention(q[None], k[None], v[None], d**-0.5)[0]
    everything = torch.ones(2, n, dtype=torch.bool)
    torch.testing.assert_close(vertical_slash_attention(q, k, v, everything, 3, d**-0.5), causal, atol=1e-5, rtol=0)
    nothing = torch.zeros(2, n, dtype=torch.bool)
    torch.testing.assert_close(vertical_slash_attention(q, k, v, nothing, n, d**-0.5), causal, atol=1e-5, rtol=0)
    ones = torch.ones(1, n, 2)
    soft = write_gated_attention(q[None], k[None], v[None], ones, 3, d**-0.5)[0]
    torch.testing.assert_close(soft, causal, atol=1e-5, rtol=0)


def test_vertical_slash_rejects_bad_inputs() -> None:
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="window"):
        vertical_slash_attention(q, k, k, torch.ones(1, 4, dtype=torch.bool), 0, 1.0)
    with pytest.raises(ValueError, match="admitted"):
        vertical_slash_attention(q, k, k, torch.ones(2, 4, dtype=torch.bool), 2, 1.0)
    with pytest.raises(ValueError, match="positions"):
        vertical_slash_attention(q, k, k, torch.ones(1, 4, dtype=torch.bool), 2, 1.0, query_start=1)


# ---------------------------------------------------------------------- policy configuration


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"tau": 1.5}, "tau"),
        ({"local_window": 0}, "local_window"),
        ({"cap": 0}, "cap"),
        ({"evict_fraction": 0.0}, "evict_fraction"),
        ({"pooling": "median"}, "pooling"),
    ],
)
def test_bad_policy_parameters(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy({"name": "wgkv", **params})


def test_engine_rejects_gates_for_another_model(tmp_path: Path, model_dir: Path) -> None:
    gates = WriteGates(5, 2, 16).save(tmp_path / "g.safetensors")
    engine = LLMEngine(model_dir, num_pages=64, page_size=PAGE)
    with pytest.raises(ValueError, match="write gates"):
        engine.add_request([11, 12, 13], policy={"name": "wgkv", "gates": str(gates)})
    ok = constant_gates(tmp_path / "ok.safetensors", model_dir, 5.0)
    with pytest.raises(ValueError, match="multiple of the page size"):
        engine.add_request([11, 12, 13], policy={"name": "wgkv", "gates": str(ok), "local_window": 12})
    with pytest.raises(ValueError, match="no write gates"):  # a 400 over HTTP, and no path in it
        engine.add_request([11, 12, 13], policy="wgkv")  # no gates beside this model directory


# ---------------------------------------------------------------------- engine: exactness


@pytest.mark.parametrize("chunk", [None, 40])
def test_all_gates_one_is_exactly_full_attention(tmp_path: Path, model_dir: Path, chunk: int | None) -> None:
    gates = constant_gates(tmp_path / "ones.safetensors", model_dir, 100.0)  # sigmoid(100) == 1.0 in fp32
    batched = 4096 if chunk is None else chunk
    token_lists = prompts(3, 90)
    full = generate(
        LLMEngine(model_dir, num_pages=256, page_size=PAGE, max_num_batched_tokens=batched), token_lists, "full"
    )
    engine = LLMEngine(model_dir, num_pages=256, page_size=PAGE, max_num_batched_tokens=batched)
    gated = generate(engine, token_lists, {"name": "wgkv", "gates": str(gates), "local_window": 16})
    assert gated == full


def test_window_covering_the_sequence_is_exactly_full_attention(tmp_path: Path, model_dir: Path) -> None:
    gates = constant_gates(tmp_path / "zeros.safetensors", model_dir, -100.0)  # nothing admitted
    token_lists = prompts(2, 50, seed=3)
    full = generate(LLMEngine(model_dir, num_pages=256, page_size=PAGE), token_lists, "full", max_tokens=10)
    gated = generate(
        LLMEngine(model_dir, num_pages=256, page_size=PAGE),
        token_lists,
        {"name": "wgkv", "gates": str(gates), "local_window": 64},
        max_tokens=10,
    )
    assert gated == full


# ---------------------------------------------------------------------- engine: lazy promotion


@dataclass
class RecordingAdmission:
    """Admits a token when its pre-RoPE key sums above 0 in that head; records every decision by position."""

    window: int
    flags_by_layer: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def flags(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        flags = k_pre_rope.float().sum(-1) > 0.0  # [n, H], content-dependent, roughly half admitted
        self.flags_by_layer.setdefault(layer, []).append(flags)
        return flags


@dataclass
class RecordingWGKV(WGKVPolicy):
    recorder: Any = None

    def admission(self, model_dir: str | Path, device: torch.device, gate_store: Any = None) -> Any:
        return self.recorder


def test_lazy_promotion_keeps_admitted_plus_last_window(model_dir: Path) -> None:
    window, prompt_len, steps = 16, 70, 220
    recorder = RecordingAdmission(window)
    policy = RecordingWGKV(recorder=recorder)
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE)
    request_id = engine.add_request(
        prompts(1, prompt_len)[0], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), policy=policy
    )
    cache = engine.cache
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if request_id not in engine.requests or engine.requests[request_id].seat.num_processed < prompt_len:
            continue
        seen = engine.requests[request_id].seat.num_processed  # tokens whose K/V are in the cache
        for layer, chunks in recorder.flags_by_layer.items():
            flags = torch.cat(chunks)  # [seen, H]: prompt then one row per decode step
            assert flags.shape[0] == seen
            for head in range(flags.shape[1]):
                _, _, global_pos = cache.gather(request_id, layer, head, "global")
                _, _, ring_pos = cache.gather(request_id, layer, head, "ring")
                expected_global = {p for p in range(max(0, seen - window)) if bool(flags[p, head])}
                assert set(global_pos.tolist()) == expected_global
                assert sorted(ring_pos.tolist()) == list(range(max(0, seen - window), seen))
        usage = cache.usage(request_id)
        held_pages = int(((usage.global_tokens + PAGE - 1) // PAGE).sum()) + cache.num_layers * cache.num_kv_heads * (
            window // PAGE
        )
        assert cache.pool.num_pages - cache.pool.num_free == held_pages  # freed exactly what it dropped
        checked += 1
    assert checked >= steps - 1
    assert cache.pool.num_free == cache.pool.num_pages  # every page back at the end


# ---------------------------------------------------------------------- composition with eviction


def test_composition_holds_the_cap_and_counts_triggers(tmp_path: Path, model_dir: Path) -> None:
    gates = constant_gates(tmp_path / "ones.safetensors", model_dir, 100.0)
    cap, window = 20, 16
    policy = {"name": "wgkv", "gates": str(gates), "local_window": window, "cap": cap}
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE)
    request_id = engine.add_request(
        prompts(1, 80)[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), policy=policy
    )
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
        if request_id in engine.requests and engine.requests[request_id].seat.policy_state:
            usage = engine.cache.usage(request_id)
            assert bool((usage.global_tokens.float().mean(-1) <= cap).all())  # average per head, every layer
    assert final is not None and final.finished
    # Prefill cut once per layer; then every layer went over the cap again within 60 promotions.
    assert final.kv.counters["eviction_triggers"] > engine.config.num_hidden_layers
    # A prompt the ring holds whole leaves an empty global region: nothing to score, nothing to cut.
    short = engine.add_request([11, 12, 13], SamplingParams(max_tokens=40, temperature=0.0), policy=policy)
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final.request_id == short and final.finished and final.kv.counters["eviction_triggers"] >= 1
    assert engine.cache.pool.num_used == 0


def test_composition_with_layers_that_admit_differently(model_dir: Path) -> None:
    cap, window = 12, 16
    policy = RecordingWGKV(recorder=RecordingAdmission(window), local_window=window, cap=cap)
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE)
    engine.add_request(prompts(1, 90, seed=5)[0], SamplingParams(max_tokens=30, temperature=0.0), policy=policy)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.kv.counters["eviction_triggers"] >= 1
        for request_id in engine.requests:
            if engine.requests[request_id].seat.policy_state:
                usage = engine.cache.usage(request_id)
                assert bool((usage.global_tokens.float().mean(-1) <= cap).all())
    assert engine.cache.pool.num_used == 0


# ---------------------------------------------------------------------- training


def test_short_training_lowers_loss_and_admission(tmp_path: Path, model_dir: Path) -> None:
    from vllm_kvpress_ext.train.gate import GateTrainConfig, train_gates

    out = tmp_path / "model.wgkv.safetensors"
    config = GateTrainConfig(
        model_dir=str(model_dir),
        out=str(out),
        lam=0.5,
        local_window=16,
        steps=40,
        batch_size=4,
        context_len=128,
        lr=1e-2,
        warmup=4,
        eval_samples=4,
        tasks={"niah_multikey": 1.0},
    )
    path, summary = train_gates(config, progress=False)
    assert path == out and out.exists()
    log = [line for line in out.with_suffix(".log.jsonl").read_text().splitlines() if line]
    import json

    records = [json.loads(line) for line in log]
    first, last = records[:5], records[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss")
    assert mean(last, "admitted") < mean(first, "admitted")
    assert 0.0 <= summary["admitted_fraction"] < 1.0
    assert gate_metadata(out)["local_window"] == 16
    # The trained gates serve: the engine loads them from beside the model by default.
    engine = LLMEngine(model_dir, num_pages=256, page_size=PAGE)
    admission = engine.runner.admission_for(WGKVPolicy(gates=str(out)))
    assert isinstance(admission, GateAdmission) and admission.window == 16


def test_train_gate_rejects_bad_configs(tmp_path: Path, model_dir: Path) -> None:
    from vllm_kvpress_ext.train.gate import GateTrainConfig, train_gates

    with pytest.raises(ValueError, match="lambda"):
        train_gates(GateTrainConfig(model_dir=str(model_dir), out=str(tmp_path / "g"), lam=-1.0), progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_gates(GateTrainConfig(model_dir=str(tmp_path / "nope"), out=str(tmp_path / "g")), progress=False)
    with pytest.raises(ValueError, match="beside the model directory"):
        train_gates(GateTrainConfig(model_dir=str(model_dir), out=str(model_dir / "g.safetensors")), progress=False)
    with pytest.raises(ValueError, match="unknown task"):
        train_gates(
            GateTrainConfig(model_dir=str(model_dir), out=str(tmp_path / "g"), tasks={"x": 1.0}), progress=False
        )


def test_train_gate_command(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.cli import main

    out = tmp_path / "g.wgkv.safetensors"
    args = ["train-gate", str(model_dir), "--out", str(out), "--steps", "2", "--batch-size", "2"]
    args += ["--context-len", "64", "--eval-samples", "2", "--local-window", "16", "--tasks", "niah_multikey:1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "head 1" in printed and f"gates written to {out}" in printed
    assert gate_metadata(out)["local_window"] == 16
    assert main(["train-gate", str(tmp_path / "missing"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _wgkv_layer_result(seed: int, heads: int, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    """What `on_layer_prefilled` hands `plan`: distinct scores and shuffled positions, -1 past each head's length."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.zeros(heads, width)
    positions = torch.full((heads, width), -1, dtype=torch.int64)
    for head, length in enumerate(lengths):
        scores[head, :length] = torch.rand(length, generator=g) + 0.01
        positions[head, :length] = torch.randperm(200, generator=g)[:length]
    return {"scores": scores, "positions": positions}


def test_composition_plan_keeps_the_highest_scores_across_heads() -> None:
    """Prefill cut: per layer over the cap, exactly the cap * H best entries of the layer, whatever head they sit in."""
    cap, heads = 4, 2
    policy = WGKVPolicy(cap=cap)
    # Layer 0 is over its cap (13 > 8) with unequal heads; layer 1 (3 + 4 = 7) is under it and keeps everything.
    results = [_wgkv_layer_result(1, heads, [9, 4], 9), _wgkv_layer_result(2, heads, [3, 4], 4)]
    state: dict[str, Any] = {}
    request = RequestPrefill("r", num_layers=2, num_kv_heads=heads, num_q_heads=4, length=100)
    plan = policy.plan(request, results, state)
    assert plan is not None
    for layer, result in enumerate(results):
        entries = [
            (float(result["scores"][h, e]), h, e)
            for h in range(heads)
            for e in range(result["positions"].shape[-1])
            if result["positions"][h, e] >= 0
        ]
        limit = cap * heads
        chosen = sorted(entries, reverse=True)[:limit] if len(entries) > limit else entries
        for head in range(heads):
            want = sorted(e for _, h, e in chosen if h == head)
            assert plan.indices[layer, head, : int(plan.lengths[layer, head])].tolist() == want, (layer, head)
    assert state["counters"] == {"eviction_triggers": 1}
    kept_positions = state["positions"][0]
    assert int((kept_positions >= 0).sum()) == cap * heads


def test_composition_decode_evicts_the_lowest_moving_averages_across_heads() -> None:
    """Decode: scores are moving averages by position; over the cap, the lowest ceil(10%) of the layer go."""
    cap, heads, group, window = 3, 2, 2, 4
    policy = WGKVPolicy(cap=cap, observation_window=window)
    rate = 1.0 / window
    g = torch.Generator().manual_seed(7)
    # Start: layer 0 holds positions 0..3 in head 0 and 10..12 in head 1 (7 entries > cap * H = 6); three
    # layers of two heads, so a loop over the wrong dimension shows.
    held = [[[0, 1, 2, 3], [10, 11, 12]], [[20], [30, 31]], [[40, 41, 42], [50, 51, 52, 53]]]
    num_layers = len(held)
    ref: list[list[dict[int, float]]] = [
        [{p: float(i + 1) / 10 for i, p in enumerate(h)} for h in layer] for layer in held
    ]
    width0 = 4
    positions0 = torch.full((num_layers, heads, width0), -1, dtype=torch.int64)
    scores0 = torch.zeros(num_layers, heads, width0)
    for layer in range(num_layers):
        for head in range(heads):
            for i, p in enumerate(held[layer][head]):
                positions0[layer, head, i] = p
                scores0[layer, head, i] = ref[layer][head][p]
    state: dict[str, Any] = {"positions": positions0, "scores": scores0, "counters": {"eviction_triggers": 0}}
    triggers = 0
    for step in range(6):
        new = 100 + step
        layers = []
        for layer in range(num_layers):
            if step % 2 == 0:
                held[layer][0].append(new)  # a promotion from the ring
            for head in range(heads):  # storage order is not position order
                held[layer][head].reverse()
            width = max(len(h) for h in held[layer])
            positions = torch.full((heads, width), -1, dtype=torch.int64)
            attention = torch.zeros(heads, group, width)
            for head in range(heads):
                positions[head, : len(held[layer][head])] = torch.tensor(held[layer][head])
                attention[head, :, : len(held[layer][head])] = torch.rand(group, len(held[layer][head]), generator=g)
            lengths = torch.tensor([len(h) for h in held[layer]])
            layers.append(DecodeLayer(positions=positions, lengths=lengths, attention=attention))
        width = max(layer.positions.shape[-1] for layer in layers)
        padded = [
            DecodeLayer(
                positions=torch.nn.functional.pad(layer.positions, (0, width - layer.positions.shape[-1]), value=-1),
                lengths=layer.lengths,
                attention=torch.nn.functional.pad(layer.attention, (0, width - layer.attention.shape[-1])),  # type: ignore[arg-type]
            )
            for layer in layers
        ]
        eviction = policy.on_decode_step(DecodeStep("r", new, padded), state)
        got = set()
        if eviction is not None:
            for layer, head, entry in zip(
                eviction.layers.tolist(), eviction.heads.tolist(), eviction.entries.tolist(), strict=True
            ):
                got.add((layer, head, held[layer][head][entry]))
        want = set()
        for layer in range(num_layers):
            for head in range(heads):
                for index, p in enumerate(held[layer][head]):
                    now = float(padded[layer].attention[head, :, index].mean())  # type: ignore[index]
                    before = ref[layer][head].get(p)
                    ref[layer][head][p] = now if before is None else (1 - rate) * before + rate * now
            total = sum(len(h) for h in held[layer])
            if total > cap * heads:
                triggers += 1
                count = max(1, math.ceil(0.1 * total))
                ranked = sorted((ref[layer][h][p], h, p) for h in range(heads) for p in held[layer][h])
                want |= {(layer, h, p) for _, h, p in ranked[:count]}
        assert got == want, f"step {step}"
        for layer, head, p in want:
            held[layer][head].remove(p)
            del ref[layer][head][p]
        assert state["counters"]["eviction_triggers"] == triggers
    assert triggers >= 3
