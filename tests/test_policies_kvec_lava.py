"""K-VEC and LAVa against direct implementations of their papers' equations.

The references below are written from the equations with loops and float64 arithmetic (no policy
helper is used to compute them). K-VEC: Algorithm 1 end to end over several layers, its reduction to
SnapKV, the forced entries, and the coverage it buys when heads and layers agree. LAVa: the score, the
flattened head budgets, the entropy layer budgets (exact totals, caps, flat beats peaked) and the
cascading schedule with its prefill peak. Both run end to end on a tiny random model.
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
from vllm_kvpress_ext.policies import KVECPolicy, LavaPolicy, PolicyConfigError, SnapKVPolicy, load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.capture import LayerCapture
from vllm_kvpress_ext.policies.kvec import STATE_KEY as KVEC_STATE
from vllm_kvpress_ext.policies.kvec import head_coverage, unique_token_coverage
from vllm_kvpress_ext.policies.lava import (
    cascade_schedule,
    layer_budgets,
    normalized_entropy,
    prefill_peak_entries,
)

# ----------------------------------------------------------------------------- synthetic inputs


def make_layer(
    seed: int, n: int, layer: int, num_layers: int, hkv: int = 4, hq: int = 8, captured: int = 32, d: int = 8
) -> LayerPrefill:
    g = torch.Generator().manual_seed(seed)
    captured = min(captured, n)
    return LayerPrefill(
        layer=layer,
        num_layers=num_layers,
        keys=torch.randn(hkv, n, d, generator=g) * 1.5,
        values=torch.randn(hkv, n, d, generator=g),
        positions=torch.arange(n),
        capture=LayerCapture(
            queries=torch.randn(captured, hq, d, generator=g) * 1.5, query_positions=torch.arange(n - captured, n)
        ),
        model=None,  # type: ignore[arg-type]
        scale=d**-0.5,
    )


def run_prefill(policy: Any, layers: list[LayerPrefill]) -> tuple[KeepPlan, torch.Tensor, dict[str, Any]]:
    state: dict[str, Any] = {}
    results = [policy.on_layer_prefilled(layer, state) for layer in layers]
    first = layers[0]
    assert first.capture is not None and first.capture.queries is not None
    request = RequestPrefill("r", len(layers), first.num_kv_heads, first.capture.queries.shape[1], first.length)
    plan = policy.plan(request, results, state)
    mask = torch.zeros(len(layers), first.num_kv_heads, first.length, dtype=torch.bool)
    for layer in range(len(layers)):
        for head in range(first.num_kv_heads):
            mask[layer, head, plan.indices[layer, head, : int(plan.lengths[layer, head])]] = True
    return plan, mask, state


def kept_sets(mask: torch.Tensor) -> list[list[list[int]]]:
    return [[torch.nonzero(row).view(-1).tolist() for row in layer] for layer in mask]


# ----------------------------------------------------------------------------- reference helpers


def ref_attention(layer: LayerPrefill, last: int) -> list[list[list[float]]]:
    """attn[q][i][t] for query head q and the `last` captured queries i (float64, causal by position)."""
    cap = layer.capture
    assert cap is not None and cap.queries is not None and cap.query_positions is not None
    hq = cap.queries.shape[1]
    group = hq // layer.num_kv_heads
    rows_total = cap.queries.shape[0]
    out = []
    for q in range(hq):
        keys = layer.keys[q // group].double()
        rows = []
        for i in range(rows_total - min(last, rows_total), rows_total):
            logits = (keys @ cap.queries[i, q].double()).tolist()
            allowed = [t for t in range(layer.length) if int(layer.positions[t]) <= int(cap.query_positions[i])]
            top = max(logits[t] * layer.scale for t in allowed)
            weights = [math.exp(logits[t] * layer.scale - top) if t in allowed else 0.0 for t in range(layer.length)]
            total = sum(weights)
            rows.append([w / total for w in weights])
        out.append(rows)
    return out


def ref_pool(values: list[float], kernel: int, how: str) -> list[float]:
    """Pooling with kernel // 2 padding entries on each side; average pooling counts them as zeros."""
    half = kernel // 2
    out = []
    for j in range(len(values)):
        around = values[max(0, j - half) : j + half + 1]
        out.append(sum(around) / kernel if how == "avgpool" else max(around))
    return out


