"""KVzip: the scores by hand, the chunked reconstruction pass against a dense forward, budgets, forks and bad input."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import DenseContext

import vllm_kvpress_ext.assets as assets
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.prefix import add_forked_request, capture_prefix, merged_capture_spec
from vllm_kvpress_ext.engine.reconstruction import attention_with_lse, prompts_for_model, reconstruction_chunk_scores
from vllm_kvpress_ext.policies import KVzipPolicy, PolicyConfigError, load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill
from vllm_kvpress_ext.policies.kvzip import select

MODEL = Path(assets.__file__).parent / "default_model"


def test_scores_by_hand() -> None:
    """d = 1, scale 1, logits chosen as logarithms so every probability is a small fraction.

    One KV head, two query heads (q = 1 and q = 2), one sink (key 0), a span of two cached keys (ln 2,
    ln 3) and two reconstruction queries with own keys 0 and ln 4. Query 0 of head 0 sees weights
    1, 2, 3, 1 (sum 7); query 1 adds 4 (sum 11). Head 1 squares them: 1, 4, 9, 1 (sum 15), then 16 (31).
    The span's scores are the maxima: max(2/7, 2/11, 4/15, 4/31) and max(3/7, 3/11, 9/15, 9/31).
    """
    ln = math.log
    queries = torch.tensor([[[1.0], [2.0]], [[1.0], [2.0]]])  # [m=2, Hq=2, d=1]
    own = torch.tensor([[[0.0]], [[ln(4)]]])  # [m=2, Hkv=1, d=1]
    sinks = torch.tensor([[[0.0]]])  # [Hkv=1, S=1, d=1]
    span = torch.tensor([[[ln(2)], [ln(3)]]])  # [Hkv=1, c=2, d=1]
    for block in (1, 2, 256):
        scores = reconstruction_chunk_scores(queries, own, sinks, span, 1.0, query_block=block)
        torch.testing.assert_close(scores, torch.tensor([[2 / 7, 9 / 15]]), rtol=1e-6, atol=1e-7)


def test_the_attention_normaliser_serves_the_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores from the own keys' log-sum-exp (what the pass's attention yields) equal scores computed alone,
    and the CPU flash path of `attention_with_lse` equals its explicit-softmax path."""
    g = torch.Generator().manual_seed(0)
    m, hq, hkv, d = 300, 4, 2, 8  # more queries than one block of the explicit path
    queries, own = torch.randn(m, hq, d, generator=g), torch.randn(m, hkv, d, generator=g)
    own_values = torch.randn(m, hkv, d, generator=g)
    cached = torch.randn(hkv, 40, d, generator=g)
    out, lse = attention_with_lse(queries.transpose(0, 1), own.transpose(0, 1), own_values.transpose(0, 1), True, 0.3)
    full_out, full_lse = attention_with_lse(queries.transpose(0, 1), cached, cached.flip(1), False, 0.3)
    with monkeypatch.context() as patched:  # no flash kernel: the explicit softmax
        patched.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        out_ref, lse_ref = attention_with_lse(
            queries.transpose(0, 1), own.transpose(0, 1), own_values.transpose(0, 1), True, 0.3
        )
        full_out_ref, full_lse_ref = attention_with_lse(queries.transpose(0, 1), cached, cached.flip(1), False, 0.3)
    for got, want in ((out, out_ref), (lse, lse_ref), (full_out, full_out_ref), (full_lse, full_lse_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = reconstruction_chunk_scores(queries, own, cached[:, :3], cached[:, 10:], 0.3, query_block=5)
    served = reconstruction_chunk_scores(queries, own, cached[:, :3], cached[:, 10:], 0.3, lse.transpose(0, 1), 7)
    torch.testing.assert_close(served, alone, rtol=1e-5, atol=1e-6)


def test_a_soft_cap_caps_the_logits_of_the_attention_and_the_scores() -> None:
    """Gemma 2's cap: attention and scores are those of the softmax over `cap * tanh(logit / cap)`, written out
    densely here in float64 (the sinks, the span and the own keys up to each query, one softmax per query)."""
    g = torch.Generator().manual_seed(1)
    m, hq, hkv, d, cap, scale = 6, 4, 2, 8, 2.0, 0.9  # logits of several units: the cap bends them
    queries, own = torch.randn(m, hq, d, generator=g), torch.randn(m, hkv, d, generator=g)
    values, cached = torch.randn(m, hkv, d, generator=g), torch.randn(hkv, 9, d, generator=g)
    sinks, span = cached[:, :2], cached[:, 5:]
    out, lse = attention_with_lse(
        queries.transpose(0, 1), own.transpose(0, 1), values.transpose(0, 1), True, scale, cap
    )
    scores = reconstruction_chunk_scores(queries, own, sinks, span, scale, lse.transpose(0, 1), soft_cap=cap)
    alone = reconstruction_chunk_scores(queries, own, sinks, span, scale, soft_cap=cap, query_block=4)
    want_out = torch.zeros(hq, m, d, dtype=torch.float64)
    want = torch.zeros(hkv, span.shape[1], dtype=torch.float64)
    for h in range(hq):
        g_ = h // (hq // hkv)
        for i in range(m):
            keys = torch.cat([sinks[g_], span[g_], own[: i + 1, g_]]).double()
            logits = keys @ queries[i, h].double() * scale
            probs = torch.softmax(cap * torch.tanh(logits / cap), dim=0)
            want[g_] = torch.maximum(want[g_], probs[2 : 2 + span.shape[1]])
            own_logits = own[: i + 1, g_].double() @ queries[i, h].double() * scale
            own_probs = torch.softmax(cap * torch.tanh(own_logits / cap), dim=0)
            want_out[h, i] = own_probs @ values[: i + 1, g_].double()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reconstruction_chunk_scores(queries, own, sinks, span, scale).double(), want, atol=1e-3)


def dense_reference(engine: LLMEngine, tokens: list[int], policy: KVzipPolicy) -> torch.Tensor:
    """The paper's scores from whole dense forwards: the prompt then each chunk's input, in one causal pass.

    Chunks are built here from the instructions' token ids alone, and the softmax over the sinks, the
    chunk's entries and the input's own keys is written out in float64 with an explicit mask.
    """
    prompts = prompts_for_model(str(engine.runner.model_dir))
    config = engine.config
    n, group = len(tokens), config.num_attention_heads // config.num_key_value_heads
    first = len(prompts.context_header) if policy.skip_header else 0  # kvpress's start, after the header
    scores = torch.zeros(config.num_hidden_layers, config.num_key_value_heads, n, dtype=torch.float64)
    for start in range(first, n, policy.chunk_size):
        end = min(n, start + policy.chunk_size)
        quote = tokens[max(first, start - policy.overlap_tokens) : start]
        lead = list(prompts.repeat) if start == first else list(prompts.resume) + quote
        chunk_input = lead + list(prompts.answer_header) + tokens[start:end]
        sequence = tokens + chunk_input
        context = DenseContext([len(sequence)])
        engine.model(torch.tensor(sequence), torch.arange(len(sequence)), context)
        sinks = min(policy.sink_tokens, start)
        allowed = torch.zeros(len(chunk_input), len(sequence), dtype=torch.bool)
        allowed[:, :sinks] = True
        allowed[:, start:end] = True
        allowed[:, n:] = torch.ones(len(chunk_input), len(chunk_input), dtype=torch.bool).tril()
        for layer, captured in context.captured.items():
            q = captured.q[n:].double().transpose(0, 1)  # [Hq, m, d]
            k = captured.k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, d]
            logits = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            best = probs[:, :, start:end].amax(dim=1).view(config.num_key_value_heads, group, -1).amax(dim=1)
            scores[layer, :, start:end] = best
    scores[:, :, : policy.sink_tokens] = float("inf")
    return scores


