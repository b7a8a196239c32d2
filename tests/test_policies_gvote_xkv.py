"""GVote and XKV against plain re-implementations of their papers' algorithms.

GVote: the keep sets on synthetic tensors equal a loop-based Algorithm 1 written here from the
paper's equations (its own projection, q_norm, averaged RoPE and nucleus); peaked attention keeps
less than diffuse attention; keep sets grow with S and p_nuc; memory differs per request.
XKV: the greedy allocation equals the brute-force optimum, the R_avg mode returns the minimal
total, plans equal a reference, budgets are exact, and profiles round-trip through YAML.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from model_utils import TINY, budget_per_head, check_kept, hf_greedy, run_recording, write_suite_model
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvpress_ext.bench.xkv_profile import profile_xkv
from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.engine import LLM, LLMEngine, SamplingParams
from vllm_kvpress_ext.models.config import ModelConfig
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.policies import GVotePolicy, PolicyConfigError, XKVPolicy, load_policy
from vllm_kvpress_ext.policies.adakv import AdaKVPolicy
from vllm_kvpress_ext.policies.base import LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.capture import LayerCapture
from vllm_kvpress_ext.policies.gvote import nucleus_size, vote
from vllm_kvpress_ext.policies.xkv import (
    XKVProfile,
    allocation_for_target,
    allocation_from_fractions,
    coverage_ratio,
    greedy_allocation,
)
from vllm_kvpress_ext.tasks.synthetic import TASKS, build_prompt, generate

# ----------------------------------------------------------------------------- shared helpers

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3_rope": {
        "architectures": ["LlamaForCausalLM"],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2_bias": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3_qnorm": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 24},
}


def algorithm1(**params: Any) -> GVotePolicy:
    """GVote as the paper's Algorithm 1 (`allocation: votes`): the votes' union is each head's keep set."""
    return GVotePolicy(allocation="votes", **params)


def tiny_model(family: str, seed: int = 0) -> LlamaFamilyForCausalLM:
    """This project's model class with random weights (norms and biases too), 2 layers, 4 q heads, 2 KV heads."""
    config = ModelConfig.from_dict({**TINY, "rope_theta": 10000.0, **FAMILY_CONFIGS[family]})
    torch.manual_seed(seed)
    model = LlamaFamilyForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    return model


def run_prefill(policy: Any, layers: list[LayerPrefill]) -> tuple[KeepPlan, dict[str, Any]]:
    state: dict[str, Any] = {}
    results = [policy.on_layer_prefilled(layer, state) for layer in layers]
    first = layers[0]
    request = RequestPrefill("r", len(layers), first.num_kv_heads, 4, first.length)
    return policy.plan(request, results, state), state


def kept_sets(plan: KeepPlan) -> list[list[set[int]]]:
    return [
        [set(plan.indices[layer, h, : int(plan.lengths[layer, h])].tolist()) for h in range(plan.lengths.shape[1])]
        for layer in range(plan.lengths.shape[0])
    ]


# ----------------------------------------------------------------------------- GVote