def ref_top(scores: list[float], count: int, exclude: set[int] | None = None) -> list[int]:
    skip = exclude or set()
    return sorted((j for j in range(len(scores)) if j not in skip), key=lambda j: (-scores[j], j))[:count]


def ref_budget(n: int, ratio: float | None, tokens: int | None) -> int:
    return min(n, max(1, round(ratio * n))) if ratio is not None else min(n, tokens)  # type: ignore[type-var]


# ----------------------------------------------------------------------------- K-VEC reference (Algorithm 1)


def ref_window_mean(attn: list[list[list[float]]], hkv: int, prefix: int, gqa: str, kernel: int, pooling: str):  # type: ignore[no-untyped-def]
    """P[h][t]: mean over the rows of attn, reduced over each KV head's query heads, pooled."""
    group = len(attn) // hkv
    per_q = [[sum(row[t] for row in attn[q]) / len(attn[q]) for t in range(prefix)] for q in range(len(attn))]
    out = []
    for h in range(hkv):
        members = per_q[h * group : (h + 1) * group]
        if gqa == "mean":
            reduced = [sum(m[t] for m in members) / group for t in range(prefix)]
        else:
            reduced = [max(m[t] for m in members) for t in range(prefix)]
        out.append(ref_pool(reduced, kernel, pooling) if kernel > 1 else reduced)
    return out


def ref_kvec(layers: list[LayerPrefill], policy: KVECPolicy) -> tuple[list[list[list[int]]], dict[int, int]]:
    """Algorithm 1 over the layers in order; returns kept indices per (layer, head) and the counts n_t."""
    hits: dict[int, int] = {}
    result = []
    for layer in layers:
        n, hkv = layer.length, layer.num_kv_heads
        budget = ref_budget(n, policy.ratio, policy.tokens)
        window = min(policy.window, n, budget)
        if budget >= n:
            kept = [list(range(n)) for _ in range(hkv)]
        elif budget == window:
            kept = [list(range(n - window, n)) for _ in range(hkv)]
        else:
            prefix = n - window
            attn = ref_attention(layer, policy.window)
            p = ref_window_mean(attn, hkv, prefix, policy.gqa_reduction, policy.kernel_size, policy.pooling)
            p_cov = [list(row) for row in p]
            if policy.delta > 0:
                sigma = []
                for h in range(hkv):
                    mean = sum(p[h]) / prefix
                    sigma.append(math.sqrt(sum((x - mean) ** 2 for x in p[h]) / prefix))
                low = sorted(range(hkv), key=lambda h: (sigma[h], h))[: policy.delta]
                attn_ext = ref_attention(layer, policy.extended_window)
                p_ext = ref_window_mean(attn_ext, hkv, prefix, policy.gqa_reduction, policy.kernel_size, policy.pooling)
                for h in low:
                    p_cov[h] = p_ext[h]
            importance = [
                sum(max(attn[q][i][t] for q in range(len(attn))) for i in range(len(attn[0]))) / len(attn[0])
                for t in range(prefix)
            ]
            focus = [importance[t] * (1 - hits.get(t, 0) / (layer.layer + 1)) for t in range(prefix)]
            forced_count = min(int(policy.beta * budget), budget - window)
            kept = []
            for h in range(hkv):
                p_prime = [p_cov[h][t] + policy.lam * focus[t] for t in range(prefix)]
                forced = set(ref_top(p[h], forced_count))
                rest = ref_top(p_prime, budget - window - forced_count, exclude=forced)
                kept.append(sorted(forced | set(rest) | set(range(prefix, n))))
        for t in set().union(*map(set, kept)):
            hits[t] = hits.get(t, 0) + 1
        result.append(kept)
    return result, hits


