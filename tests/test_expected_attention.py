"""Expected Attention: the equations by hand, the captured query moments, and engine runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import TINY, budget_per_head, check_kept, run_recording
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvpress_ext.bench.attention_recall import RecordingContext
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.prefix import capture_prefix
from vllm_kvpress_ext.models.config import ModelConfig
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.policies import ExpectedAttentionPolicy, PolicyConfigError, load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill
from vllm_kvpress_ext.policies.capture import CaptureSpec, LayerCapture
from vllm_kvpress_ext.policies.expected_attention import mean_rotation


def tiny_model(seed: int = 0) -> LlamaFamilyForCausalLM:
    config = ModelConfig.from_dict({**TINY, "rope_theta": 10000.0, "architectures": ["LlamaForCausalLM"]})
    torch.manual_seed(seed)
    return LlamaFamilyForCausalLM(config).eval()


def synthetic_layer(model: LlamaFamilyForCausalLM, n: int, seed: int) -> tuple[LayerPrefill, torch.Tensor]:
    """Random keys/values and n random pre-RoPE queries, captured as moments plus the first 4 queries."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    queries = (
        torch.randn(n, hq, d, generator=g, dtype=torch.float64) + torch.randn(hq, d, generator=g, dtype=torch.float64)
    ) * 1.5
    capture = LayerCapture(
        query_sum=queries.sum(0),
        query_outer_sum=torch.einsum("thi,thj->hij", queries, queries),
        query_count=n,
        leading_queries=queries[:4].float(),
    )
    keys = torch.randn(hkv, n, d, generator=g)
    values = torch.randn(hkv, n, d, generator=g) * torch.rand(hkv, n, 1, generator=g)
    layer = LayerPrefill(0, 1, keys, values, torch.arange(n), capture, model, d**-0.5)
    return layer, queries


def by_hand(layer: LayerPrefill, queries: torch.Tensor, policy: ExpectedAttentionPolicy) -> list[set[int]]:
    """The module docstring's equations with explicit matrices and loops, in float64."""
    model, n, s = layer.model, layer.length, policy.sink_tokens
    hq, d = queries.shape[1], queries.shape[2]
    hkv = layer.num_kv_heads
    group = hq // hkv
    rest = queries[s:]
    mean = rest.mean(0)
    cov = torch.stack([(rest[:, h] - mean[h]).T @ (rest[:, h] - mean[h]) / rest.shape[0] for h in range(hq)])
    # R(x) as a matrix: RoPE applied to each basis vector at position x; R̄ the mean over x = n .. n + F - 1.
    rotations = []
    for x in range(n, n + policy.future_positions):
        cos, sin = model.rotary.cos_sin(torch.tensor([x]))
        basis = torch.eye(d, dtype=torch.float64)
        half = d // 2
        rotated = basis * cos.double() + torch.cat([-basis[:, half:], basis[:, :half]], dim=1) * sin.double()
        rotations.append(rotated.T)  # column i = R(x) e_i
    r_bar = torch.stack(rotations).mean(0)
    keep: list[set[int]] = []
    budget = policy.budget.per_head(n)
    for kv in range(hkv):
        probs = torch.zeros(n - s, dtype=torch.float64)
        for h in range(kv * group, (kv + 1) * group):
            m, c = r_bar @ mean[h], r_bar @ cov[h] @ r_bar.T
            z = []
            for j in range(s, n):
                k = layer.keys[kv, j].double()
                z.append(float(m @ k) / math.sqrt(d) + float(k @ c @ k) / (2 * d))
            probs += torch.softmax(torch.tensor(z, dtype=torch.float64), 0) / group
        scores = [float(probs[j - s]) * float(layer.values[kv, j].double().norm()) for j in range(s, n)]
        ranked = sorted(range(s, n), key=lambda j: (-scores[j - s], j))
        keep.append(set(range(s)) | set(ranked[: budget - s]))
    return keep


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_expected_attention_matches_the_equations(ratio: float) -> None:
    model = tiny_model()
    policy = ExpectedAttentionPolicy(ratio=ratio, future_positions=16)
    policy.validate()
    for seed in range(3):
        layer, queries = synthetic_layer(model, 40, seed)
        mask = policy.on_layer_prefilled(layer, {})
        assert [set(torch.nonzero(row).flatten().tolist()) for row in mask] == by_hand(layer, queries, policy)
        assert (mask.sum(-1) == budget_per_head(policy, 40)).all()


