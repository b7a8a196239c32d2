"""Baseline policies (PyramidKV, AdaKV, StreamingLLM, H2O) against plain re-implementations of their papers.

Each keep plan on synthetic inputs is compared with a straightforward loop-based implementation of
the paper's equations written here (no policy helper is called by the references); budgets are
checked exactly; end-to-end runs on a tiny random model check that plans free exactly the pages
they drop and that the decode-time policies keep every head bounded for hundreds of steps.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import TINY, budget_per_head, check_kept, hf_greedy, run_recording
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.engine import LLM, LLMEngine, SamplingParams
from vllm_kvpress_ext.policies import (
    AdaKVPolicy,
    H2OPolicy,
    PolicyConfigError,
    PyramidKVPolicy,
    StreamingLLMPolicy,
    load_policy,
)
from vllm_kvpress_ext.policies import h2o as h2o_module
from vllm_kvpress_ext.policies.base import DecodeLayer, DecodeStep, LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.capture import LayerCapture

# ----------------------------------------------------------------------------- synthetic inputs


def synthetic_layer(seed: int, n: int, captured: int, layer: int = 0, num_layers: int = 1) -> LayerPrefill:
    """A layer of n entries, 2 KV heads x 2 query heads each, with the last `captured` queries."""
    g = torch.Generator().manual_seed(seed)
    hkv, hq, d = 2, 4, 8
    keys = torch.randn(hkv, n, d, generator=g) * 1.5
    queries = torch.randn(captured, hq, d, generator=g) * 1.5
    return LayerPrefill(
        layer=layer,
        num_layers=num_layers,
        keys=keys,
        values=torch.randn(hkv, n, d, generator=g),
        positions=torch.arange(n),
        capture=LayerCapture(queries=queries, query_positions=torch.arange(n - captured, n)),
        model=None,  # type: ignore[arg-type]
        scale=d**-0.5,
    )


def request_for(layers: list[LayerPrefill]) -> RequestPrefill:
    first = layers[0]
    return RequestPrefill("r", len(layers), first.num_kv_heads, first.capture.queries.shape[1], first.length)  # type: ignore[union-attr]


def run_prefill(policy: Any, layers: list[LayerPrefill]) -> tuple[KeepPlan, dict[str, Any]]:
    state: dict[str, Any] = {}
    results = [policy.on_layer_prefilled(layer, state) for layer in layers]
    return policy.plan(request_for(layers), results, state), state


def kept_lists(plan: KeepPlan) -> list[list[list[int]]]:
    return [
        [plan.indices[layer, head, : int(plan.lengths[layer, head])].tolist() for head in range(plan.lengths.shape[1])]
        for layer in range(plan.lengths.shape[0])
    ]


# ----------------------------------------------------------------------------- reference implementations


def ref_attention_rows(layer: LayerPrefill, query_rows: range) -> list[list[list[float]]]:
    """attn[h][i][j] for query head h, captured query i in `query_rows`, key j (float64, causal)."""
    cap = layer.capture
    assert cap is not None and cap.queries is not None and cap.query_positions is not None
    hq = cap.queries.shape[1]
    group = hq // layer.num_kv_heads
    out = []
    for h in range(hq):
        keys = layer.keys[h // group].double()
        rows = []
        for i in query_rows:
            q = cap.queries[i, h].double()
            qpos = int(cap.query_positions[i])
            logits = [float(q @ keys[j]) * layer.scale for j in range(layer.length)]
            allowed = [j for j in range(layer.length) if int(layer.positions[j]) <= qpos]
            top = max(logits[j] for j in allowed)
            weights = [math.exp(logits[j] - top) if j in allowed else 0.0 for j in range(layer.length)]
            total = sum(weights)
            rows.append([w / total for w in weights])
        out.append(rows)
    return out


def ref_column_sums(layer: LayerPrefill, query_rows: range, how: str) -> list[list[float]]:
    """Per KV head: sum over the chosen queries of each key's attention, reduced over the group."""
    attn = ref_attention_rows(layer, query_rows)
    group = len(attn) // layer.num_kv_heads
    sums = [[sum(row[j] for row in attn[h]) for j in range(layer.length)] for h in range(len(attn))]
    reduced = []
    for kv in range(layer.num_kv_heads):
        members = sums[kv * group : (kv + 1) * group]
        if how == "mean":
            reduced.append([sum(m[j] for m in members) / group for j in range(layer.length)])
        else:
            reduced.append([max(m[j] for m in members) for j in range(layer.length)])
    return reduced


