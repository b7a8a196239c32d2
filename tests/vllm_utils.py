"""Helpers shared by the vLLM plugin tests: retrieval prompts on the bundled model and embedded-engine references."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.bench.tasks import build_prompt, generate
from vllm_kvpress_ext.bench.tasks.base import Sample
from vllm_kvpress_ext.bench.tasks.prompt import PromptSpec
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams

MODEL_DIR = default_model_dir()
PAGE_SIZE = 16


def retrieval_samples(count: int, context_length: int = 128, seed: int = 7000) -> list[Sample]:
    """Needle-in-a-haystack samples the bundled model answers (docs/model.md)."""
    return [generate("niah_multikey", seed + i, context_length=context_length) for i in range(count)]


def retrieval_prompts(count: int, context_length: int = 128, seed: int = 7000) -> list[PromptSpec]:
    """The samples' chat-formatted token ids, answers and stop tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    return [build_prompt(sample, tokenizer) for sample in retrieval_samples(count, context_length, seed)]


def embedded_greedy(
    prompts: list[list[int]], policies: list[Any], max_tokens: int, num_pages: int, max_num_seqs: int = 16
) -> list[Any]:
    """Finished outputs of the embedded engine for each (prompt, policy), all submitted at once."""
    engine = LLMEngine(
        MODEL_DIR, dtype=torch.float32, num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=max_num_seqs
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, policy=policy) for p, policy in zip(prompts, policies, strict=True)]
    done: dict[str, Any] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.cache.pool.num_used == 0
    return [done[i] for i in ids]