KVEC_CASES = [
    # n, budget, params
    (64, {"tokens": 24}, {}),
    (64, {"tokens": 40}, {"lam": 2.0, "beta": 0.5}),
    (48, {"ratio": 0.5}, {"gqa_reduction": "max", "delta": 2}),
    (64, {"tokens": 24}, {"kernel_size": 3, "pooling": "maxpool", "extended_window": 24}),
    (64, {"tokens": 20}, {"beta": 1.0, "delta": 4}),
    (64, {"ratio": 0.2}, {}),  # budget 13 < window 16: the window shrinks, nothing is ranked
    (12, {"tokens": 16}, {}),  # prompt shorter than the window: kept whole
]


@pytest.mark.parametrize("n, budget, params", KVEC_CASES)
def test_kvec_matches_algorithm_1(n: int, budget: dict[str, Any], params: dict[str, Any]) -> None:
    policy = load_policy({"name": "kvec", **budget, **params})
    assert isinstance(policy, KVECPolicy)
    layers = [make_layer(100 + i, n, i, 3) for i in range(3)]
    plan, mask, state = run_prefill(policy, layers)
    expected, hits = ref_kvec(layers, policy)
    assert kept_sets(mask) == expected
    per_head = ref_budget(n, policy.ratio, policy.tokens)
    assert (plan.lengths == per_head).all()  # every head keeps exactly B
    counts = state[KVEC_STATE]
    assert counts.tolist() == [float(hits.get(t, 0)) for t in range(n)]


@pytest.mark.parametrize("kernel, pooling", [(1, "avgpool"), (5, "avgpool"), (7, "maxpool")])
@pytest.mark.parametrize(
    "n, budget", [(80, {"tokens": 30}), (80, {"ratio": 0.25}), (80, {"ratio": 0.1}), (10, {"tokens": 16})]
)
def test_kvec_without_coverage_is_snapkv(kernel: int, pooling: str, n: int, budget: dict[str, Any]) -> None:
    kvec = load_policy({"name": "kvec", "lam": 0.0, "delta": 0, "kernel_size": kernel, "pooling": pooling, **budget})
    snap = load_policy({"name": "snapkv", "window": 16, "kernel_size": kernel, "pooling": pooling, **budget})
    assert isinstance(kvec, KVECPolicy) and isinstance(snap, SnapKVPolicy)
    assert kvec.capture_spec().window == 16
    layers = [make_layer(200 + i, n, i, 3, captured=16) for i in range(3)]
    _, kvec_mask, _ = run_prefill(kvec, layers)
    _, snap_mask, _ = run_prefill(snap, layers)
    assert torch.equal(kvec_mask, snap_mask)


def test_kvec_forced_entries_always_kept() -> None:
    n, tokens = 96, 32
    # A large lambda lets the focus term dominate P'; the forced top-beta*B by P must survive anyway.
    policy = load_policy({"name": "kvec", "tokens": tokens, "lam": 50.0, "beta": 0.25})
    assert isinstance(policy, KVECPolicy)
    layers = [make_layer(300 + i, n, i, 4) for i in range(4)]
    _, mask, _ = run_prefill(policy, layers)
    forced = int(0.25 * tokens)
    displaced = 0
    for layer in layers:
        attn = ref_attention(layer, policy.window)
        p = ref_window_mean(attn, layer.num_kv_heads, n - 16, "mean", 1, "avgpool")
        for h in range(layer.num_kv_heads):
            top = ref_top(p[h], forced)
            assert all(mask[layer.layer, h, t] for t in top), (layer.layer, h)
            beyond = ref_top(p[h], tokens - 16)  # SnapKV's choice for this head
            displaced += sum(not mask[layer.layer, h, t] for t in beyond)
    assert displaced > 0  # the coverage terms did change the selection beyond the forced entries


def agreeing_layers(num_layers: int, n: int, hkv: int = 4, hq: int = 8, d: int = 8) -> list[LayerPrefill]:
    """Every head of every layer sees the same keys and queries: heads and layers agree on importance."""
    g = torch.Generator().manual_seed(7)
    keys = (torch.randn(1, n, d, generator=g) * 1.2).expand(hkv, n, d).contiguous()
    queries = (torch.randn(32, 1, d, generator=g) * 1.2).expand(32, hq, d).contiguous()
    values = torch.randn(hkv, n, d, generator=g)
    capture = LayerCapture(queries=queries, query_positions=torch.arange(n - 32, n))
    return [
        LayerPrefill(layer, num_layers, keys, values, torch.arange(n), capture, None, d**-0.5)  # type: ignore[arg-type]
        for layer in range(num_layers)
    ]