def ref_pool(values: list[float], kernel: int, how: str, count_include_pad: bool = True) -> list[float]:
    """1-D pooling over `values` padded with kernel // 2 entries on each side.

    Average: the padding is zeros and counts in the divisor (`count_include_pad`, the reference's
    `avg_pool1d` default) or is left out of it. Max: the padding never wins.
    """
    half = kernel // 2
    n = len(values)
    out = []
    for j in range(n):
        inside = [values[i] for i in range(j - half, j + half + 1) if 0 <= i < n]
        if how == "maxpool":
            out.append(max(inside))
        else:
            out.append(sum(inside) / (kernel if count_include_pad else len(inside)))
    return out


def ref_snapkv_scores(
    layer: LayerPrefill, window: int, kernel: int, pooling: str, how: str, count_include_pad: bool = True
) -> list[list[float]]:
    """SnapKV votes of the prefix (first n - window entries), pooled; the window is kept regardless."""
    captured = layer.capture.queries.shape[0]  # type: ignore[union-attr]
    votes = ref_column_sums(layer, range(captured - window, captured), how)
    prefix = layer.length - window
    return [ref_pool(v[:prefix], kernel, pooling, count_include_pad) for v in votes]


def ref_top(scores: list[float], count: int, exclude: set[int] | None = None) -> list[int]:
    """Indices of the `count` highest scores (ties: lower index first)."""
    skip = exclude or set()
    ranked = sorted((j for j in range(len(scores)) if j not in skip), key=lambda j: (-scores[j], j))
    return ranked[:count]


def ref_pyramid_schedule(num_layers: int, budget: int, window: int, n: int, beta: float) -> list[int]:
    """The paper's arithmetic sequence (reference: min = R / beta, max = 2R - min, capped at n - w), rounded exactly."""
    mean = Fraction(budget - window)
    smallest = mean / Fraction(beta)
    largest = 2 * mean - smallest
    if largest > n - window:
        largest = Fraction(n - window)
        smallest = 2 * mean - largest
    if num_layers == 1:
        ideal = [mean]
    else:
        ideal = [largest + (smallest - largest) * Fraction(layer, num_layers - 1) for layer in range(num_layers)]
    rounded = [math.floor(x) for x in ideal]
    leftover = num_layers * (budget - window) - sum(rounded)
    by_fraction = sorted(range(num_layers), key=lambda layer: (rounded[layer] - ideal[layer], layer))
    for layer in by_fraction[:leftover]:
        rounded[layer] += 1
    return [r + window for r in rounded]


# ----------------------------------------------------------------------------- PyramidKV


@pytest.mark.parametrize(
    "n, tokens, beta, num_layers", [(40, 20, 20.0, 4), (40, 30, 20.0, 3), (24, 20, 20.0, 5), (40, 20, 1.0, 3)]
)
def test_pyramidkv_matches_reference(n: int, tokens: int, beta: float, num_layers: int) -> None:
    policy = PyramidKVPolicy(tokens=tokens, ratio=None, window=4, kernel_size=3, pooling="maxpool", beta=beta)
    policy.validate()
    layers = [synthetic_layer(10 + i, n, 4, layer=i, num_layers=num_layers) for i in range(num_layers)]
    plan, _ = run_prefill(policy, layers)
    budgets = ref_pyramid_schedule(num_layers, tokens, 4, n, beta)
    expected = []
    for layer in layers:
        scores = ref_snapkv_scores(layer, 4, 3, "maxpool", "mean")
        budget = budgets[layer.layer]
        expected.append([sorted(ref_top(s, budget - 4) + list(range(n - 4, n))) for s in scores])
    assert kept_lists(plan) == expected
    assert plan.lengths[:, 0].tolist() == budgets


def test_pyramidkv_budgets_mean_exact_and_non_increasing() -> None:
    for num_layers in (1, 2, 3, 7, 32, 80):
        for n in (50, 300, 4000):
            for tokens in (8, 9, 33, 64, 100, 257):
                for beta in (1.0, 2.5, 20.0):
                    policy = PyramidKVPolicy(tokens=tokens, ratio=None, beta=beta)
                    policy.validate()
                    budgets = policy.layer_budgets(num_layers, n)
                    expected_mean = min(n, tokens)
                    assert sum(budgets) == num_layers * expected_mean, (num_layers, n, tokens, beta)
                    assert all(a >= b for a, b in itertools.pairwise(budgets))
                    assert max(budgets) <= n
                    assert budgets == ref_pyramid_schedule(num_layers, expected_mean, min(8, expected_mean), n, beta)


