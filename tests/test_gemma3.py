"""Gemma 3 270M, the catalog's second real model (base, Q4_K_M GGUF), served through the plugin.

The project's own runner reads no Gemma 3, so a plain `vllm.LLM("gemma3-270m")` with the plugin active runs
vLLM's model runner over the plugin's pool: the GGUF file's config, tokenizer and dequantised weights come
from transformers' GGUF reader. Checked here: greedy tokens equal transformers' on a prompt more than twice
the sliding window; the sliding-window layers hold their window and no more while the global layers hold
every token; SnapKV compresses and every page comes back. Skipped unless the model is pulled
(`kvpress models pull gemma3-270m`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import LLM as VllmLLM
from vllm import SamplingParams as VllmSamplingParams
from vllm_utils import assert_no_page_leaked, in_process_engine, in_process_worker

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

WINDOW = 512  # the model's sliding window
PROMPT_TOKENS = 1200
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(gemma3_gguf: Path) -> Iterator[VllmLLM]:
    engine = VllmLLM(
        "gemma3-270m",
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=2,
        additional_config={"kv_num_pages": 4096},
    )
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def prompt(llm: VllmLLM) -> list[int]:
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    ids = llm.get_tokenizer()(text)["input_ids"][:PROMPT_TOKENS]
    assert ids[0] == 2  # <bos>: the file asks for it, and the tokenizer written for vLLM honours that
    return list(ids)


def test_greedy_tokens_equal_transformers_and_sliding_layers_hold_their_window(
    llm: VllmLLM, gemma3_transformers: Any, prompt: list[int]
) -> None:
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    pool = in_process_worker(llm).model_runner.pool
    (seat,) = pool.seats.values()  # the finished request, freed at the next step
    written = PROMPT_TOKENS + NEW_TOKENS - 1
    held = pool.cache.seq_lens[:, seat.row].tolist()  # [layer][KV head]
    windows = pool.cache.layer_windows.tolist()
    assert sorted(set(windows)) == [0, WINDOW] and windows.count(WINDOW) == 15  # five of every six layers
    for window, layer in zip(windows, held, strict=True):
        assert layer == [WINDOW if window else written]  # a ring of exactly its window, or every token
    figures = out.kv_transfer_params["kvpress"]
    assert figures["kv_tokens_kept"] == sum(map(sum, held)) == 15 * WINDOW + 3 * written

    with torch.no_grad():
        expected = gemma3_transformers.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert list(out.outputs[0].token_ids) == expected[0, len(prompt) :].tolist()


def test_snapkv_compresses_gemma3_and_every_page_comes_back(llm: VllmLLM, prompt: list[int]) -> None:
    spec = json.dumps({"name": "snapkv", "ratio": 0.25})
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": spec})
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    for out in outputs:
        figures = out.kv_transfer_params["kvpress"]
        assert figures["policy"] == "snapkv" and len(out.outputs[0].token_ids) == NEW_TOKENS
        # The policy compresses the 3 global layers (the 15 rings hold their window whatever it chooses).
        global_kept = figures["kv_tokens_kept"] - 15 * WINDOW
        assert 0 < global_kept < 0.3 * 3 * (PROMPT_TOKENS + NEW_TOKENS - 1)
        assert figures["kv_bytes"] < figures["kv_bytes_peak"]
    llm.generate([{"prompt_token_ids": prompt[:8]}], VllmSamplingParams(max_tokens=1), use_tqdm=False)
    assert_no_page_leaked(in_process_worker(llm).model_runner.pool)


def test_wgkv_with_the_shipped_gates_keeps_on_vllms_runner_what_the_embedded_engine_keeps(
    llm: VllmLLM, gemma3_gguf: Path, prompt: list[int]
) -> None:
    """The gates shipped for Gemma 3 are found for the catalog name on vLLM's runner too, and WG-KV keeps there
    what it keeps in the embedded engine on the same file: the same figures, and every page comes back."""
    from vllm_kvpress_ext.engine import LLM, SamplingParams

    params = VllmSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": "wgkv"})
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    figures = out.kv_transfer_params["kvpress"]
    embedded = LLM(gemma3_gguf, dtype=torch.float32, page_size=16)
    (mine,) = embedded.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), policy="wgkv")
    assert figures["policy"] == "wgkv" and figures["kv_tokens_kept"] == mine.kv.tokens_kept
    assert figures["kv_tokens_kept"] < figures["kv_tokens_full"]
    assert list(out.outputs[0].token_ids) == mine.output_token_ids
    llm.generate([{"prompt_token_ids": prompt[:8]}], VllmSamplingParams(max_tokens=1), use_tqdm=False)
    assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