def test_kvec_covers_more_unique_tokens_than_snapkv_when_heads_and_layers_agree() -> None:
    layers = agreeing_layers(num_layers=6, n=160)
    rows = {}
    for spec in (
        {"name": "kvec", "tokens": 40},
        {"name": "snapkv", "tokens": 40, "window": 16, "kernel_size": 1},
        {"name": "snapkv", "tokens": 40, "window": 16},
    ):
        policy = load_policy(spec)
        plan, mask, _ = run_prefill(policy, layers)
        assert int(plan.lengths.sum()) == 6 * 4 * 40  # equal budget
        label = f"{spec['name']}-k{getattr(policy, 'kernel_size', '')}"
        rows[label] = (unique_token_coverage(mask), head_coverage(mask))
        assert unique_token_coverage(plan, 160) == pytest.approx(rows[label][0])
    kvec_all, kvec_heads = rows["kvec-k1"]
    for label, (cov_all, cov_heads) in rows.items():
        if label != "kvec-k1":
            assert kvec_all > cov_all, rows
            assert kvec_heads > cov_heads, rows
    # SnapKV keeps the same 40 tokens everywhere when everything agrees.
    assert rows["snapkv-k1"][0] == pytest.approx(40 / 160)


def test_kvec_state_is_per_request() -> None:
    policy = load_policy({"name": "kvec", "tokens": 24})
    assert isinstance(policy, KVECPolicy)
    a = [make_layer(400 + i, 64, i, 3) for i in range(3)]
    b = [make_layer(500 + i, 64, i, 3) for i in range(3)]
    _, alone, _ = run_prefill(policy, b)
    # Interleaving another request's layers (each request has its own state) changes nothing.
    state_a: dict[str, Any] = {}
    state_b: dict[str, Any] = {}
    results_b = []
    for la, lb in zip(a, b, strict=True):
        policy.on_layer_prefilled(la, state_a)
        results_b.append(policy.on_layer_prefilled(lb, state_b))
    assert torch.equal(torch.stack(results_b), alone)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "kvec", "extended_window": 8}, "extended_window"),
        ({"name": "kvec", "delta": -1}, "delta"),
        ({"name": "kvec", "lam": -0.5}, "lam"),
        ({"name": "kvec", "beta": 1.5}, "beta"),
        ({"name": "kvec", "window": 0}, "window"),
        ({"name": "kvec", "tokens": 8}, "smaller than the protected window 16"),
        ({"name": "kvec", "lambda": 1.0}, "unknown parameter"),
        ({"name": "lava", "gqa_reduction": "sum"}, "gqa_reduction"),
        ({"name": "lava", "kernel_size": 6}, "kernel_size"),
        ({"name": "lava", "tokens": 16}, "smaller than the protected window 32"),
        ({"name": "lava", "floor_alpha": 0.2}, "unknown parameter"),
    ],
)
def test_invalid_parameters_are_rejected(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy(spec)


def test_presets_hold_the_documented_defaults() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    kvec, lava = KVECPolicy(), LavaPolicy()
    assert load_policy("kvec") == load_policy(str(root / "kvec.yaml")) == kvec
    assert load_policy("lava") == load_policy(str(root / "lava.yaml")) == lava
    assert (kvec.window, kvec.extended_window, kvec.delta, kvec.lam, kvec.beta) == (16, 32, 3, 1.0, 0.25)
    assert (kvec.ratio, kvec.kernel_size, kvec.gqa_reduction) == (0.25, 1, "mean")
    assert (lava.window, lava.kernel_size, lava.pooling, lava.gqa_reduction, lava.ratio) == (
        32,
        7,
        "maxpool",
        "max",
        0.25,
    )
    assert kvec.capture_spec().window == 32 and lava.capture_spec().window == 32


# ----------------------------------------------------------------------------- LAVa reference


def ref_lava_scores(layer: LayerPrefill, window: int, kernel: int, pooling: str, gqa: str) -> list[list[float]]:
    """s[h][i] = max over the group of pool( max_k ||V_k||_1 / w * sum_j A[q, j, i] ), i over the prefix."""
    n, hkv = layer.length, layer.num_kv_heads
    prefix = n - window
    attn = ref_attention(layer, window)
    w = len(attn[0])
    group = len(attn) // hkv
    norms = [max(sum(abs(float(x)) for x in layer.values[h, k]) for k in range(prefix)) for h in range(hkv)]
    per_q = []
    for q in range(len(attn)):
        sums = [sum(row[i] for row in attn[q]) for i in range(prefix)]
        per_q.append([x * norms[q // group] / w for x in ref_pool(sums, kernel, pooling)])
    out = []
    for h in range(hkv):
        members = per_q[h * group : (h + 1) * group]
        reduce = max if gqa == "max" else (lambda xs: sum(xs) / len(xs))
        out.append([reduce([m[i] for m in members]) for i in range(prefix)])
    return out


def ref_entropy(scores: list[list[float]]) -> float:
    flat = [x for row in scores for x in row]
    total = sum(flat)
    return -sum(x / total * math.log(x / total) for x in flat if x > 0) / math.log(len(flat))


def ref_layer_budgets(entropies: list[float], total: int, cap: int) -> list[int]:
    """e_l / sum(e) * total, capped at `cap` (excess re-shared by the same rule), rounded by largest remainder."""
    shares: dict[int, Fraction] = {}
    remaining, free = Fraction(total), list(range(len(entropies)))
    while free:
        weight = sum(Fraction(entropies[i]) for i in free)
        over = [i for i in free if Fraction(entropies[i]) / weight * remaining >= cap]
        if not over:
            shares.update({i: Fraction(entropies[i]) / weight * remaining for i in free})
            break
        for i in over:
            shares[i] = Fraction(cap)
            remaining -= cap
            free.remove(i)
    rounded = {i: math.floor(s) for i, s in shares.items()}
    order = sorted(shares, key=lambda i: (rounded[i] - shares[i], i))
    for i in order[: total - sum(rounded.values())]:
        rounded[i] += 1
    return [rounded[i] for i in range(len(entropies))]


@pytest.mark.parametrize("gqa, kernel, pooling", [("max", 7, "maxpool"), ("mean", 3, "avgpool")])
def test_lava_scores_equal_the_equation(gqa: str, kernel: int, pooling: str) -> None:
    policy = LavaPolicy(tokens=40, ratio=None, window=8, kernel_size=kernel, pooling=pooling, gqa_reduction=gqa)
    policy.validate()
    layer = make_layer(600, 48, 0, 1, captured=8)
    got = policy.lava_scores(layer, 48 - 8)
    expected = torch.tensor(ref_lava_scores(layer, 8, kernel, pooling, gqa), dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "n, budget", [(64, {"tokens": 20}), (64, {"ratio": 0.5}), (40, {"tokens": 36}), (64, {"tokens": 60})]
)
def test_lava_matches_reference_and_budgets_are_exact(n: int, budget: dict[str, Any]) -> None:
    window, num_layers, hkv = 8, 4, 4
    policy = load_policy({"name": "lava", "window": window, **budget})
    assert isinstance(policy, LavaPolicy)
    layers = [make_layer(700 + i, n, i, num_layers, captured=window) for i in range(num_layers)]
    plan, mask, state = run_prefill(policy, layers)
    b = ref_budget(n, policy.ratio, policy.tokens)
    scores = [ref_lava_scores(layer, window, 7, "maxpool", "max") for layer in layers]
    entropies = [ref_entropy(s) for s in scores]
    assert state["lava"]["entropies"] == pytest.approx(entropies, rel=1e-6)
    selectable = ref_layer_budgets(entropies, num_layers * hkv * (b - window), hkv * (n - window))
    expected = []
    for s, count in zip(scores, selectable, strict=True):
        ranked = sorted(((h, i) for h in range(hkv) for i in range(n - window)), key=lambda hi: (-s[hi[0]][hi[1]], hi))
        won = [set() for _ in range(hkv)]
        for h, i in ranked[:count]:
            won[h].add(i)
        expected.append([sorted(k | set(range(n - window, n))) for k in won])
    assert kept_sets(mask) == expected
    # Per-layer head budgets sum to B_l; layer budgets sum to the total L * H * B.
    assert plan.lengths.sum(-1).tolist() == state["lava"]["layer_budgets"]
    assert int(plan.lengths.sum()) == num_layers * hkv * b
    assert (plan.lengths >= window).all()


def peaked_and_flat_layers(n: int = 64, hkv: int = 2, hq: int = 4, d: int = 8) -> list[LayerPrefill]:
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(hkv, n, d, generator=g)
    values = torch.randn(hkv, n, d, generator=g)
    peaked_q = keys[:, 5].repeat_interleave(hq // hkv, dim=0).expand(8, hq, d) * 6.0  # all mass on entry 5
    flat_q = torch.zeros(8, hq, d)  # uniform attention
    layers = []
    for layer, queries in enumerate([peaked_q, flat_q, peaked_q * 0.3]):
        capture = LayerCapture(queries=queries.contiguous(), query_positions=torch.arange(n - 8, n))
        layers.append(LayerPrefill(layer, 3, keys, values, torch.arange(n), capture, None, d**-0.5))  # type: ignore[arg-type]
    return layers


def test_lava_flatter_layer_gets_more_budget() -> None:
    policy = load_policy({"name": "lava", "tokens": 16, "window": 8})
    plan, _, state = run_prefill(policy, peaked_and_flat_layers())
    peaked, flat, mild = state["lava"]["entropies"]
    assert flat > mild > peaked
    budgets = state["lava"]["layer_budgets"]
    assert budgets[1] > budgets[2] > budgets[0]
    assert sum(budgets) == 3 * 2 * 16 and plan.lengths.sum(-1).tolist() == budgets


def test_layer_budgets_are_exact_capped_and_proportional() -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(200):
        num_layers = int(torch.randint(1, 12, (1,), generator=g))
        cap = int(torch.randint(1, 300, (1,), generator=g))
        total = int(torch.randint(0, cap * num_layers + 1, (1,), generator=g))
        entropies = (torch.rand(num_layers, generator=g) ** 3).tolist()
        if trial % 10 == 0:
            entropies[0] = 0.0
        budgets = layer_budgets(entropies, total, cap)
        assert sum(budgets) == total and all(0 <= b <= cap for b in budgets)
        if not all(e > 0 for e in entropies):
            continue
        assert budgets == ref_layer_budgets(entropies, total, cap)
        # Proportional where no cap binds: within one entry of the real share.
        if all(e / sum(entropies) * total < cap for e in entropies):
            assert all(abs(b - e / sum(entropies) * total) < 1 for b, e in zip(budgets, entropies, strict=True))
    assert layer_budgets([0.0, 0.0], 10, 100) == [5, 5]
    assert layer_budgets([1.0, 0.0], 150, 100) == [100, 50]  # the idle layer takes what the capped one cannot
    assert normalized_entropy(torch.ones(3, 5)) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0.0, 2.0, 0.0])) == pytest.approx(0.0)


def test_cascade_shrinks_earlier_layers_and_bounds_the_prefill_peak() -> None:
    g = torch.Generator().manual_seed(12)
    for _ in range(100):
        num_layers = int(torch.randint(2, 10, (1,), generator=g))
        heads, n, window = 2, int(torch.randint(40, 400, (1,), generator=g)), 8
        b = int(torch.randint(window + 1, n, (1,), generator=g))
        total, cap = num_layers * heads * (b - window), heads * (n - window)
        entropies = (0.2 + torch.rand(num_layers, generator=g)).tolist()
        steps = cascade_schedule(entropies, total, cap)
        assert steps[-1] == layer_budgets(entropies, total, cap)  # the cascade ends at the one-shot allocation
        for before, after in itertools.pairwise(steps):
            assert len(after) == len(before) + 1
            assert all(a <= bb for a, bb in zip(after, before, strict=False)), (before, after)  # only shrinks
            assert all(x <= cap for x in after)
        peak = prefill_peak_entries(steps, heads, n, window)
        assert peak["one_shot"] == num_layers * heads * n
        # Never more than the final budget plus one whole layer (and the round-up slack of the steps).
        assert peak["cascading"] <= total + num_layers * heads * window + heads * n + num_layers
        assert peak["cascading"] <= peak["one_shot"]
    # A long prompt: the cascade holds about the budget plus one layer instead of every layer whole.
    steps = cascade_schedule([1.0] * 32, 32 * 8 * (512 - 32), 8 * (32768 - 32))
    peak = prefill_peak_entries(steps, 8, 32768, 32)
    assert peak["one_shot"] == 32 * 8 * 32768 and peak["cascading"] < peak["one_shot"] / 10


def test_lava_cascade_recompression_keeps_nested_subsets() -> None:
    """Re-compressing earlier layers to each step's budget drops entries only; the last step is the plan."""
    n, window, num_layers, hkv = 64, 8, 4, 4
    policy = load_policy({"name": "lava", "tokens": 16, "window": window})
    assert isinstance(policy, LavaPolicy)
    layers = [make_layer(800 + i, n, i, num_layers, captured=window) for i in range(num_layers)]
    state: dict[str, Any] = {}
    results = []
    held: list[set[tuple[int, int]]] = []
    for layer in layers:
        results.append(policy.on_layer_prefilled(layer, state))
        step = state["lava"]["cascade"][-1]
        assert len(step) == layer.layer + 1
        now = []
        for scores, count in zip(results, step, strict=True):
            flat = sorted(
                ((h, i) for h in range(hkv) for i in range(n - window)), key=lambda hi: (-float(scores[hi]), hi)
            )
            now.append(set(flat[:count]))
        for before, after in zip(held, now, strict=False):
            assert after <= before
        held = now
    plan = policy.plan(RequestPrefill("r", num_layers, hkv, 8, n), results, state)
    for layer, kept in enumerate(held):
        for h in range(hkv):
            row = set(plan.indices[layer, h, : int(plan.lengths[layer, h])].tolist()) - set(range(n - window, n))
            assert row == {i for hh, i in kept if hh == h}
    peak = state["lava"]["prefill_peak_entries"]
    assert peak["cascading"] < peak["one_shot"] == num_layers * hkv * n


# ----------------------------------------------------------------------------- engine runs

PAGE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with 4 layers, 8 query heads and 4 KV heads (so delta = 3 < H)."""
    config = LlamaConfig(
        **{
            **TINY,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
        }
    )
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny_llama_kvec_lava")
    model.save_pretrained(path)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SPECS: list[Any] = ["kvec", "lava", {"name": "kvec", "tokens": 24}, {"name": "lava", "tokens": 40, "window": 8}]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_generate_end_to_end(model_dir: Path, spec: Any) -> None:
    llm = LLM(model_dir, dtype=torch.float32, num_pages=2048, page_size=PAGE, max_num_batched_tokens=64, kv_policy=spec)
    prompts = [prompt_ids(n, 20 + n) for n in (5, 48, 150)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    decoded = 7  # the 8th token is sampled, never fed back
    policy = load_policy(spec)
    finished = run_recording(llm.engine, prompts, params)  # the engine's default policy
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for request, prompt in zip(finished, prompts, strict=True):
        n = len(prompt)
        assert len(request.output.output_token_ids) == 8
        # Per-head and per-layer sizes differ, but the mean is the budget's, exactly.
        check_kept(request, n, decoded, budget_per_head(policy, n))
        if request.output.kv.tokens_kept == request.output.kv.tokens_full:  # nothing dropped
            assert request.output.output_token_ids == hf_greedy(hf, prompt, 8)
        if n == 150:
            assert request.output.kv.retention < 0.5
    assert llm.engine.cache.pool.num_used == 0


@pytest.mark.parametrize("spec", [{"name": "kvec", "tokens": 24}, {"name": "lava", "tokens": 40, "window": 8}], ids=str)
def test_plan_frees_what_it_drops_and_keeps_the_budget(model_dir: Path, spec: dict[str, Any]) -> None:
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=2048, page_size=PAGE, max_num_batched_tokens=37)
    policy = load_policy(spec)
    assert policy is not None
    seen: list[tuple[KeepPlan, dict[str, Any]]] = []
    original = policy.plan

    def recording_plan(request: RequestPrefill, results: list[Any], state: dict[str, Any]) -> KeepPlan | None:
        plan = original(request, results, state)
        assert plan is not None
        seen.append((plan, state))
        return plan

    policy.plan = recording_plan  # type: ignore[method-assign]
    n = 101
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # no decode step: only the plan acts
    rid = engine.add_request(prompt_ids(n, 3), params, policy=policy)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    ((plan, state),) = seen
    assert out is not None
    layers, heads = plan.lengths.shape
    assert out.kv.tokens_kept == int(plan.lengths.sum()) == layers * heads * spec["tokens"]
    assert out.kv.kept_per_head == plan.lengths.tolist()
    assert out.kv.kv_bytes < out.kv.kv_bytes_peak
    assert engine.cache.pool.num_used == 0
    if spec["name"] == "kvec":
        assert (plan.lengths == spec["tokens"]).all()
        assert state[KVEC_STATE].max() <= layers
    else:
        assert plan.lengths.sum(-1).tolist() == state["lava"]["layer_budgets"]
        assert len(state["lava"]["entropies"]) == len(state["lava"]["cascade"]) == layers
        peak = state["lava"]["prefill_peak_entries"]
        assert peak["one_shot"] == layers * heads * n and peak["cascading"] < peak["one_shot"]


def test_coverage_metrics_by_hand() -> None:
    """Exact values on a hand-made keep set: position 0 kept by one head only, position 3 by nobody."""
    keep = torch.zeros(2, 2, 4, dtype=torch.bool)
    keep[0, 0, [0, 1]] = True
    keep[1, 1, [1, 2]] = True
    assert unique_token_coverage(keep) == 0.75  # {0, 1, 2} of 4 tokens
    assert head_coverage(keep) == 0.5  # each layer holds 2 of 4 tokens across its heads
    plan = KeepPlan.from_mask(keep)
    assert unique_token_coverage(plan, 4) == 0.75
    assert unique_token_coverage(plan, 8) == 0.375  # the same plan over a longer prompt
    empty = torch.zeros(2, 2, 0, dtype=torch.bool)
    assert unique_token_coverage(empty) == head_coverage(empty) == 1.0
    assert unique_token_coverage(KeepPlan.from_mask(empty), 0) == 1.0
    with pytest.raises(ValueError, match="needs the prompt length"):
        unique_token_coverage(plan)


@pytest.mark.parametrize(
    "budget, n, kept",
    [
        ({"tokens": 40, "ratio": None}, 30, range(30)),  # the prompt fits the budget: all of it stays
        ({"ratio": 0.1}, 40, range(36, 40)),  # round(0.1 * 40) = 4 < the window: the window shrinks to 4
    ],
    ids=["fits", "ratio-below-window"],
)
def test_lava_short_prompts_keep_the_budget_in_both_forms(budget: dict[str, Any], n: int, kept: range) -> None:
    """Nothing to rank: one-shot `plan` and every cascade step keep the same last entries, at the same budgets."""
    layers, heads = 3, 2
    request = RequestPrefill("r", layers, heads, 4, n)
    expected = torch.zeros(heads, n, dtype=torch.bool)
    expected[:, list(kept)] = True
    one_shot = LavaPolicy(window=8, **budget)
    one_shot.validate()
    state: dict[str, Any] = {}
    plan = one_shot.plan(request, [torch.zeros(heads, 0)] * layers, state)
    assert torch.equal(plan.to_mask(torch.full((layers, heads), n)), expected.expand(layers, heads, n))
    assert state["lava"]["layer_budgets"] == [heads * len(kept)] * layers
    cascading = LavaPolicy(window=8, cascading=True, **budget)
    state = {}
    for layer in range(layers):
        keep = cascading.plan_layer(request, layer, [torch.zeros(heads, 0)] * (layer + 1), state)
        assert keep.layers == [layer]
        assert torch.equal(keep.masks, expected.unsqueeze(0))
        assert ("layer_budgets" in state["lava"]) == (layer == layers - 1)  # recorded once the last layer is in
    assert state["lava"]["layer_budgets"] == [heads * len(kept)] * layers