def test_pyramidkv_equals_the_reference_integer_schedule_when_it_divides() -> None:
    # Reference (PyramidKVCluster): min = (B - w) // beta, max = 2 (B - w) - min, step = (max - min) // (L - 1).
    policy = PyramidKVPolicy(tokens=48, ratio=None, window=8, beta=20.0)
    assert [b - 8 for b in policy.layer_budgets(5, 10_000)] == [78, 59, 40, 21, 2]
    # Capped: the bottom layer keeps the whole prompt, the mean stays B.
    budgets = policy.layer_budgets(4, 60)
    assert budgets[0] == 60 and sum(budgets) == 4 * 48


# The window_inside schedule by hand: B* = mean budget, top = B* / beta, bottom = 2 B* - top (capped at
# n - w, top re-derived), uniform B when the top layer would be smaller than the window, else each layer
# round-half-even(bottom - l (bottom - top) / (L - 1)).
WINDOW_INSIDE_CASES = [
    # (L, n, tokens or None, ratio or None, window, beta, budgets)
    (5, 10_000, 48, None, 8, 2.0, [72, 60, 48, 36, 24]),  # top 24, bottom 72, step 12
    (4, 60, 48, None, 8, 2.0, [52, 49, 47, 44]),  # bottom capped at n - w = 52, top = 96 - 52 = 44
    (3, 1000, 30, None, 4, 4.0, [52, 30, 8]),  # 52.5 and 7.5 round half to even
    (3, 1000, None, 0.25, 8, 20.0, [488, 250, 12]),  # B* = 250 (unrounded): 487.5 -> 488, 12.5 -> 12
    (3, 1000, None, 0.1, 8, 20.0, [100, 100, 100]),  # top 5 < window 8: uniform SnapKV budget
    (5, 10_000, 48, None, 8, 20.0, [48] * 5),  # top 2.4 < window 8: uniform
    (2, 30, 40, None, 8, 2.0, [30, 30]),  # a prompt no longer than the budget is kept whole
    (5, 100, 10, None, 0, 1e6, [20, 15, 10, 5, 1]),  # no window: the top layer's 0.00001 keeps 1, not 0
]


@pytest.mark.parametrize("num_layers, n, tokens, ratio, window, beta, budgets", WINDOW_INSIDE_CASES)
def test_pyramidkv_window_inside_budgets_by_hand(
    num_layers: int, n: int, tokens: int | None, ratio: float | None, window: int, beta: float, budgets: list[int]
) -> None:
    policy = PyramidKVPolicy(tokens=tokens, ratio=ratio, window=window, beta=beta, schedule="window_inside")
    policy.validate()
    assert policy.layer_budgets(num_layers, n) == budgets


def test_pyramidkv_window_outside_budgets_by_hand() -> None:
    # R = B - w = 40, top 40 / 2 = 20, bottom 60, step 10: the window is added on top of every layer.
    policy = PyramidKVPolicy(tokens=48, ratio=None, window=8, beta=2.0)
    assert policy.layer_budgets(5, 10_000) == [68, 58, 48, 38, 28]
    # The same budget under window_inside keeps 72 .. 24 in all (test above): the top layer is smaller.
    assert PyramidKVPolicy(tokens=48, ratio=None, window=8, beta=2.0).schedule == "window_outside"


@pytest.mark.parametrize("schedule", ["window_outside", "window_inside"])
def test_pyramidkv_plans_keep_window_plus_top_votes_per_layer_budget(schedule: str) -> None:
    n, tokens, window, num_layers = 40, 20, 4, 3
    policy = PyramidKVPolicy(
        tokens=tokens, ratio=None, window=window, kernel_size=3, pooling="avgpool", beta=2.0, schedule=schedule
    )
    policy.validate()
    layers = [synthetic_layer(50 + i, n, window, layer=i, num_layers=num_layers) for i in range(num_layers)]
    plan, _ = run_prefill(policy, layers)
    # window_inside: top 10, bottom 30, step 10; window_outside: R = 16, top 8, bottom 24, step 8, + 4.
    budgets = [30, 20, 10] if schedule == "window_inside" else [28, 20, 12]
    expected = []
    for layer in layers:
        scores = ref_snapkv_scores(layer, window, 3, "avgpool", "mean")
        budget = budgets[layer.layer]
        expected.append([sorted(ref_top(s, budget - window) + list(range(n - window, n))) for s in scores])
    assert kept_lists(plan) == expected
    assert plan.lengths[:, 0].tolist() == budgets


