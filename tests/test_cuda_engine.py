"""The engine on a CUDA device against the same engine on the CPU, for every registered policy.

The CPU engine is the reference (its attention, cache writes, compaction and scoring are the
pure-torch references); on CUDA the pool lives on the device and the dispatch layer routes to the
Triton kernels. In float32 the two must produce the same greedy tokens and keep the same number of
entries; in bfloat16 they must stay close (rounding can flip a near-tie in a keep plan or an argmax).
Skipped where no CUDA device is visible: this file is what a GPU machine runs.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.bench.accuracy import HELD_OUT_SEED
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies import policy_names
from vllm_kvpress_ext.tasks.synthetic import build_prompt, generate

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 8
# bf16 against fp32-on-CPU: the share of prompts whose greedy tokens must agree exactly, and the
# tolerance on the entries kept (relative).
BF16_AGREEMENT = 0.75
BF16_KEPT_RTOL = 0.05


def _prompts(tokenizer: object) -> list[list[int]]:
    """Retrieval prompts of a few hundred tokens: long enough that every policy compresses."""
    prompts = []
    for i in range(4):
        sample = generate("niah_multikey", HELD_OUT_SEED + i, context_length=384)
        prompts.append(build_prompt(sample, tokenizer).token_ids)
    return prompts


def _run(device: str, dtype: torch.dtype, policy: str) -> list[tuple[list[int], int]]:
    """(greedy tokens, entries kept) per prompt, the prompts batched together as a server would."""
    engine = LLMEngine(default_model_dir(), dtype=dtype, device=device, num_pages=4096, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, policy=policy) for p in _prompts(engine.tokenizer)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.output_token_ids, out.kv.tokens_kept)
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages, "pages leaked"
    return [done[i] for i in ids]


@pytest.mark.parametrize("policy", policy_names())
def test_cuda_fp32_equals_cpu(policy: str) -> None:
    cpu = _run("cpu", torch.float32, policy)
    gpu = _run("cuda", torch.float32, policy)
    assert [t for t, _ in gpu] == [t for t, _ in cpu]
    assert [k for _, k in gpu] == [k for _, k in cpu]


@pytest.mark.parametrize("policy", policy_names())
def test_cuda_bf16_stays_close_to_cpu(policy: str) -> None:
    cpu = _run("cpu", torch.float32, policy)
    gpu = _run("cuda", torch.bfloat16, policy)
    agree = sum(g == c for (g, _), (c, _) in zip(gpu, cpu, strict=True)) / len(cpu)
    assert agree >= BF16_AGREEMENT, f"{policy}: {agree:.0%} of prompts agree"
    for (_, kept_gpu), (_, kept_cpu) in zip(gpu, cpu, strict=True):
        assert abs(kept_gpu - kept_cpu) <= BF16_KEPT_RTOL * kept_cpu, (policy, kept_gpu, kept_cpu)