class RecordingKVzip(KVzipPolicy):
    """KVzip that also hands its reconstruction scores to the test."""

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        scores = super().on_layer_prefilled(layer, state)
        state.setdefault("scores", []).append(scores.clone())
        return scores


def engine_scores(engine: LLMEngine, tokens: list[int], policy: KVzipPolicy, prefill_chunk: int | None = None) -> Any:
    recorded: dict[str, Any] = {}

    def keep(request: Any) -> None:
        recorded["scores"] = torch.stack(request.seat.policy_state["scores"])
        recorded["held"] = engine.cache.usage(request.request_id).global_tokens.clone()

    engine.finish_hooks.append(keep)
    try:
        engine.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0), "kvzip", policy=policy)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.finish_hooks.remove(keep)
    return recorded


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(str(MODEL), max_num_seqs=4)


PROMPT = [int(t) for t in torch.randint(5, 200, (90,), generator=torch.Generator().manual_seed(3))]


@pytest.mark.parametrize(
    ("chunk_size", "skip_header"), [(16, False), (37, False), (90, False), (500, False), (16, True)]
)
def test_chunked_pass_matches_the_dense_forward(engine: LLMEngine, chunk_size: int, skip_header: bool) -> None:
    """With `skip_header` (kvpress's way) the pass starts after the chat template's context header: its entries
    past the sinks score 0 (and only then)."""
    # The bundled model's template opens with 2 tokens: no sinks, so that both are past them.
    sinks = 0 if skip_header else 4
    policy = RecordingKVzip(ratio=0.5, chunk_size=chunk_size, skip_header=skip_header, sink_tokens=sinks)
    recorded = engine_scores(engine, PROMPT, policy)
    reference = dense_reference(engine, PROMPT, policy)
    torch.testing.assert_close(recorded["scores"].double(), reference, rtol=1e-4, atol=1e-5)
    header = len(prompts_for_model(str(MODEL)).context_header)
    assert bool((recorded["scores"][:, :, :header] == 0).all()) == skip_header
    # The budget: L * H * round(0.5 * n) prompt entries in all (the one sampled token is never written).
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    assert int(recorded["held"].sum()) == layers * heads * round(0.5 * len(PROMPT))