def test_pyramidkv_rejects_an_unknown_schedule() -> None:
    with pytest.raises(PolicyConfigError, match="schedule must be one of"):
        load_policy({"name": "pyramidkv", "schedule": "reference"})
    with pytest.raises(PolicyConfigError, match="schedule must be str"):
        load_policy({"name": "pyramidkv", "schedule": 1})


# ----------------------------------------------------------------------------- AdaKV


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("n, tokens, alpha", [(48, 16, 0.2), (48, 30, 0.5), (20, 12, 0.0), (48, 16, 1.0)])
def test_adakv_matches_reference(n: int, tokens: int, alpha: float, count_include_pad: bool) -> None:
    policy = AdaKVPolicy(
        tokens=tokens,
        ratio=None,
        window=4,
        kernel_size=5,
        pooling="avgpool",
        alpha=alpha,
        count_include_pad=count_include_pad,
    )
    policy.validate()
    layers = [synthetic_layer(30 + i, n, 4, layer=i, num_layers=2) for i in range(2)]
    plan, _ = run_prefill(policy, layers)
    expected = []
    for layer in layers:
        scores = ref_snapkv_scores(layer, 4, 5, "avgpool", "mean", count_include_pad)
        selectable = tokens - 4
        floor = int(alpha * selectable)
        kept = [set(ref_top(s, floor)) for s in scores]
        pool = sorted(
            ((h, j) for h, s in enumerate(scores) for j in range(len(s)) if j not in kept[h]),
            key=lambda hj: (-scores[hj[0]][hj[1]], hj[0], hj[1]),
        )
        for h, j in pool[: len(scores) * (selectable - floor)]:
            kept[h].add(j)
        expected.append([sorted(k | set(range(n - 4, n))) for k in kept])
    assert kept_lists(plan) == expected
    assert plan.lengths.sum(-1).tolist() == [2 * tokens, 2 * tokens]  # exactly H_kv * B per layer


def test_adakv_keeps_exactly_hkv_times_budget_per_layer() -> None:
    for seed, (n, ratio) in enumerate([(64, 0.25), (100, 0.1), (33, 0.5), (10, 0.05)]):
        policy = AdaKVPolicy(ratio=ratio, window=8)
        policy.validate()
        layers = [synthetic_layer(seed * 7 + i, n, 8, layer=i, num_layers=3) for i in range(3)]
        plan, _ = run_prefill(policy, layers)
        budget = min(n, max(1, round(ratio * n)))
        assert plan.lengths.sum(-1).tolist() == [2 * budget] * 3
        floor = int(0.2 * (budget - min(8, budget)))
        assert int(plan.lengths.min()) >= min(8, budget) + floor


# ----------------------------------------------------------------------------- StreamingLLM


@pytest.mark.parametrize("n, tokens, sinks", [(40, 12, 4), (40, 3, 4), (10, 12, 4), (40, 9, 0), (40, 1, 4)])
def test_streaming_llm_prefill_matches_reference(n: int, tokens: int, sinks: int) -> None:
    policy = StreamingLLMPolicy(tokens=tokens, ratio=None, sink_tokens=sinks)
    policy.validate()
    assert policy.capture_spec().empty
    layers = [synthetic_layer(50, n, 1)]
    plan, state = run_prefill(policy, layers)
    s = min(sinks, tokens - 1)
    expected = list(range(n)) if n <= tokens else sorted(set(range(s)) | set(range(n - (tokens - s), n)))
    assert kept_lists(plan) == [[expected, expected]]
    assert state["cap"] == tokens


# ----------------------------------------------------------------------------- H2O


