"""The policy framework: registry and presets, validation, SnapKV's equations, and the engine hooks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from model_utils import tiny_hf_model
from transformers import PreTrainedModel

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies import PolicyConfigError, SnapKVPolicy, create_policy, load_policy, policy_names
from vllm_kvpress_ext.policies.base import Budget, KVPolicy, LayerPrefill
from vllm_kvpress_ext.policies.capture import LayerCapture

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def snapkv_by_hand(queries, qpos, keys, scale, budget, window, kernel, gqa, count_include_pad=True):  # type: ignore[no-untyped-def]
    """SnapKV written from the paper's equations with loops: the test oracle.

    Pooling pads the prefix with kernel // 2 zeros on each side; with `count_include_pad` the padding
    counts in the average (divide by the kernel), without it only the real neighbours do.
    """
    num_q, num_kv, n = queries.shape[1], keys.shape[0], keys.shape[1]
    group = num_q // num_kv
    w = min(window, n, budget)
    prefix = n - min(window, n)
    keep = torch.zeros(num_kv, n, dtype=torch.bool)
    for h in range(num_kv):
        votes_per_q = []
        for g in range(group):
            qh = h * group + g
            v = torch.zeros(n, dtype=torch.float64)
            for i in range(queries.shape[0]):
                logits = [float(queries[i, qh].double() @ keys[h, j].double()) * scale for j in range(int(qpos[i]) + 1)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                for j, x in enumerate(logits):
                    v[j] += math.exp(x - m) / z
            votes_per_q.append(v)
        stacked = torch.stack(votes_per_q)
        votes = stacked.mean(0) if gqa == "mean" else stacked.max(0).values
        pooled = votes.clone()
        half = kernel // 2
        padded = [0.0] * half + [float(x) for x in votes[:prefix]] + [0.0] * half
        for j in range(prefix):
            around = padded[j : j + kernel]  # entry j sits at padded[j + half]
            real = sum(1 for i in range(j - half, j + half + 1) if 0 <= i < prefix)
            pooled[j] = sum(around) / (kernel if count_include_pad else real)
        window_idx = list(range(n - w, n))
        candidates = sorted(range(n - w), key=lambda j: (-float(pooled[j]), j))
        for j in window_idx + candidates[: max(0, budget - w)]:
            keep[h, j] = True
    return keep


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("n, budget", [(50, 20), (12, 20), (40, 5)])
def test_snapkv_matches_the_paper_equations(gqa: str, n: int, budget: int, count_include_pad: bool) -> None:
    torch.manual_seed(n + budget)
    num_q, num_kv, d, window = 4, 2, 8, 8
    keys = torch.randn(num_kv, n, d)
    w = min(window, n)
    queries = torch.randn(w, num_q, d)
    qpos = torch.arange(n - w, n)
    layer = LayerPrefill(
        0,
        1,
        keys,
        torch.randn_like(keys),
        torch.arange(n),
        LayerCapture(queries=queries, query_positions=qpos),
        None,
        d**-0.5,
    )  # type: ignore[arg-type]
    policy = SnapKVPolicy(
        ratio=None,
        tokens=max(budget, window) if budget >= window else None,
        window=window,
        gqa_reduction=gqa,
        count_include_pad=count_include_pad,
    )
    if budget < window:
        policy = SnapKVPolicy(ratio=budget / n, window=window, gqa_reduction=gqa, count_include_pad=count_include_pad)
    effective = Budget(ratio=policy.ratio, tokens=policy.tokens).per_head(n)
    mask = policy.on_layer_prefilled(layer, {})
    expected = snapkv_by_hand(queries, qpos, keys, d**-0.5, effective, window, 5, gqa, count_include_pad)
    assert torch.equal(mask, expected)
    assert (mask.sum(-1) == min(n, effective)).all()


def test_registry_and_validation() -> None:
    assert {"full", "snapkv"} <= set(policy_names())
    with pytest.raises(PolicyConfigError, match=r"known policies: .*snapkv"):
        load_policy("not-a-policy")
    for bad, message in [
        ({"name": "snapkv", "ratio": 0.0}, r"ratio must lie in \(0, 1\]"),
        ({"name": "snapkv", "ratio": 1.5}, r"ratio must lie in \(0, 1\]"),
        ({"name": "snapkv", "tokens": 16, "window": 32}, "smaller than the protected window"),
        ({"name": "snapkv", "bogus": 1}, "valid: count_include_pad, gqa_reduction"),
        ({"name": "snapkv", "gqa_reduction": "median"}, "gqa_reduction must be one of"),
        ({"name": "snapkv", "window": "wide"}, "window must be int"),
        ({"name": "snapkv", "count_include_pad": 1}, "count_include_pad must be bool"),
        ({"name": "snapkv", "count_include_pad": "yes"}, "count_include_pad must be bool"),
        ({"name": "snapkv", "count_include_pad": None}, "count_include_pad cannot be null"),
        ({"ratio": 0.5}, "needs a string `name`"),
    ]:
        with pytest.raises(PolicyConfigError, match=message):
            load_policy(bad)
    # Built directly (not through the registry), a non-bool flag is caught by `validate`.
    for policy in (SnapKVPolicy(count_include_pad=1), create_policy("wgkv")):  # type: ignore[arg-type]
        policy.count_include_pad = "no"  # type: ignore[attr-defined]
        with pytest.raises(PolicyConfigError, match="count_include_pad must be true or false"):
            policy.validate()
    assert load_policy({"name": "snapkv", "tokens": 64}).tokens == 64  # type: ignore[union-attr]
    assert load_policy({"name": "snapkv", "tokens": 64}).ratio is None  # type: ignore[union-attr]


def test_presets_load_by_name_and_path_and_match_defaults() -> None:
    """The repository's presets spell out each policy's defaults, which is what its name loads."""
    presets = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {p.stem for p in presets} == set(policy_names()), "one preset per registered policy"
    for preset in presets:
        by_path = load_policy(str(preset))
        by_name = load_policy(preset.stem)
        assert by_path == by_name == create_policy(preset.stem)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    model = tiny_hf_model("llama3", seed=11)
    path = tmp_path_factory.mktemp("policy-engine")
    model.save_pretrained(path)
    return model, path


def _run(engine: LLMEngine, prompt: list[int], **kwargs: object):  # type: ignore[no-untyped-def]
    rid = engine.add_request(prompt, GREEDY, **kwargs)  # type: ignore[arg-type]
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                result = out
    return result


def test_full_policy_equals_no_policy(tiny_model: tuple[PreTrainedModel, Path]) -> None:
    _, path = tiny_model
    prompt = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=4)
    with_full = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=4, kv_policy="full")
    a, b = _run(plain, prompt), _run(with_full, prompt)
    assert a.output_token_ids == b.output_token_ids
    assert a.kv.kv_bytes == b.kv.kv_bytes and b.kv.retention == 1.0


def test_snapkv_frees_what_its_plan_drops(tiny_model: tuple[PreTrainedModel, Path]) -> None:
    _, path = tiny_model
    prompt = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=4, max_num_batched_tokens=50)
    engine.add_request(
        prompt,
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        request_id="r",
        policy={"name": "snapkv", "tokens": 40, "window": 8},
    )
    used_before = None
    while engine.has_unfinished_requests():
        request = engine.requests.get("r")
        prefilling = request is not None and request.status.value == "prefilling"
        if prefilling and request.seat.num_processed + 50 >= 120:  # the step that completes prefill
            used_before = (
                engine.cache.pool.num_used
                + engine.cache.pages_for_prompt(120)
                - engine.cache.pages_for_prompt(request.seat.num_processed)
            )
        outs = engine.step()
        if used_before is not None and request is not None and request.status.value == "running":
            layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
            assert used_before == layers * heads * 30  # 120 tokens / 4 per page
            # 40 tokens kept per head -> 10 pages (the sampled token's K/V enters at the next step).
            kept_pages = int(engine.cache.pages_per_head("r").sum())
            assert engine.cache.pool.num_used == kept_pages == layers * heads * math.ceil(40 / 4)
            used_before = None
        for out in outs:
            if out.finished:
                assert out.kv.kv_bytes_peak >= out.kv.kv_bytes
                assert out.kv.retention < 0.5
    assert engine.cache.pool.num_used == 0


def test_per_request_policy_override_and_protocols(tiny_model: tuple[PreTrainedModel, Path]) -> None:
    _, path = tiny_model
    prompt = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = LLMEngine(
        path, dtype=torch.float32, num_pages=512, page_size=4, kv_policy={"name": "snapkv", "tokens": 16, "window": 4}
    )
    compressed = _run(engine, prompt)
    full = _run(engine, prompt, policy="full")
    assert compressed.kv.kv_bytes < full.kv.kv_bytes
    # Strict protocol: compress before the last 5 prompt tokens, which then run from the compressed cache.
    strict = _run(engine, prompt, compress_after=75)
    assert len(strict.output_token_ids) == GREEDY.max_tokens
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    decoded = GREEDY.max_tokens - 1  # the last sampled token is never fed back
    # Whole-prompt compression keeps 16 per head, then every decoded token; the strict protocol keeps
    # 16 of the first 75, then the 5 held-back prompt tokens and the decoded ones.
    assert compressed.kv.kept_per_head == [[16 + decoded] * heads] * layers
    assert strict.kv.kept_per_head == [[16 + 5 + decoded] * heads] * layers
    assert strict.kv.tokens_kept == layers * heads * (16 + 5 + decoded)
    assert strict.kv.tokens_full == full.kv.tokens_kept == layers * heads * (80 + decoded)


def test_prompts_shorter_than_the_window(tiny_model: tuple[PreTrainedModel, Path]) -> None:
    _, path = tiny_model
    engine = LLMEngine(path, dtype=torch.float32, num_pages=128, page_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    # A tokens budget is never below the window, so a shorter prompt is kept whole.
    whole = _run(engine, prompt, policy={"name": "snapkv", "tokens": 32})
    assert whole.kv.retention == 1.0 and len(whole.output_token_ids) == GREEDY.max_tokens
    # A ratio budget is honoured even then: round(0.25 * 8) = 2 prompt entries per head, plus the decoded tokens.
    ratio = _run(engine, prompt, policy={"name": "snapkv", "ratio": 0.25})
    decoded = GREEDY.max_tokens - 1
    assert ratio.kv.kept_per_layer == [2 + decoded] * 2


def test_params_lists_the_hyperparameters() -> None:
    assert SnapKVPolicy(tokens=16, ratio=None, window=4).params() == {
        "ratio": None,
        "tokens": 16,
        "window": 4,
        "kernel_size": 5,
        "pooling": "avgpool",
        "gqa_reduction": "mean",
        "count_include_pad": True,
    }
    assert KVPolicy().params() == {}  # the base class has no fields


def _keep_top_by_definition(scores: list[float], budget: int, protected: list[bool]) -> list[bool]:
    """The protected entries, then the best others by score, ties to the lower index, a NaN last."""
    take = max(budget, sum(protected))
    key = [
        (0, 0.0, i) if p else (1, math.inf if math.isnan(s) else -s, i)
        for i, (s, p) in enumerate(zip(scores, protected, strict=True))
    ]
    kept = {i for *_, i in sorted(key)[:take]}
    return [i in kept for i in range(len(scores))]


@pytest.mark.parametrize("seed", range(12))
def test_keep_top_keeps_the_protected_then_the_best_with_ties_to_the_lower_index(seed: int) -> None:
    from vllm_kvpress_ext.policies.base import keep_top

    gen = torch.Generator().manual_seed(seed)
    rows, n = 1 + seed % 4, [1, 7, 64, 301][seed % 4]
    # Few distinct values (many ties), a NaN and infinities now and then; budgets from 0 to beyond the row.
    scores = torch.randint(0, 4, (rows, n), generator=gen).float()
    if seed % 3 == 0:
        scores[0, n // 2] = float("nan")
        scores[-1, 0] = float("-inf")
    if seed % 2:
        scores = scores + torch.randn(rows, n, generator=gen) * (seed % 5 == 1)
    protected = torch.rand(rows, n, generator=gen) < [0.0, 0.1, 0.6][seed % 3]
    budget = torch.randint(0, n + 3, (rows,), generator=gen)
    kept = keep_top(scores, budget, protected)
    for r in range(rows):
        expected = _keep_top_by_definition(scores[r].tolist(), int(budget[r]), protected[r].tolist())
        assert kept[r].tolist() == expected, (r, budget[r])
