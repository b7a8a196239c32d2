"""Gemma 3 270M (the catalog's GGUF file) in the embedded engine: transformers' tokens, a ring of 512 per sliding layer.

The project's loader reads the file (llama.cpp stores Gemma's norm weights plus one; the loader takes it off).
Checked: greedy tokens equal transformers' for 16 tokens after a 1,200-token prompt, more than twice the
sliding window; every sliding-window layer then holds exactly the last 512 positions and every global layer
all of them; SnapKV compresses the global layers only, and every page comes back. Skipped unless the model
is pulled (`kvpress models pull gemma3-270m`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tolerances import logprob_atol

from vllm_kvpress_ext.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

WINDOW = 512
PROMPT_TOKENS = 1200
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(gemma3_gguf: Path) -> LLM:
    return LLM(gemma3_gguf, dtype=torch.float32, page_size=16)


@pytest.fixture(scope="module")
def hf(gemma3_transformers: Any) -> Any:  # transformers types generate() loosely
    return gemma3_transformers


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    ids = list(llm.tokenizer(text)["input_ids"][:PROMPT_TOKENS])
    assert ids[0] == 2  # <bos>, which the file asks for
    return ids


def test_greedy_tokens_equal_transformers_and_sliding_layers_hold_their_window(
    llm: LLM, hf: Any, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True)
    (out,) = llm.generate([prompt], params)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    assert out.output_token_ids == expected
    kept = out.kv.kept
    assert kept is not None
    written = PROMPT_TOKENS + NEW_TOKENS - 1
    windows = llm.engine.config.layer_windows
    assert windows.count(WINDOW) == 15 and windows.count(None) == 3
    for layer, window in enumerate(windows):
        expected_positions = list(range(written - WINDOW, written)) if window else list(range(written))
        assert kept.head(layer, 0) == expected_positions, f"layer {layer}"
    assert out.kv.tokens_kept == 15 * WINDOW + 3 * written
    assert llm.engine.cache.pool.num_used == 0


def test_logprobs_after_a_long_prompt_equal_transformers(llm: LLM, hf: Any) -> None:
    """At 2,100 tokens (four windows and more, in two prefill chunks of the default 2,048), the first generated
    tokens' log-probabilities and top 5 are the log-softmax of transformers' logits, within fp32 rounding."""
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    prompt = list(llm.tokenizer(text)["input_ids"][:2100])
    assert len(prompt) == 2100
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    (out,) = llm.generate([prompt], params)
    assert out.logprobs is not None
    sequence = prompt + out.output_token_ids
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1 :].float()
    reference = torch.log_softmax(logits, dim=-1)
    config = llm.engine.config
    for step, entry in enumerate(out.logprobs):
        row = reference[step]
        assert entry.token_id == int(row.argmax())
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=logprob_atol(torch.float32, config, 20.0))
        assert [t for t, _ in entry.top] == torch.topk(row, 5).indices.tolist()


def test_snapkv_compresses_the_global_layers_and_gives_every_page_back(llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_kept=True)
    (out,) = llm.generate([prompt], params, policy={"name": "snapkv", "ratio": 0.25})
    at_compression = out.kv.kept_at_compression
    assert at_compression is not None
    per_layer = at_compression.per_layer
    windows = llm.engine.config.layer_windows
    assert [n for n, w in zip(per_layer, windows, strict=True) if w] == [WINDOW] * 15
    assert [n for n, w in zip(per_layer, windows, strict=True) if not w] == [round(0.25 * PROMPT_TOKENS)] * 3
    assert llm.engine.cache.pool.num_used == 0


def test_wgkv_serves_with_the_gates_shipped_for_it(llm: LLM, prompt: list[int]) -> None:
    """The gates shipped for Gemma 3 (`kvpress train-gate`, each sliding layer in its window as served) are
    found for the catalog's file: each sliding layer holds its window, each global layer its local ring and
    the older entries its gates admitted, fewer than the prompt's over the global layers; every page comes
    back."""
    from vllm_kvpress_ext.models.write_gate import find_gates, gate_metadata

    gates = find_gates(llm.engine.model_dir)
    assert gates.is_file() and gates.parent.name == "gates"  # the package's, not a file beside the model
    ring = int(gate_metadata(gates)["local_window"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_kept=True)
    (out,) = llm.generate([prompt], params, policy="wgkv")
    at_compression = out.kv.kept_at_compression
    assert at_compression is not None
    windows = llm.engine.config.layer_windows
    per_layer = at_compression.per_layer
    assert [n for n, w in zip(per_layer, windows, strict=True) if w] == [WINDOW] * 15
    held = [n for n, w in zip(per_layer, windows, strict=True) if not w]
    assert all(ring <= n <= PROMPT_TOKENS for n in held) and sum(held) < len(held) * PROMPT_TOKENS, held
    assert out.kv.retention < 1.0
    assert llm.engine.cache.pool.num_used == 0