@pytest.mark.parametrize(
    "observation_window, how, block_elements",
    [(None, "mean", None), (None, "max", None), (6, "mean", None), (None, "mean", 300), (None, "max", 1)],
)
def test_h2o_prefill_matches_reference(
    observation_window: int | None, how: str, block_elements: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block_elements is not None:  # score the prompt a few query rows at a time
        monkeypatch.setattr(h2o_module, "BLOCK_ELEMENTS", block_elements)
    n, tokens = 30, 10
    policy = H2OPolicy(tokens=tokens, ratio=None, observation_window=observation_window, gqa_reduction=how)
    policy.validate()
    assert policy.capture_spec().window >= (observation_window or 1 << 40)
    layers = [synthetic_layer(70 + i, n, n, layer=i, num_layers=2) for i in range(2)]
    plan, state = run_prefill(policy, layers)
    recent = round(tokens * 0.5)
    expected = []
    for layer in layers:
        rows = range(n) if observation_window is None else range(n - observation_window, n)
        scores = ref_column_sums(layer, rows, how)
        expected.append(
            [
                sorted(ref_top(s, tokens - recent, set(range(n - recent, n))) + list(range(n - recent, n)))
                for s in scores
            ]
        )
    assert kept_lists(plan) == expected
    # The accumulated scores are kept by position for decode.
    for layer, kept in zip(layers, expected, strict=True):
        rows = range(n) if observation_window is None else range(n - observation_window, n)
        ref = torch.tensor(ref_column_sums(layer, rows, how), dtype=torch.float32)
        assert torch.allclose(state["scores"][layer.layer], ref, atol=1e-5)
        for head, positions in enumerate(kept):
            held = state["positions"][layer.layer, head]
            assert sorted(held[held >= 0].tolist()) == positions


@pytest.mark.parametrize(("n", "hkv", "group"), [(1, 2, 2), (37, 2, 4), (700, 2, 4), (300, 4, 1)])
def test_h2o_column_sums_agree_on_every_path(n: int, hkv: int, group: int) -> None:
    """The fused passes (flash on CPU), the query tiles and the dense blocks give the same column sums."""
    g = torch.Generator().manual_seed(n)
    d = 16
    queries = torch.randn(n, hkv * group, d, generator=g) * 2
    keys = torch.randn(hkv, n, d, generator=g) * 2
    dense = h2o_module.dense_column_sums(queries, torch.arange(n), keys, torch.arange(n), d**-0.5)
    for fast in (
        h2o_module.causal_column_sums(queries, keys, d**-0.5),
        h2o_module.tiled_column_sums(queries, keys, d**-0.5, tile=64),
    ):
        torch.testing.assert_close(fast, dense, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(dense.sum(dim=-1), torch.full((hkv, group), float(n)))  # each query's row sums to 1


def test_h2o_plans_are_those_of_the_dense_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same plans and scores as before the fused column sums (the dense blocks are the previous computation)."""
    layers = [synthetic_layer(90 + i, 600, 600, layer=i, num_layers=3) for i in range(3)]
    policy = H2OPolicy(ratio=0.2)
    plan, state = run_prefill(policy, layers)
    monkeypatch.setattr(
        h2o_module,
        "causal_column_sums",
        lambda q, k, scale, lse=None: h2o_module.dense_column_sums(
            q, torch.arange(k.shape[1]), k, torch.arange(k.shape[1]), scale
        ),
    )
    before, before_state = run_prefill(policy, layers)
    assert torch.equal(plan.indices, before.indices) and torch.equal(plan.lengths, before.lengths)
    torch.testing.assert_close(state["scores"], before_state["scores"], rtol=2e-5, atol=1e-5)


def test_h2o_decode_matches_reference_under_shuffled_storage() -> None:
    """Simulated decode: storage order is shuffled after every step, scores must follow positions."""
    torch.manual_seed(0)
    num_layers, hkv, group, n, cap = 2, 2, 2, 12, 8
    policy = H2OPolicy(tokens=cap, ratio=None, recent_fraction=0.25)
    policy.validate()
    recent = 2
    layers = [synthetic_layer(90 + i, n, n, layer=i, num_layers=num_layers) for i in range(num_layers)]
    _, state = run_prefill(policy, layers)
    # Reference state: position -> accumulated score per (layer, head).
    ref: list[list[dict[int, float]]] = [
        [
            {int(p): float(state["scores"][layer, head, int(p)]) for p in state["positions"][layer, head] if p >= 0}
            for head in range(hkv)
        ]
        for layer in range(num_layers)
    ]
    storage = [[list(ref[layer][head]) for head in range(hkv)] for layer in range(num_layers)]
    for step in range(40):
        pos = n + step
        # Heads get different orders and lengths; attention comes raw per query head [Hkv, G, N].
        for layer in range(num_layers):
            for head in range(hkv):
                storage[layer][head].append(pos)
                perm = torch.randperm(len(storage[layer][head])).tolist()
                storage[layer][head] = [storage[layer][head][i] for i in perm]
        width = max(len(s) for per_layer in storage for s in per_layer)
        decode_layers = []
        attentions = []
        for layer in range(num_layers):
            positions = torch.full((hkv, width), -1, dtype=torch.int64)
            attention = torch.zeros(hkv, group, width)
            for head in range(hkv):
                entries = storage[layer][head]
                positions[head, : len(entries)] = torch.tensor(entries)
                # Ties on purpose every few steps: equal attention for every entry.
                probs = torch.rand(group, len(entries)) if step % 5 else torch.ones(group, len(entries))
                attention[head, :, : len(entries)] = probs
            lengths = torch.tensor([len(storage[layer][h]) for h in range(hkv)])
            decode_layers.append(DecodeLayer(positions=positions, lengths=lengths, attention=attention))
            attentions.append(attention)
        eviction = policy.on_decode_step(DecodeStep("r", pos, decode_layers), state)
        got: set[tuple[int, int, int]] = set()
        if eviction is not None:
            for layer, head, entry in zip(
                eviction.layers.tolist(), eviction.heads.tolist(), eviction.entries.tolist(), strict=True
            ):
                got.add((layer, head, storage[layer][head][entry]))
        want: set[tuple[int, int, int]] = set()
        for layer in range(num_layers):
            for head in range(hkv):
                scores = ref[layer][head]
                for index, p in enumerate(storage[layer][head]):
                    added = sum(float(attentions[layer][head, g, index]) for g in range(group)) / group
                    scores[p] = scores.get(p, 0.0) + added
                newest = sorted(scores, reverse=True)[:recent]
                while len(scores) > cap:
                    victim = min((p for p in scores if p not in newest), key=lambda p: (scores[p], p))
                    del scores[victim]
                    want.add((layer, head, victim))
        assert got == want, f"step {step}"
        for layer, head, p in want:
            storage[layer][head].remove(p)
        for layer in range(num_layers):
            for head in range(hkv):
                assert len(storage[layer][head]) <= cap
                for p, score in ref[layer][head].items():
                    held = state["positions"][layer, head] == p
                    assert held.sum() == 1 and abs(float(state["scores"][layer, head][held]) - score) < 1e-4


# ----------------------------------------------------------------------------- engine runs

PAGE = 4
MAX_TOKENS_LONG = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, 4 query heads, 2 KV heads) with room for hundreds of generated tokens."""
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 1024, "tie_word_embeddings": False})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()