def gvote_layer(model: LlamaFamilyForCausalLM, layer: int, n: int, seed: int, query_scale: float = 1.0) -> LayerPrefill:
    """Synthetic prefill of n entries: random keys, last query and hidden-state statistics."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    keys = torch.randn(hkv, n, d, generator=g)
    query = torch.randn(1, hq, d, generator=g) * query_scale
    count = 37
    mean = torch.randn(cfg.hidden_size, generator=g, dtype=torch.float64) * 0.5
    var = torch.rand(cfg.hidden_size, generator=g, dtype=torch.float64) + 0.05
    capture = LayerCapture(
        queries=query,
        query_positions=torch.tensor([n - 1]),
        hidden_sum=mean * count,
        hidden_sq_sum=(var + mean * mean) * count,
        hidden_count=count,
    )
    return LayerPrefill(
        layer, cfg.num_hidden_layers, keys, torch.randn_like(keys), torch.arange(n), capture, model, d**-0.5
    )


def gvote_by_hand(
    layer: LayerPrefill, p_nuc: float, samples: int, future: int, seed: int, window: int = 0, sinks: int = 0
) -> list[set[int]]:
    """Algorithm 1 with loops, in float64, from the model's raw weights."""
    model, cap, n = layer.model, layer.capture, layer.length
    assert cap is not None and cap.queries is not None and cap.query_positions is not None
    attn = model.layers[layer.layer].self_attn
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // hkv
    keys = layer.keys.double()
    # 1. step budget: nucleus of the last position's real attention, per query head.
    budgets = []
    for h in range(hq):
        q = cap.queries[-1, h].double()
        logits = [float(q @ keys[h // group, j]) * layer.scale for j in range(n)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        mass, k = 0.0, 0
        for p in sorted((w / total for w in weights), reverse=True):
            if mass >= p_nuc:
                break
            mass += p
            k += 1
        budgets.append(k)
    # 2. Gaussian fit and samples (the documented seeding), projected by the layer's own weights.
    mean = cap.hidden_sum / cap.hidden_count  # type: ignore[operator]
    std = (cap.hidden_sq_sum / cap.hidden_count - mean * mean).sqrt()  # type: ignore[operator]
    gen = torch.Generator().manual_seed(seed * 65537 + layer.layer)
    weight = attn.q_proj.weight.detach().double()
    bias = (
        attn.q_proj.bias.detach().double() if attn.q_proj.bias is not None else torch.zeros(hq * d, dtype=torch.float64)
    )
    inv_freq = model.rotary.inv_freq.double()
    last = int(cap.query_positions[-1])
    cos = [sum(math.cos((last + f) * float(inv_freq[i])) for f in range(1, future + 1)) / future for i in range(d // 2)]
    sin = [sum(math.sin((last + f) * float(inv_freq[i])) for f in range(1, future + 1)) / future for i in range(d // 2)]
    keep: list[set[int]] = [set() for _ in range(hkv)]
    for _ in range(samples):
        hidden = mean + std * torch.randn(cfg.hidden_size, generator=gen, dtype=torch.float64)
        q_all = (weight @ hidden + bias).view(hq, d)
        for h in range(hq):
            q = q_all[h]
            if attn.q_norm is not None:
                q = q / math.sqrt(float((q * q).mean()) + attn.q_norm.eps) * attn.q_norm.weight.detach().double()
            rotated = [0.0] * d
            for i in range(d // 2):  # rotate_half pairs (i, i + d/2) by the averaged angle
                a, b = float(q[i]), float(q[i + d // 2])
                rotated[i] = a * cos[i] - b * sin[i]
                rotated[i + d // 2] = b * cos[i] + a * sin[i]
            r = torch.tensor(rotated, dtype=torch.float64)
            scores = [float(r @ keys[h // group, j]) for j in range(n)]
            keep[h // group] |= set(sorted(range(n), key=lambda j: (-scores[j], j))[: budgets[h]])
    for kv in range(hkv):
        keep[kv] |= set(range(max(0, n - window), n)) | set(range(min(sinks, n)))
    return keep


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
@pytest.mark.parametrize(
    "p_nuc, samples, future, seed, window, sinks",
    [(0.95, 8, 32, 0, 0, 0), (0.7, 3, 5, 11, 4, 2)],
    ids=["default", "alt"],
)
def test_gvote_matches_algorithm_1(
    family: str, p_nuc: float, samples: int, future: int, seed: int, window: int, sinks: int
) -> None:
    model = tiny_model(family, seed=1)
    policy = algorithm1(
        p_nuc=p_nuc, num_samples=samples, future_positions=future, window=window, sink_tokens=sinks, seed=seed
    )
    policy.validate()
    assert policy.capture_spec().window == 1 and policy.capture_spec().hidden_stats
    layers = [gvote_layer(model, layer, 40, seed=5 + layer, query_scale=6.0) for layer in range(2)]
    plan, _ = run_prefill(policy, layers)
    expected = [gvote_by_hand(layer, p_nuc, samples, future, seed, window, sinks) for layer in layers]
    assert kept_sets(plan) == expected
    assert int(plan.lengths.max()) < 40  # every (layer, head) dropped something


def test_gvote_peaked_attention_keeps_less_than_diffuse() -> None:
    model = tiny_model("llama3_rope")
    policy = algorithm1()
    diffuse = gvote_layer(model, 0, 64, seed=3, query_scale=0.0)  # uniform attention: B = ceil(0.95 n)
    peaked = gvote_layer(model, 0, 64, seed=3)
    assert peaked.capture is not None and peaked.capture.queries is not None
    for h in range(4):  # each query head points hard at one key of its KV head
        peaked.capture.queries[0, h] = 40.0 * peaked.keys[h // 2, 5 + 7 * h]
    assert policy.step_budgets(diffuse).tolist() == [math.ceil(0.95 * 64)] * 4
    assert policy.step_budgets(peaked).tolist() == [1] * 4
    small, large = policy.on_layer_prefilled(peaked, {}), policy.on_layer_prefilled(diffuse, {})
    assert (small.sum(-1) <= 8 * 2).all()  # at most one key per (sample, query head of the group)
    assert (large.sum(-1) >= math.ceil(0.95 * 64)).all()
    assert not (small & ~large).any()  # same samples, larger budgets: a superset


def test_gvote_keep_sets_grow_with_samples_and_p_nuc() -> None:
    model = tiny_model("qwen3_qnorm")
    layer = gvote_layer(model, 1, 80, seed=9, query_scale=3.0)
    previous = None
    for samples in range(1, 9):
        keep = algorithm1(num_samples=samples).on_layer_prefilled(layer, {})
        if previous is not None:
            assert not (previous & ~keep).any()
        previous = keep
    sizes = []
    previous = None
    for p_nuc in (0.2, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0):
        policy = algorithm1(p_nuc=p_nuc)
        keep = policy.on_layer_prefilled(layer, {})
        if previous is not None:
            assert not (previous & ~keep).any()
        previous = keep
        sizes.append(int(keep.sum()))
    assert sizes[0] < sizes[-1]


def test_gvote_is_reproducible_and_budget_free() -> None:
    model = tiny_model("qwen2_bias")
    layer = gvote_layer(model, 0, 50, seed=4, query_scale=2.0)
    a = algorithm1().on_layer_prefilled(layer, {})
    assert torch.equal(a, algorithm1().on_layer_prefilled(layer, {}))
    assert not torch.equal(a, algorithm1(seed=1).on_layer_prefilled(layer, {}))
    fields = set(GVotePolicy().params())
    assert not fields & {"ratio", "tokens"}


def observed_layer(positions: list[int], queries: list[float]) -> LayerPrefill:
    """One KV head, one query head, d = 1, scale 1: key j is ln(p_j), so query 1.0 attends with p ~ [1, 2, 3, 4]."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    keys = probs.log().float().view(1, 4, 1)
    capture = LayerCapture(
        queries=torch.tensor(queries).view(-1, 1, 1), query_positions=torch.tensor(positions), hidden_count=0
    )
    return LayerPrefill(0, 1, keys, torch.ones_like(keys), torch.arange(4), capture, None, 1.0)  # type: ignore[arg-type]


def test_gvote_observed_votes_are_each_querys_own_nucleus() -> None:
    """Hand-computed: the nucleus of each real query over the keys it could see, then their union."""
    # The query at position 3 sees p = [.1, .2, .3, .4]: at p_nuc 0.65 its nucleus is {3, 2} (0.4 + 0.3 = 0.7).
    # The query at position 1 sees keys 0 and 1 only: p = [1/3, 2/3], nucleus {1} (0.667 >= 0.65).
    layer = observed_layer([1, 3], [1.0, 1.0])
    policy = algorithm1(p_nuc=0.65, observation_window=2)
    assert policy.observed_votes(layer).tolist() == [[False, True, True, True]]
    # A window of 1 takes the last captured query alone; a window longer than the capture takes all of it.
    assert algorithm1(p_nuc=0.65, observation_window=1).observed_votes(layer).tolist() == [[False, False, True, True]]
    assert torch.equal(algorithm1(p_nuc=0.65, observation_window=9).observed_votes(layer), policy.observed_votes(layer))
    # p_nuc 0.95 needs all four keys at position 3 (0.4 + 0.3 + 0.2 = 0.9 < 0.95), both keys at position 1.
    assert algorithm1(p_nuc=0.95, observation_window=2).observed_votes(layer).tolist() == [[True, True, True, True]]
    # Query -1.0 attends the other way round: p = [.48, .24, .16, .12], so at p_nuc 0.45 key 0 alone is its nucleus.
    flipped = observed_layer([3], [-1.0])
    assert algorithm1(p_nuc=0.45, observation_window=1).observed_votes(flipped).tolist() == [
        [True, False, False, False]
    ]


def test_gvote_pooled_votes_keep_spans() -> None:
    """Hand-computed: scores [0, 0, 5, 0, 0, 1, 0] with B = 3 keep {0, 2, 5} unpooled and the span {1, 2, 3}
    max-pooled over 3 positions ([0, 5, 5, 5, 1, 1, 1]; the peak's neighbours tie with it)."""
    keys = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 1.0, 0.0]).view(1, 7, 1)
    query = torch.ones(1, 1, 1)
    budget = torch.tensor([3])
    assert torch.nonzero(vote(query, keys, budget)[0]).flatten().tolist() == [0, 2, 5]
    assert torch.nonzero(vote(query, keys, budget, kernel_size=3)[0]).flatten().tolist() == [1, 2, 3]
    # The observed votes rank on pooled scores too, sized by their own nucleus (2 at p_nuc .65: .4 + .3), and
    # never pick a key their query could not see: position 1 sees keys 0 and 1 only, whatever the pooling.
    policy = algorithm1(p_nuc=0.65, observation_window=2, kernel_size=3)
    assert policy.observed_votes(observed_layer([3], [1.0])).tolist() == [[False, False, True, True]]
    early = algorithm1(p_nuc=0.99, observation_window=1, kernel_size=3).observed_votes(observed_layer([1], [1.0]))
    assert early.tolist() == [[True, True, False, False]]
    for bad in (0, 2, 65):
        with pytest.raises(PolicyConfigError, match="kernel_size"):
            load_policy({"name": "gvote", "kernel_size": bad})


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_gvote_observation_window_adds_the_real_queries_votes(family: str) -> None:
    """on_layer_prefilled = Algorithm 1's union | the observed queries' nuclei; window 0 is Algorithm 1 exactly."""
    model = tiny_model(family, seed=2)
    for index in range(2):
        layer = gvote_layer(model, index, 48, seed=7 + index, query_scale=4.0)
        assert layer.capture is not None and layer.capture.queries is not None
        extra = torch.randn(5, *layer.capture.queries.shape[1:], generator=torch.Generator().manual_seed(index)) * 4.0
        layer.capture.queries = torch.cat([extra, layer.capture.queries])
        layer.capture.query_positions = torch.arange(43, 49) - 1
        paper = algorithm1().on_layer_prefilled(layer, {})
        assert torch.equal(paper, algorithm1(observation_window=0).on_layer_prefilled(layer, {}))
        for window in (1, 3, 6):
            policy = algorithm1(observation_window=window)
            assert policy.capture_spec().window == window
            observed = policy.on_layer_prefilled(layer, {})
            assert torch.equal(observed, paper | policy.observed_votes(layer))
            # Every observed query's own nucleus is inside the union, whatever the synthetic votes chose.
            for q in range(6 - window, 6):
                alone = algorithm1(observation_window=1)
                one = gvote_layer(model, index, 48, seed=7 + index, query_scale=4.0)
                assert one.capture is not None
                one.capture.queries = layer.capture.queries[q : q + 1]
                one.capture.query_positions = layer.capture.query_positions[q : q + 1]
                assert not (alone.observed_votes(one) & ~observed).any()


def test_gvote_allocations_give_adakv_the_votes_budget() -> None:
    """`allocation`: the votes size the memory (per head, layer or request), AdaKV's scores choose the entries."""
    model = tiny_model("llama3_rope")
    n = 120
    layers = []
    for index in range(2):
        layer = gvote_layer(model, index, n, seed=20 + index, query_scale=2.0)
        assert layer.capture is not None and layer.capture.queries is not None
        extra = torch.randn(39, *layer.capture.queries.shape[1:], generator=torch.Generator().manual_seed(index))
        layer.capture.queries = torch.cat([extra * 2.0, layer.capture.queries])  # 40 real queries: AdaKV's window
        layer.capture.query_positions = torch.arange(n - 40, n)
        layers.append(layer)
    votes = [algorithm1(p_nuc=0.6).on_layer_prefilled(layer, {}) for layer in layers]
    counts = torch.stack(votes).sum(dim=-1)  # [L, Hkv]
    assert (counts > 32).all() and (counts < n).all()  # room for AdaKV's window and something to drop
    assert GVotePolicy(allocation="request").capture_spec().window == 32 == AdaKVPolicy().window

    # "request": the request's total over L * Hkv heads, each layer split by AdaKV as AdaKV(tokens=...) would.
    plan, _ = run_prefill(GVotePolicy(p_nuc=0.6, allocation="request"), layers)
    per_head = round(int(counts.sum()) / counts.numel())
    adakv, _ = run_prefill(AdaKVPolicy(ratio=None, tokens=per_head), layers)
    assert kept_sets(plan) == kept_sets(adakv)
    assert int(plan.lengths.sum()) == per_head * counts.numel()

    # "layer": each layer's own mean, split by AdaKV.
    for layer, layer_counts in zip(layers, counts, strict=True):
        mine = GVotePolicy(p_nuc=0.6, allocation="layer").on_layer_prefilled(layer, {})
        theirs = AdaKVPolicy(ratio=None, tokens=round(float(layer_counts.float().mean()))).on_layer_prefilled(layer, {})
        assert torch.equal(mine, theirs)

    # "head": each KV head keeps as many entries as its votes did, the best by AdaKV's scores (window included).
    for layer, layer_counts in zip(layers, counts, strict=True):
        mine = GVotePolicy(p_nuc=0.6, allocation="head").on_layer_prefilled(layer, {})
        assert mine.sum(dim=-1).tolist() == layer_counts.tolist()
        scores = AdaKVPolicy().scores(layer)[:, :-32]  # the window is kept whatever it scores
        assert (mine[:, -32:]).all()
        for kv in range(layer.num_kv_heads):
            chosen = mine[kv, :-32]
            assert scores[kv][chosen].min() >= scores[kv][~chosen].max()


# ----------------------------------------------------------------------------- XKV: Algorithm 1


def brute_force_best(values: list[list[float]], total: int) -> float:
    """max over all allocations with sum = total of (1/L) sum_l Sum(Top-m_l) / Sum."""
    best = -1.0
    sorted_values = [sorted(v, reverse=True) for v in values]
    for alloc in itertools.product(*(range(len(v) + 1) for v in values)):
        if sum(alloc) != total:
            continue
        r = sum(sum(v[:m]) / sum(v) for v, m in zip(sorted_values, alloc, strict=True)) / len(values)
        best = max(best, r)
    return best


def random_instances() -> list[list[list[float]]]:
    g = torch.Generator().manual_seed(0)
    instances = []
    for trial in range(24):
        num_layers = 1 + trial % 3
        lengths = torch.randint(1, 5, (num_layers,), generator=g).tolist()
        if trial % 4 == 0:  # small integers: many ties within and across layers
            instances.append([torch.randint(1, 4, (n,), generator=g).double().tolist() for n in lengths])
        else:
            instances.append([(torch.rand(n, generator=g, dtype=torch.float64) + 0.01).tolist() for n in lengths])
    return instances


def test_xkv_greedy_allocation_is_the_brute_force_optimum() -> None:
    for values in random_instances():
        coverage = [torch.tensor(v, dtype=torch.float64) for v in values]
        for total in range(sum(len(v) for v in values) + 1):
            alloc = greedy_allocation(coverage, total)
            assert sum(alloc) == total and all(0 <= m <= len(v) for m, v in zip(alloc, values, strict=True))
            assert coverage_ratio(coverage, alloc) == pytest.approx(brute_force_best(values, total), abs=1e-12)


def test_xkv_target_mode_returns_the_minimal_total() -> None:
    g = torch.Generator().manual_seed(1)
    for values in random_instances():
        coverage = [torch.tensor(v, dtype=torch.float64) for v in values]
        size = sum(len(v) for v in values)
        best = [brute_force_best(values, total) for total in range(size + 1)]
        for target in [*torch.rand(6, generator=g, dtype=torch.float64).clamp(min=1e-3).tolist(), 1.0]:
            alloc = allocation_for_target(coverage, target)
            minimal = next(t for t in range(size + 1) if best[t] >= target - 1e-12)
            assert sum(alloc) == minimal, (values, target)
            assert coverage_ratio(coverage, alloc) >= target - 1e-12


# ----------------------------------------------------------------------------- XKV: plans


def xkv_layer(seed: int, n: int, layer: int, num_layers: int, window: int = 8) -> LayerPrefill:
    g = torch.Generator().manual_seed(seed)
    hkv, hq, d = 2, 4, 8
    keys = torch.randn(hkv, n, d, generator=g) * 1.5
    queries = torch.randn(window, hq, d, generator=g) * 1.5
    capture = LayerCapture(queries=queries, query_positions=torch.arange(n - window, n))
    return LayerPrefill(layer, num_layers, keys, torch.randn_like(keys), torch.arange(n), capture, None, d**-0.5)  # type: ignore[arg-type]


def xkv_reference_scores(
    layer: LayerPrefill, window: int, kernel: int, pooling: str = "avgpool", reduction: str = "mean"
) -> tuple[list[list[float]], list[float]]:
    """Per KV head pooled scores (group `reduction` of window sums) and the layer vector w_l.

    w_l pools the mean over all query heads, as the paper's equation says, whatever `reduction` is.
    """
    cap = layer.capture
    assert cap is not None and cap.queries is not None
    prefix = layer.length - window
    hq = cap.queries.shape[1]
    group = hq // layer.num_kv_heads
    per_q = []
    for h in range(hq):
        sums = [0.0] * prefix
        for i in range(cap.queries.shape[0]):
            q = cap.queries[i, h].double()
            pos = int(cap.query_positions[i])  # type: ignore[index]
            logits = [float(q @ layer.keys[h // group, j].double()) * layer.scale for j in range(pos + 1)]
            top = max(logits)
            z = sum(math.exp(x - top) for x in logits)
            for j in range(prefix):
                sums[j] += math.exp(logits[j] - top) / z / cap.queries.shape[0]
        per_q.append(sums)

    def pool(v: list[float]) -> list[float]:
        # kernel // 2 padding entries each side: zeros that count in the average (count_include_pad).
        half = kernel // 2
        spans = [v[max(0, j - half) : j + half + 1] for j in range(len(v))]
        return [max(span) if pooling == "maxpool" else sum(span) / kernel for span in spans]

    def reduce(values: list[float]) -> float:
        return max(values) if reduction == "max" else sum(values) / len(values)

    heads = [
        pool([reduce([per_q[h][j] for h in range(kv * group, (kv + 1) * group)]) for j in range(prefix)])
        for kv in range(layer.num_kv_heads)
    ]
    layer_vector = pool([sum(per_q[h][j] for h in range(hq)) / hq for j in range(prefix)])
    return heads, layer_vector


def brute_force_allocation(vectors: list[list[float]], total: int) -> list[int]:
    """The optimal allocation over 3 layers (unique for random scores), by enumeration with prefix sums."""
    prefix = [[0.0, *itertools.accumulate(sorted(v, reverse=True))] for v in vectors]
    share = [[s / p[-1] for s in p] for p in prefix]
    cap = len(vectors[0])
    best, arg = -1.0, [0, 0, 0]
    for a in range(cap + 1):
        for b in range(cap + 1):
            c = total - a - b
            if 0 <= c <= cap and share[0][a] + share[1][b] + share[2][c] > best:
                best, arg = share[0][a] + share[1][b] + share[2][c], [a, b, c]
    return arg


@pytest.mark.parametrize(
    "budget, pooling, reduction",
    [
        ({"tokens": 20}, "avgpool", "mean"),
        ({"ratio": 0.3}, "avgpool", "mean"),
        ({"target_ratio": 0.6}, "avgpool", "mean"),
        ({"target_ratio": 0.93}, "avgpool", "mean"),
        # Where the mean of the heads' selection scores is not the pooled head mean.
        ({"tokens": 20}, "maxpool", "mean"),
        ({"target_ratio": 0.6}, "avgpool", "max"),
        ({"tokens": 20}, "maxpool", "max"),
    ],
)
def test_xkv_plan_matches_reference(budget: dict[str, Any], pooling: str, reduction: str) -> None:
    n, window, kernel = 40, 8, 7
    policy = XKVPolicy(**budget, pooling=pooling, gqa_reduction=reduction)
    policy.validate()
    assert policy.capture_spec().window == window
    layers = [xkv_layer(20 + i, n, i, 3) for i in range(3)]
    plan, state = run_prefill(policy, layers)
    refs = [xkv_reference_scores(layer, window, kernel, pooling, reduction) for layer in layers]
    vectors = [r[1] for r in refs]
    if "target_ratio" in budget:
        optimum = []
        for total in range(3 * (n - window) + 1):
            alloc = brute_force_allocation(vectors, total)
            value = sum(sum(sorted(v, reverse=True)[:m]) / sum(v) for v, m in zip(vectors, alloc, strict=True)) / 3
            optimum.append((value, alloc))
        sizes = next(alloc for value, alloc in optimum if value >= budget["target_ratio"])
        assert state["r_avg"] >= budget["target_ratio"]
    else:
        per_head = budget.get("tokens") or round(budget["ratio"] * n)
        sizes = brute_force_allocation(vectors, 3 * (per_head - window))
        assert int(plan.lengths.sum()) == 3 * 2 * per_head  # the mean over layers and heads is B exactly
    assert state["allocation"] == sizes
    expected = []
    for (heads, _), size in zip(refs, sizes, strict=True):
        recent = set(range(n - window, n))
        expected.append([set(sorted(range(n - window), key=lambda j, s=s: (-s[j], j))[:size]) | recent for s in heads])
    assert kept_sets(plan) == expected
    assert len(set(sizes)) > 1  # layers get different sizes


def test_xkv_short_prompts_and_small_ratio_budgets() -> None:
    # A prompt within the window: nothing to rank, everything kept.
    plan, _ = run_prefill(XKVPolicy(target_ratio=0.5), [xkv_layer(1, 6, 0, 1, window=6)])
    assert plan.lengths.tolist() == [[6, 6]]
    # ... unless a ratio budget asks for less: it is honoured on a short prompt too (the last B entries).
    plan, _ = run_prefill(XKVPolicy(ratio=0.5), [xkv_layer(1, 6, 0, 1, window=6)])
    assert kept_sets(plan) == [[{3, 4, 5}] * 2]
    plan, _ = run_prefill(XKVPolicy(tokens=8), [xkv_layer(1, 6, 0, 1, window=6)])
    assert plan.lengths.tolist() == [[6, 6]]
    # A ratio budget below the window keeps the last B entries, as the SnapKV family does.
    plan, _ = run_prefill(XKVPolicy(ratio=0.1), [xkv_layer(2, 40, i, 2) for i in range(2)])
    assert kept_sets(plan) == [[set(range(36, 40))] * 2] * 2


# ----------------------------------------------------------------------------- XKV: profiles


def test_xkv_profile_round_trip_and_allocation(tmp_path: Path) -> None:
    profile = XKVProfile(fractions=[0.5, 1e-05, 1 / 3, 1.0], metadata={"target_ratio": 0.9, "requests": 3})
    path = profile.save(tmp_path / "sub" / "xkv_profile.yaml")
    assert XKVProfile.load(path) == profile
    assert XKVProfile.from_allocations([[2, 0], [4, 2]], [4, 8], metadata={"x": 1}).fractions == [0.5, 0.125]
    # Without a budget each layer keeps round(f_l * P); with one, exactly the total, proportional and capped.
    assert allocation_from_fractions([0.5, 1e-05, 1 / 3, 1.0], 30) == [15, 0, 10, 30]
    assert allocation_from_fractions([0.2, 0.4, 0.0], 10, 9) == [3, 6, 0]
    assert allocation_from_fractions([0.2, 0.9, 0.0], 10, 16) == [6, 10, 0]
    assert allocation_from_fractions([0.2, 0.9, 0.0], 10, 25) == [10, 10, 5]
    for total in range(0, 31):
        sizes = allocation_from_fractions([0.3, 0.05, 0.6], 10, total)
        assert sum(sizes) == total and max(sizes) <= 10
    # The policy applies it.
    policy = XKVPolicy(profile=str(path))
    policy.validate()
    layers = [xkv_layer(30 + i, 40, i, 4) for i in range(4)]
    plan, state = run_prefill(policy, layers)
    assert state["allocation"] == [16, 0, 11, 32]
    assert plan.lengths[:, 0].tolist() == [24, 8, 19, 40]
    _, state = run_prefill(XKVPolicy(profile=str(path), tokens=16), layers)
    assert sum(state["allocation"]) == 4 * 8
    with pytest.raises(ValueError, match="has 4 layers"):
        run_prefill(policy, layers[:2])
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: xkv\nfractions: [0.5, 2.0]\n")
    with pytest.raises(PolicyConfigError, match="fractions"):
        load_policy({"name": "xkv", "profile": str(bad)})


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "gvote", "p_nuc": 0.0}, "p_nuc"),
        ({"name": "gvote", "p_nuc": 1.5}, "p_nuc"),
        ({"name": "gvote", "num_samples": 0}, "num_samples"),
        ({"name": "gvote", "future_positions": 0}, "future_positions"),
        ({"name": "gvote", "window": -1}, "window"),
        ({"name": "gvote", "observation_window": -1}, "observation_window"),
        ({"name": "gvote", "observation_window": 257}, "observation_window"),
        ({"name": "gvote", "ratio": 0.5}, "unknown parameter"),
        ({"name": "gvote", "allocation": "layers"}, "allocation"),
        ({"name": "xkv", "ratio": 0.5, "target_ratio": 0.9}, "at most one budget"),
        ({"name": "xkv", "tokens": 32, "target_ratio": 0.9}, "at most one budget"),
        ({"name": "xkv", "target_ratio": 0.0}, "target_ratio"),
        ({"name": "xkv", "target_ratio": 1.5}, "target_ratio"),
        ({"name": "xkv", "tokens": 4}, "smaller than the protected window 8"),
        ({"name": "xkv", "profile": "/nonexistent/profile.yaml"}, "does not exist"),
    ],
)
def test_invalid_parameters_are_rejected(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy(spec)


def test_presets_hold_the_documented_defaults(tmp_path: Path) -> None:
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert load_policy("gvote") == load_policy(str(configs / "gvote.yaml")) == GVotePolicy()
    assert load_policy("xkv") == load_policy(str(configs / "xkv.yaml")) == XKVPolicy()
    g = GVotePolicy()
    assert (g.p_nuc, g.num_samples, g.future_positions, g.window, g.sink_tokens) == (0.95, 8, 32, 0, 0)
    x = XKVPolicy()
    assert (x.window, x.kernel_size, x.pooling, x.budget.ratio) == (8, 7, "avgpool", 0.25)
    assert load_policy({"name": "xkv", "target_ratio": 0.9}).target_ratio == 0.9  # type: ignore[union-attr]
    with pytest.raises(PolicyConfigError, match="profile"):
        XKVPolicy(target_ratio=0.9, profile=str(XKVProfile([0.5]).save(tmp_path / "p.yaml"))).validate()


# ----------------------------------------------------------------------------- engine runs

PAGE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 512, "tie_word_embeddings": False})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny_llama_gx")
    model.save_pretrained(path)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "spec",
    [
        "gvote",
        "xkv",
        {"name": "xkv", "target_ratio": 0.8},
        {"name": "gvote", "p_nuc": 0.2, "num_samples": 2, "window": 4},
        {"name": "gvote", "p_nuc": 0.5, "num_samples": 2, "observation_window": 8},
        {"name": "gvote", "p_nuc": 0.5, "num_samples": 2, "allocation": "request"},
    ],
    ids=str,
)
def test_generate_end_to_end(model_dir: Path, spec: Any) -> None:
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=64)
    prompts = [prompt_ids(n, 10 + n) for n in (5, 90)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    decoded = 5  # the 6th token is sampled, never fed back
    policy = load_policy(spec)
    finished = run_recording(engine, prompts, params, policy=spec)
    # The strict protocol: the last 10 prompt tokens run through decode steps from the compressed cache.
    (strict,) = run_recording(engine, prompts[1:], params, policy=spec, compress_after=80)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # XKV with a ratio budget keeps round(0.25 n) per head on average; GVote and XKV's R_avg target are budget-free.
    fixed = isinstance(policy, XKVPolicy) and policy.target_ratio is None
    budget = SimpleNamespace(ratio=0.25, tokens=None)  # XKV's default: the SnapKV family's ratio
    for request, prompt in zip(finished, prompts, strict=True):
        n = len(prompt)
        assert len(request.output.output_token_ids) == 6
        check_kept(request, n, decoded, budget_per_head(budget, n) if fixed else None)
        if request.output.kv.tokens_kept == request.output.kv.tokens_full:  # nothing dropped
            assert request.output.output_token_ids == hf_greedy(hf, prompt, 6)
    # The strict request compressed 80 entries; the last 10 prompt tokens entered every head afterwards.
    check_kept(strict, 80, 10 + decoded, budget_per_head(budget, 80) if fixed else None)
    assert len(strict.output.output_token_ids) == 6
    assert engine.cache.pool.num_used == 0
    long = finished[1].output.kv
    if spec == "gvote":
        # This random model's attention is diffuse: at p_nuc 0.95 GVote keeps every entry, so the tokens are
        # transformers' (checked above). `test_gvote_memory_differs_across_suite_requests` shows it compress.
        assert long.tokens_kept == long.tokens_full
    else:
        assert long.retention < 1.0
    # Same greedy tokens with the policy as the engine default (plans are deterministic).
    again = LLM(
        model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=64, kv_policy=spec
    ).generate(prompts, params)
    assert [o.output_token_ids for o in again] == [r.output.output_token_ids for r in finished]


def test_gvote_memory_differs_across_suite_requests(tmp_path: Path) -> None:
    path = write_suite_model(tmp_path / "suite", hidden=32, seed=1, std=0.3, max_positions=512)
    engine = LLMEngine(path, dtype=torch.float32, num_pages=2048, page_size=PAGE)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = []
    for i, task in enumerate(sorted(TASKS)):
        spec = build_prompt(generate(task, i, context_length=120), engine.tokenizer, "served")
        ids.append(engine.add_request(spec.token_ids, params, policy="gvote"))
    kept: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                kept[out.request_id] = out.kv
    per_request = [kept[rid].kv_bytes for rid in ids]
    assert len(set(per_request)) > 1, per_request
    assert all(kept[rid].retention < 1.0 for rid in ids)
    heads = {tuple(map(tuple, kept[rid].kept_per_head)) for rid in ids}
    assert len(heads) == len(ids)  # every request has its own per-(layer, head) sizes


def test_xkv_profile_from_engine_runs(model_dir: Path, tmp_path: Path) -> None:
    prompts = [prompt_ids(n, n) for n in (40, 70)]
    settings = {"target_ratio": 0.8, "window": 6, "kernel_size": 5, "pooling": "maxpool"}
    profile = profile_xkv(model_dir, prompts, **settings, dtype=torch.float32, num_pages=512, page_size=PAGE)  # type: ignore[arg-type]
    # The same prompts through XKV's R_avg mode with the same settings, one at a time: f_l = mean of m_l / P.
    seen: list[tuple[list[int], int]] = []
    policy = XKVPolicy(**settings)  # type: ignore[arg-type]
    original = policy.plan

    def recording_plan(request: Any, results: list[Any], state: dict[str, Any]) -> Any:
        plan = original(request, results, state)
        seen.append((list(state["allocation"]), state["capacity"]))
        return plan

    policy.plan = recording_plan  # type: ignore[method-assign]
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=512, page_size=PAGE)
    for prompt in prompts:
        run_recording(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0), policy=policy)
    assert [capacity for _, capacity in seen] == [40 - 6, 70 - 6]
    expected = [
        sum(alloc[layer] / capacity for alloc, capacity in seen) / 2 for layer in range(TINY["num_hidden_layers"])
    ]
    assert profile.fractions == pytest.approx(expected, abs=1e-12)
    assert len(set(profile.fractions)) > 1
    assert (profile.window, profile.kernel_size, profile.pooling) == (6, 5, "maxpool")
    assert profile.metadata == {"target_ratio": 0.8, "model": str(model_dir), "requests": 2}
    path = profile.save(tmp_path / "xkv.yaml")
    assert XKVProfile.load(path) == profile
    llm = LLM(
        model_dir, dtype=torch.float32, num_pages=512, page_size=PAGE, kv_policy={"name": "xkv", "profile": str(path)}
    )
    (out,) = llm.generate([prompt_ids(60, 3)], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.output_token_ids) == 3 and out.kv.retention < 1.0


def test_xkv_profile_file_format_and_validation(tmp_path: Path) -> None:
    profile = XKVProfile(fractions=[0.0, 0.5], window=4, kernel_size=3, pooling="maxpool", metadata={"requests": 1})
    path = profile.save(tmp_path / "p.yaml")
    assert yaml.safe_load(path.read_text()) == {
        "policy": "xkv",
        "num_layers": 2,
        "fractions": [0.0, 0.5],
        "window": 4,
        "kernel_size": 3,
        "pooling": "maxpool",
        "metadata": {"requests": 1},
    }
    assert XKVProfile.load(path) == profile  # a zero fraction is a valid layer size
    # Only `policy` and `fractions` are required; the rest take XKV's defaults.
    assert XKVProfile.from_dict({"policy": "xkv", "fractions": [1, 0.25]}) == XKVProfile(fractions=[1.0, 0.25])
    bad: list[tuple[Any, str]] = [
        ([0.5], "source.yaml is not an XKV profile"),
        ({"policy": "snapkv", "fractions": [0.5]}, "source.yaml is not an XKV profile"),
        ({"policy": "xkv", "fractions": []}, "`fractions` must be a non-empty list"),
        ({"policy": "xkv", "fractions": "0.5"}, "`fractions` must be a non-empty list"),
        ({"policy": "xkv", "fractions": [True]}, "`fractions` must be a non-empty list"),
        ({"policy": "xkv", "fractions": [-0.1]}, "`fractions` must be a non-empty list"),
        ({"policy": "xkv", "fractions": [0.5], "num_layers": 2}, "num_layers does not match its 1 fractions"),
        ({"policy": "xkv", "fractions": [0.5], "metadata": [1]}, "`metadata` must be a mapping"),
    ]
    for data, message in bad:
        with pytest.raises(PolicyConfigError, match=re.escape(message)):
            XKVProfile.from_dict(data, source="source.yaml")
    with pytest.raises(ValueError, match="no profiled request had entries to score"):
        XKVProfile.from_allocations([[0, 0]], [0])


def test_gvote_nucleus_size_at_exact_mass_and_parameter_boundaries() -> None:
    # Masses 0.5, 0.75, 1.0 (exact in binary): the smallest set reaching 0.75 has two entries.
    probs = torch.tensor([[0.25, 0.5, 0.25], [1.0, 0.0, 0.0]])
    assert nucleus_size(probs, 0.75).tolist() == [2, 1]
    assert nucleus_size(probs, 0.5).tolist() == [1, 1]
    assert nucleus_size(probs, 1.0).tolist() == [3, 1]
    # The smallest legal values are accepted.
    GVotePolicy(num_samples=1, future_positions=1, window=0, sink_tokens=0, seed=0).validate()
    for field in ("num_samples", "future_positions"):
        with pytest.raises(PolicyConfigError, match=f"^{field} must be >= 1, got 0$"):
            GVotePolicy(**{field: 0}).validate()
    for field in ("window", "sink_tokens", "seed"):
        with pytest.raises(PolicyConfigError, match=f"^{field} must be >= 0, got -1$"):
            GVotePolicy(**{field: -1}).validate()


def test_xkv_allocation_with_a_layer_without_mass() -> None:
    """A layer whose window gave its prefix no attention counts as uniform: each entry is worth 1 / P of it."""
    coverage = [torch.zeros(4, dtype=torch.float64), torch.tensor([3.0, 1.0], dtype=torch.float64)]
    assert greedy_allocation(coverage, 1) == [0, 1]
    assert greedy_allocation(coverage, 2) == [1, 1]  # 0.25 in both layers: the tie goes to the lower layer
    assert coverage_ratio(coverage, [1, 0]) == 0.125
    assert coverage_ratio(coverage, [4, 2]) == 1.0
    assert allocation_for_target(coverage, 0.5) == [1, 1]


def test_gvote_top_selection_equals_the_stable_sort() -> None:
    """`top_with_low_ties` keeps what a stable descending arg-sort keeps, ties included (both selection paths)."""
    from vllm_kvpress_ext.policies.gvote import top_with_low_ties

    g = torch.Generator().manual_seed(3)
    for n, top in ((50, 50), (400, 30)):  # sort path (large counts), topk path (counts <= n / 8)
        scores = torch.randint(0, 6, (12, n), generator=g).float()  # many ties
        counts = torch.randint(1, top + 1, (12,), generator=g)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        expected = torch.zeros_like(scores, dtype=torch.bool)
        expected.scatter_(-1, order, torch.arange(n).expand(12, n) < counts.view(-1, 1))
        assert torch.equal(top_with_low_ties(scores, counts), expected)