def test_mean_rotation_is_the_mean_of_the_rope_rotations() -> None:
    model = tiny_model()
    x = torch.randn(3, 2, model.config.head_dim, dtype=torch.float64)
    positions = torch.arange(100, 108)
    cos, sin = model.rotary.cos_sin(positions)
    from vllm_kvpress_ext.models.rope import apply_rope

    each = torch.stack(
        [apply_rope(x.float(), c.expand(3, -1), s.expand(3, -1)).double() for c, s in zip(cos, sin, strict=True)]
    )
    assert torch.allclose(x @ mean_rotation(cos.double(), sin.double()).T, each.mean(0), atol=1e-6)


def test_no_covariance_no_value_norm_and_short_prompts() -> None:
    model = tiny_model()
    layer, _ = synthetic_layer(model, 30, 5)
    plain = ExpectedAttentionPolicy(ratio=0.3, use_covariance=False, use_vnorm=False)
    scores = plain.scores(layer)
    assert scores.shape == (2, 26)
    assert torch.allclose(scores.sum(-1), torch.ones(2))  # group means of softmaxes: distributions
    assert not torch.equal(
        plain.on_layer_prefilled(layer, {}), ExpectedAttentionPolicy(ratio=0.3).on_layer_prefilled(layer, {})
    )
    short, _ = synthetic_layer(model, 4, 6)  # no more entries than sinks: kept whole
    assert ExpectedAttentionPolicy().on_layer_prefilled(short, {}).all()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "expected_attention", "future_positions": 0}, "future_positions"),
        ({"name": "expected_attention", "future_positions": 5000}, "future_positions"),
        ({"name": "expected_attention", "sink_tokens": -1}, "sink_tokens"),
        ({"name": "expected_attention", "epsilon": -0.5}, "epsilon"),
        ({"name": "expected_attention", "use_covariance": "yes"}, "use_covariance"),
        ({"name": "expected_attention", "ratio": 0.0}, "ratio"),
        ({"name": "expected_attention", "ratio": 0.5, "tokens": 8}, "exactly one"),
    ],
)
def test_bad_parameters_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy(spec)


PAGE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 512, "tie_word_embeddings": False})
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny_llama_ea")
    model.save_pretrained(path)
    return path


def test_captured_query_moments_are_the_models_queries_in_any_chunking(model_dir: Path) -> None:
    """The moments the prefill captures (after un-rotating its queries) equal those of the layer's own q path."""
    prompt = torch.randint(0, TINY["vocab_size"], (70,), generator=torch.Generator().manual_seed(1)).tolist()
    spec = CaptureSpec(query_moments=True, leading_queries=4)
    captured = []
    for chunk in (70, 16):
        engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=512, page_size=PAGE, max_num_batched_tokens=chunk)
        captured.append(capture_prefix(engine, prompt, spec, f"p{chunk}").layers)
    engine_model = engine.model
    recorder = RecordingContext()

    with torch.no_grad():
        engine_model(torch.tensor(prompt), torch.arange(70), recorder)
        for layer, (whole, chunked) in enumerate(zip(*captured, strict=True)):
            attn = engine_model.layers[layer].self_attn
            q = attn.project_queries(recorder.hidden[layer], torch.zeros(70, dtype=torch.long)).double()  # before RoPE
            for skip in (0, 4):
                mean, cov = whole.query_mean_cov(skip)
                rest = q[skip:]
                expected_mean = rest.mean(0)
                centred = rest - expected_mean
                expected_cov = torch.einsum("thi,thj->hij", centred, centred) / rest.shape[0]
                assert torch.allclose(mean, expected_mean, atol=1e-4)
                assert torch.allclose(cov, expected_cov, atol=1e-4)
                other_mean, other_cov = chunked.query_mean_cov(skip)
                # Chunked attention rounds differently in float32; the moments agree to that rounding.
                assert torch.allclose(mean, other_mean, atol=1e-5) and torch.allclose(cov, other_cov, atol=1e-5)
    with pytest.raises(ValueError, match="first 5 queries"):
        captured[0][0].query_mean_cov(5)


def test_engine_runs_meet_the_budget_whole_and_forked(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=32)
    prompts = [
        torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 90)
    ]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    policy = ExpectedAttentionPolicy(ratio=0.25)
    finished = run_recording(engine, prompts, params, policy=policy)
    check_kept(finished[0], 3, 4, 3)  # shorter than the sinks: kept whole
    check_kept(finished[1], 90, 4, budget_per_head(policy, 90))
    assert engine.cache.pool.num_used == 0