POLICY_SPECS: list[dict[str, Any]] = [
    {"name": "pyramidkv", "tokens": 16},
    {"name": "adakv", "tokens": 40, "window": 8},
    {"name": "streaming_llm", "tokens": 12},
    {"name": "h2o", "ratio": 0.3},
]


@pytest.mark.parametrize("spec", POLICY_SPECS, ids=lambda s: s["name"])
def test_plan_frees_exactly_the_pages_it_drops(model_dir: Path, spec: dict[str, Any]) -> None:
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=2048, page_size=PAGE, max_num_batched_tokens=37)
    policy = load_policy(spec)
    assert policy is not None
    plans: list[KeepPlan] = []
    original_plan = policy.plan

    def recording_plan(*args: Any) -> KeepPlan | None:
        plan = original_plan(*args)
        assert plan is not None
        plans.append(plan)
        return plan

    policy.plan = recording_plan  # type: ignore[method-assign, assignment]
    applied: list[tuple[int, int, int, Any]] = []
    original_apply = engine.cache.apply_keep_plan

    def recording_apply(request_id: Any, plan: KeepPlan, layers: list[int] | None = None) -> int:
        before = engine.cache.pool.num_used
        freed = original_apply(request_id, plan, layers)
        applied.append((before, engine.cache.pool.num_used, freed, engine.cache.usage(request_id)))
        return freed

    engine.cache.apply_keep_plan = recording_apply  # type: ignore[method-assign]
    n = 97
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # no decode step: only the plan acts
    engine.add_request(prompt_ids(n, 1), params, policy=policy)
    while engine.has_unfinished_requests():
        engine.step()
    (plan,) = plans
    ((before, after, freed, usage),) = applied
    layers, heads = plan.lengths.shape
    assert before == layers * heads * math.ceil(n / PAGE)
    expected_after = sum(math.ceil(int(k) / PAGE) for k in plan.lengths.reshape(-1))
    assert after == expected_after and before - after == freed
    assert torch.equal(usage.global_tokens, plan.lengths)
    assert usage.pages == expected_after
    assert layers * heads * n - int(plan.lengths.sum()) > 0  # something was dropped
    assert engine.cache.pool.num_used == 0


