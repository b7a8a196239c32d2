"""The vLLM plugin offline (`vllm.LLM`), vLLM really installed, on this CPU.

Parity: greedy tokens, retention and KV bytes through vLLM's engine core and scheduler equal the
embedded engine's for every registered policy, and for a pool small enough that vLLM preempts.
Capacity: with one fixed pool, snapkv at ratio 0.25 lets vLLM's scheduler run at least 3x as many
512-token requests at once as the full cache (read from the scheduler itself).

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the tests can read its scheduler; the
served path, with vLLM's own processes, is tests/test_vllm_serve.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tolerances import logprob_atol
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm_utils import MODEL_DIR, embedded_greedy, retrieval_prompts

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies import policy_names
from vllm_kvpress_ext.vllm_plugin.scheduler import KVPressScheduler

pytestmark = pytest.mark.slow

PARITY_POOL = 700  # pages: every policy's request at once fits; a batch of long full-cache requests does not
NEW_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def in_process_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "KVPRESS_METRICS_FILE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["KVPRESS_METRICS_FILE"] = str(tmp_path_factory.mktemp("metrics") / "kvpress.json")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_llm(num_pages: int, max_num_seqs: int = 16, **kwargs: Any) -> LLM:
    return LLM(
        str(MODEL_DIR),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        # The plugin's own runner, whose sampler is the embedded engine's (vLLM's runner: test_vllm_native_*.py).
        additional_config={"kv_policy": "snapkv", "kv_num_pages": num_pages, "kv_runner": "project"},
        **kwargs,
    )


def scheduler_of(llm: LLM) -> KVPressScheduler:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, KVPressScheduler)
    return scheduler


def vllm_greedy(llm: LLM, prompts: list[list[int]], policies: list[str], max_tokens: int) -> list[Any]:
    params = [
        VllmSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": p})
        for p in policies
    ]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def parity_llm() -> LLM:
    # A small token budget: prompts prefill in several chunks, mixed with other requests' decodes.
    return make_llm(PARITY_POOL, max_num_batched_tokens=96)


def test_every_policy_matches_the_embedded_engine(parity_llm: LLM) -> None:
    names = policy_names()
    assert len(names) == 13  # every registered policy, expected_attention and kvzip included
    prompts = [spec.token_ids for spec in retrieval_prompts(len(names))]
    ours = vllm_greedy(parity_llm, prompts, names, NEW_TOKENS)
    reference = embedded_greedy(prompts, names, NEW_TOKENS, PARITY_POOL)
    assert scheduler_of(parity_llm).metrics.preemptions == 0
    for name, got, want in zip(names, ours, reference, strict=True):
        figures = got.kv_transfer_params["kvpress"]
        assert list(got.outputs[0].token_ids) == want.output_token_ids, name
        assert figures["policy"] == name, name
        assert figures["kv_retention"] == pytest.approx(want.kv.retention, abs=1e-6), name
        assert figures["kv_bytes"] == want.kv.kv_bytes, name
        if name == "wgkv":
            # WG-KV drops what it did not admit between prefill chunks, so its peak follows where vLLM's
            # scheduler cut the prompt (other requests' decodes share the token budget): at most the
            # uncompressed prefill's, at least what it holds at the end.
            assert want.kv.kv_bytes <= figures["kv_bytes_peak"] <= want.kv.kv_bytes_peak, name
        else:
            assert figures["kv_bytes_peak"] == want.kv.kv_bytes_peak, name
    compressed = [
        n for n, got in zip(names, ours, strict=True) if got.kv_transfer_params["kvpress"]["kv_retention"] < 1
    ]
    assert len(compressed) >= 8, f"most policies should compress a {len(prompts[0])}-token prompt: {compressed}"


def test_a_small_pool_preempts_and_outputs_still_match(parity_llm: LLM) -> None:
    prompts = [spec.token_ids for spec in retrieval_prompts(6, context_length=224, seed=9100)]
    policies = ["full"] * 6
    scheduler = scheduler_of(parity_llm)
    before = scheduler.metrics.preemptions
    ours = vllm_greedy(parity_llm, prompts, policies, 64)
    reference = embedded_greedy(prompts, policies, 64, PARITY_POOL * 8)  # no preemption at all
    assert scheduler.metrics.preemptions > before, "the pool should have been too small for all six at once"
    for got, want in zip(ours, reference, strict=True):
        assert list(got.outputs[0].token_ids) == want.output_token_ids
        assert got.kv_transfer_params["kvpress"]["kv_retention"] == 1.0


def test_two_policies_in_one_offline_batch(parity_llm: LLM) -> None:
    specs = retrieval_prompts(2, seed=9300)
    prompts = [spec.token_ids for spec in specs]
    ours = vllm_greedy(parity_llm, prompts, ["full", "h2o"], NEW_TOKENS)
    full, h2o = (o.kv_transfer_params["kvpress"] for o in ours)
    assert (full["policy"], h2o["policy"]) == ("full", "h2o")
    assert full["kv_retention"] == 1.0 and h2o["kv_retention"] < 1.0
    assert h2o["kv_bytes"] < full["kv_bytes"]
    reference = embedded_greedy(prompts, ["full", "h2o"], NEW_TOKENS, PARITY_POOL)
    assert [list(o.outputs[0].token_ids) for o in ours] == [r.output_token_ids for r in reference]


def test_snapkv_runs_three_times_more_requests_at_once_than_full() -> None:
    pool = 1320  # pages: five uncompressed 512 + 16 token requests (8 layer-heads x 33 pages each)
    llm = make_llm(pool, max_num_seqs=32)
    scheduler = scheduler_of(llm)
    prompts = [spec.token_ids[:512] for spec in retrieval_prompts(24, context_length=540, seed=9500)]
    assert all(len(p) == 512 for p in prompts)
    peaks = {}
    for policy in ('{"name": "full"}', '{"name": "snapkv", "ratio": 0.25}'):
        scheduler.metrics.running_peak = 0
        params = VllmSamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": policy})
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
        peaks[policy] = scheduler.metrics.running_peak
    full, snapkv = peaks.values()
    print(f"peak requests scheduled at once with a {pool}-page pool: full {full}, snapkv 0.25 {snapkv}")
    assert full == pool // (8 * 33)
    assert snapkv >= 3 * full, peaks


def test_seeded_sampling_matches_the_embedded_engine(parity_llm: LLM) -> None:
    prompt = retrieval_prompts(1, seed=9400)[0].token_ids
    sampled = VllmSamplingParams(
        max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=11, ignore_eos=True, extra_args={"kv_policy": "h2o"}
    )
    ours = parity_llm.generate([{"prompt_token_ids": prompt}], sampled, use_tqdm=False)[0]
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=PARITY_POOL, page_size=16)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
    request_id = engine.add_request(prompt, params, policy="h2o")
    finished = [o for _ in range(100) for o in engine.step() if o.finished and o.request_id == request_id]
    assert list(ours.outputs[0].token_ids) == finished[0].output_token_ids


def test_penalties_min_p_and_min_tokens_match_the_embedded_engine(parity_llm: LLM) -> None:
    """The sampling features the shared sampler implements give the same tokens through vLLM."""
    prompt = retrieval_prompts(1, seed=9450)[0].token_ids
    shared = dict(
        max_tokens=10,
        temperature=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        min_tokens=6,
        seed=5,
    )
    vllm_params = VllmSamplingParams(**shared, extra_args={"kv_policy": "snapkv"})  # type: ignore[arg-type]
    ours = parity_llm.generate([{"prompt_token_ids": prompt}], vllm_params, use_tqdm=False)[0]
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=PARITY_POOL, page_size=16)
    request_id = engine.add_request(prompt, SamplingParams(**shared), policy="snapkv")  # type: ignore[arg-type]
    want = next(o for _ in range(100) for o in engine.step() if o.finished and o.request_id == request_id)
    assert list(ours.outputs[0].token_ids) == want.output_token_ids
    assert len(want.output_token_ids) >= 6


def test_a_logit_bias_gives_the_embedded_engines_tokens(parity_llm: LLM) -> None:
    """A bias that bans greedy's first token and favours its second: the same tokens through vLLM as in the
    engine, and not the unbiased ones."""
    prompt = retrieval_prompts(1, seed=9470)[0].token_ids
    plain = embedded_greedy([prompt], ["snapkv"], 8, PARITY_POOL)[0].output_token_ids
    bias = {plain[0]: -100.0, plain[1]: 2.0}
    vllm_params = VllmSamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=bias)
    ours = parity_llm.generate([{"prompt_token_ids": prompt}], vllm_params, use_tqdm=False)[0]
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=PARITY_POOL, page_size=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=tuple(bias.items()))
    request_id = engine.add_request(prompt, params, policy="snapkv")  # the LLM's default policy
    want = next(o for _ in range(100) for o in engine.step() if o.finished and o.request_id == request_id)
    assert list(ours.outputs[0].token_ids) == want.output_token_ids != plain


def test_logprobs_equal_the_embedded_engines(parity_llm: LLM) -> None:
    """Sampled-token and prompt log-probabilities through vLLM's engine core, scheduler and output
    processor are the embedded engine's (the same runner and sampler compute them)."""
    prompt = retrieval_prompts(1, seed=9500)[0].token_ids
    vllm_params = VllmSamplingParams(
        max_tokens=5,
        temperature=0.0,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2,
        extra_args={"kv_policy": "snapkv"},
    )
    ours = parity_llm.generate([{"prompt_token_ids": prompt}], vllm_params, use_tqdm=False)[0]
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=PARITY_POOL, page_size=16)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    request_id = engine.add_request(prompt, params, policy="snapkv")
    want = next(o for _ in range(100) for o in engine.step() if o.finished and o.request_id == request_id)
    completion = ours.outputs[0]
    assert list(completion.token_ids) == want.output_token_ids
    assert completion.logprobs is not None and len(completion.logprobs) == len(want.logprobs)
    for position, entry in zip(completion.logprobs, want.logprobs, strict=True):
        tolerance = logprob_atol(torch.float32, engine.config, entry.logprob)
        assert position[entry.token_id].logprob == pytest.approx(entry.logprob, abs=tolerance)
        assert position[entry.token_id].rank == entry.rank
        assert {t for t, _ in entry.top} <= set(position)
    assert ours.prompt_logprobs is not None and ours.prompt_logprobs[0] is None
    assert len(ours.prompt_logprobs) == len(prompt) == len(want.prompt_logprobs)
    for position, entry in zip(ours.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        tolerance = logprob_atol(torch.float32, engine.config, entry.logprob)
        assert position[entry.token_id].logprob == pytest.approx(entry.logprob, abs=tolerance)
        assert {t for t, _ in entry.top} <= set(position)