def test_chunked_prefill_gives_the_same_scores(engine: LLMEngine) -> None:
    """A prompt prefilled in several engine chunks is reconstructed from the same cache."""
    whole = engine_scores(engine, PROMPT, RecordingKVzip(ratio=0.5, chunk_size=37))
    chunked_engine = LLMEngine(str(MODEL), max_num_seqs=4, max_num_batched_tokens=32)
    chunked = engine_scores(chunked_engine, PROMPT, RecordingKVzip(ratio=0.5, chunk_size=37))
    torch.testing.assert_close(chunked["scores"], whole["scores"], rtol=1e-4, atol=1e-5)


def test_forks_copy_the_prefix_scores(engine: LLMEngine) -> None:
    """A fork of a captured prefix keeps what a whole-prompt run keeps, without a second reconstruction."""
    policy = RecordingKVzip(ratio=0.4, chunk_size=32)
    prefix, question = PROMPT[:80], PROMPT[80:]
    whole = engine_scores(engine, prefix, policy)
    snapshot = capture_prefix(engine, prefix, merged_capture_spec([policy]), "prefix")
    assert snapshot.layers[0].reconstruction_scores is not None
    recorded: dict[str, Any] = {}

    def keep(request: Any) -> None:
        recorded["scores"] = torch.stack(request.seat.policy_state["scores"])

    engine.finish_hooks.append(keep)
    try:
        add_forked_request(engine, snapshot, prefix + question, SamplingParams(max_tokens=1), "fork", policy)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.finish_hooks.remove(keep)
    torch.testing.assert_close(recorded["scores"], whole["scores"])


def test_selection_by_allocation() -> None:
    scores = torch.tensor(
        [[[9.0, 1.0, 1.0, 1.0], [8.0, 7.0, 6.0, 5.0]], [[0.5, 0.4, 0.3, 0.2], [0.1, 0.0, 0.0, 0.0]]]
    )  # [L=2, H=2, n=4]
    kept = select(scores, 2, "global")
    # The 8 best of all 16: layer 0's 9, 8, 7, 6, 5 and its three tied 1s; layer 1 keeps nothing past them.
    assert kept[0].all() and not kept[1].any()
    layer = select(scores, 2, "layer")
    assert [int(layer[i].sum()) for i in range(2)] == [4, 4]
    head = select(scores, 2, "head")
    assert head.sum(-1).tolist() == [[2, 2], [2, 2]]
    assert head[1, 1].tolist() == [True, True, False, False]  # ties go to the lower index


def test_preset_and_registry() -> None:
    policy = load_policy("kvzip")
    assert isinstance(policy, KVzipPolicy)
    assert policy.params() == KVzipPolicy().params()
    tokens = load_policy({"name": "kvzip", "tokens": 64})
    assert isinstance(tokens, KVzipPolicy) and tokens.ratio is None and tokens.tokens == 64


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "kvzip", "chunk_size": 0}, "chunk_size"),
        ({"name": "kvzip", "chunk_size": 1 << 20}, "chunk_size"),
        ({"name": "kvzip", "sink_tokens": -1}, "sink_tokens"),
        ({"name": "kvzip", "overlap_tokens": -1}, "overlap_tokens"),
        ({"name": "kvzip", "overlap_tokens": 5000}, "overlap_tokens"),
        ({"name": "kvzip", "allocation": "pairs"}, "allocation"),
        ({"name": "kvzip", "ratio": 0.0}, "ratio"),
        ({"name": "kvzip", "ratio": 0.5, "tokens": 8}, "exactly one"),
        ({"name": "kvzip", "chunk_size": 12.5}, "chunk_size"),
    ],
)
def test_bad_fields(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        load_policy(spec)


def test_a_model_without_tokenizer_is_a_clear_failure(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes((MODEL / name).read_bytes())
    engine = LLMEngine(str(tmp_path), max_num_seqs=2)
    engine.add_request(PROMPT[:20], SamplingParams(max_tokens=1), "r", policy={"name": "kvzip"})
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs and "tokenizer" in (outputs[-1].error or "")


def test_a_fork_needing_another_reconstruction_is_refused(engine: LLMEngine) -> None:
    """The prefix's pass scored with one chunking; a fork whose policy chunks otherwise cannot reuse it."""
    prefix = PROMPT[:40]
    snapshot = capture_prefix(engine, prefix, merged_capture_spec([KVzipPolicy(chunk_size=16)]), "prefix-16")
    other = KVzipPolicy(chunk_size=32)
    with pytest.raises(ValueError, match="lacks what"):
        add_forked_request(engine, snapshot, [*prefix, 7], SamplingParams(max_tokens=1), "fork-32", other)