class H2OReference:
    """H2O's decode-time bookkeeping written out: accumulated score per held position, evict the lowest.

    Wraps a policy's `on_decode_step`: at the first step it takes the prefill's scores (checked against
    the paper's equations by `test_h2o_prefill_matches_reference`), then at every step it adds the
    step's attention (group mean) to each held position, evicts the lowest (older first on ties)
    outside the `recent` newest until each head is back at `cap`, and checks the policy evicted the same.
    """

    def __init__(self, policy: H2OPolicy, cap: int) -> None:
        self.policy, self.cap, self.recent = policy, cap, policy.recent(cap)
        self.original = policy.on_decode_step
        self.scores: list[list[dict[int, float]]] | None = None
        self.steps = 0

    def __call__(self, step: DecodeStep, state: dict[str, Any]) -> Any:
        if self.scores is None:
            self.scores = [
                [
                    {int(p): float(s) for p, s in zip(pos.tolist(), sc.tolist(), strict=True) if p >= 0}
                    for pos, sc in zip(state["positions"][layer], state["scores"][layer], strict=True)
                ]
                for layer in range(state["positions"].shape[0])
            ]
        eviction = self.original(step, state)
        want: set[tuple[int, int, int]] = set()
        for layer, decode_layer in enumerate(step.layers):
            assert decode_layer.attention is not None
            group_mean = decode_layer.attention.mean(dim=1).tolist()  # [Hkv][N]
            all_positions = decode_layer.positions.tolist()
            for head, scores in enumerate(self.scores[layer]):
                length = int(decode_layer.lengths[head])
                for entry in range(length):
                    p = all_positions[head][entry]
                    scores[p] = scores.get(p, 0.0) + group_mean[head][entry]
                assert set(scores) == set(all_positions[head][:length])
                newest = sorted(scores, reverse=True)[: self.recent]
                while len(scores) > self.cap:
                    victim = min((p for p in scores if p not in newest), key=lambda p: (scores[p], p))
                    del scores[victim]
                    want.add((layer, head, victim))
        got = set()
        if eviction is not None:
            for layer, head, entry in zip(
                eviction.layers.tolist(), eviction.heads.tolist(), eviction.entries.tolist(), strict=True
            ):
                got.add((layer, head, int(step.layers[layer].positions[head, entry])))
        assert got == want, f"step {self.steps}"
        self.steps += 1
        return eviction

    def held(self, layer: int, head: int) -> set[int]:
        assert self.scores is not None
        return set(self.scores[layer][head])


@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
@pytest.mark.parametrize("budget, cap", [({"tokens": 14}, 14), ({"ratio": 0.25}, 15)], ids=["tokens", "ratio"])
def test_decode_time_policies_stay_bounded_for_hundreds_of_steps(
    model_dir: Path, name: str, budget: dict[str, Any], cap: int
) -> None:
    spec = {"name": name, **budget}  # a ratio budget is fixed at prefill: round(0.25 * 60) = 15
    policy = load_policy(spec)
    reference = None
    if isinstance(policy, H2OPolicy):
        reference = H2OReference(policy, cap)
        policy.on_decode_step = reference  # type: ignore[method-assign]
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=512, page_size=PAGE, kv_policy=policy)
    n = 60
    rid = engine.add_request(
        prompt_ids(n, 2), SamplingParams(max_tokens=MAX_TOKENS_LONG, temperature=0.0, ignore_eos=True)
    )
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    page_bound = layers * heads * math.ceil(cap / PAGE)
    steps, output = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if rid in engine.requests and engine.requests[rid].seat.row is not None:
            usage = engine.cache.usage(rid)
            assert engine.cache.pool.num_used <= page_bound, f"step {steps}"
            positions, lengths = engine.cache.entry_positions(rid)
            newest = engine.requests[rid].seat.num_processed - 1
            for layer in range(layers):
                for head in range(heads):
                    held = set(positions[layer, head, : int(lengths[layer, head])].tolist())
                    if name == "streaming_llm":
                        assert held == set(range(4)) | set(range(newest - (cap - 4) + 1, newest + 1)), f"step {steps}"
                    else:
                        assert reference is not None
                        if reference.scores is not None:  # from the first decode step on
                            assert held == reference.held(layer, head), f"step {steps}"
                        assert set(range(newest - round(cap * 0.5) + 1, newest + 1)) <= held, f"step {steps}"
            assert usage.global_tokens.tolist() == [[cap] * heads] * layers, f"step {steps}"
        output = next((o for o in outs if o.finished), output)
    assert output is not None and len(output.output_token_ids) == MAX_TOKENS_LONG
    assert steps == MAX_TOKENS_LONG  # one prefill step, then a decode step per further token
    if reference is not None:
        assert reference.steps == MAX_TOKENS_LONG - 1
    assert engine.cache.pool.num_used == 0


@pytest.mark.parametrize("spec", ["pyramidkv", "adakv", "streaming_llm", "h2o", *POLICY_SPECS], ids=str)
def test_generate_end_to_end(model_dir: Path, spec: Any) -> None:
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=64)
    prompts = [prompt_ids(n, 10 + n) for n in (5, 48, 130)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    policy = load_policy(spec)
    assert policy is not None
    decoded = 11  # the 12th token is sampled, never fed back
    finished = run_recording(engine, prompts, params, policy=spec)  # per-request policy override
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    for request, prompt in zip(finished, prompts, strict=True):
        out, n = request.output, len(prompt)
        assert len(out.output_token_ids) == 12
        per_head = budget_per_head(policy, n)
        if policy.wants_decode_steps:  # bounded from compression on at the budget it fixed
            cap = policy.tokens if policy.tokens is not None else per_head  # type: ignore[attr-defined]
            held = min(cap, per_head + decoded)
            assert all(len(positions) == held for per_layer in request.held for positions in per_layer)
            assert out.kv.tokens_kept == layers * heads * held
        else:
            check_kept(request, n, decoded, per_head)
        if out.kv.tokens_kept == out.kv.tokens_full:  # nothing dropped: exactly transformers' greedy tokens
            assert out.output_token_ids == hf_greedy(hf, prompt, 12)
        if n == 130:
            assert out.kv.retention < 1.0
    assert engine.cache.pool.num_used == 0
    # The offline API with the policy as the engine default gives the same greedy tokens.
    llm = LLM(model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=64, kv_policy=spec)
    again = llm.generate(prompts, params)
    assert [o.output_token_ids for o in again] == [r.output.output_token_ids for r in finished]


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "pyramidkv", "beta": 0.5}, "beta must be >= 1"),
        ({"name": "pyramidkv", "tokens": 4}, "smaller than the protected window 8"),
        ({"name": "pyramidkv", "kernel_size": 4}, "kernel_size"),
        ({"name": "adakv", "alpha": 1.5}, "alpha"),
        ({"name": "adakv", "ratio": 0.0}, "ratio must lie in"),
        ({"name": "adakv", "gqa_reduction": "sum"}, "gqa_reduction"),
        ({"name": "streaming_llm", "sink_tokens": -1}, "sink_tokens"),
        ({"name": "streaming_llm", "tokens": 0}, "tokens must be >= 1"),
        ({"name": "streaming_llm", "ratio": 0.5, "tokens": 8}, "exactly one budget"),
        ({"name": "h2o", "recent_fraction": 2.0}, "recent_fraction"),
        ({"name": "h2o", "observation_window": 0}, "observation_window"),
        ({"name": "h2o", "gqa_reduction": "median"}, "gqa_reduction"),
        ({"name": "h2o", "heavy_ratio": 0.1}, "unknown parameter"),
        ({"name": "h2o", "recent_fraction": "half"}, "must be float"),
    ],
)
def test_invalid_parameters_are_rejected_clearly(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy(spec)


def test_presets_hold_the_documented_defaults() -> None:
    expected = {
        "pyramidkv": PyramidKVPolicy(),
        "adakv": AdaKVPolicy(),
        "streaming_llm": StreamingLLMPolicy(),
        "h2o": H2OPolicy(),
    }
    for name, default in expected.items():
        preset = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
        assert preset.is_file()
        assert load_policy(name) == default
        assert load_policy(str(preset)) == default
    assert (PyramidKVPolicy().window, PyramidKVPolicy().kernel_size, PyramidKVPolicy().beta) == (8, 7, 20.0)
    assert (AdaKVPolicy().window, AdaKVPolicy().pooling, AdaKVPolicy().alpha) == (32, "maxpool", 0.2)
    assert StreamingLLMPolicy().sink_tokens == 4
    assert (H2OPolicy().ratio, H2OPolicy().recent_fraction) == (0.2, 0.5)
    assert StreamingLLMPolicy().wants_decode_steps and not StreamingLLMPolicy().wants_decode_attention
    assert H2OPolicy().wants_decode_steps and H2OPolicy().wants_decode_attention
