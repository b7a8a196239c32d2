"""Policies on vLLM's own model runner (`kv_runner: vllm`): what each keeps equals what the embedded engine keeps.

The same checkpoint (a random-weight GQA Llama, fp32) runs on the embedded engine and on vLLM's runner over
the plugin's pool, with the same prompts, page size and chunking (each prompt one chunk). For every policy
that runner serves, the entries each (layer, KV head) holds right after compression are the embedded
engine's, the greedy tokens are the same, the figures in the finished request's `kv_transfer_params` are
the embedded request's, and the pages the policy dropped are back in the pool. The policies it does not
serve yet are refused by name, at start and per request.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import held_sets, write_phi3_twin, write_random_gates, write_suite_gemma3, write_suite_model
from vllm import LLM as VllmLLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm_utils import in_process_engine, in_process_worker, vllm_runner_llm

from vllm_kvpress_ext.engine import LLM, SamplingParams
from vllm_kvpress_ext.hub import catalog
from vllm_kvpress_ext.models import load_model
from vllm_kvpress_ext.models.write_gate import default_gate_path, shipped_gates
from vllm_kvpress_ext.models.writer import save_model
from vllm_kvpress_ext.policies.registry import create_policy, policy_names
from vllm_kvpress_ext.policies.xkv import XKVProfile
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY
from vllm_kvpress_ext.vllm_plugin.gguf_model import prepare_gguf_model
from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, model_facts, native_refusal, native_rope

# vLLM's engine core in this process, so the tests can read its scheduler and worker.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

PAGE_SIZE = 16
NEW_TOKENS = 6
# The checkpoints here are Llama configs the project parses, so it knows their RoPE (`native_rope`).
LLAMA = ModelFacts(rope=True, projections=True)
SERVED = [n for n in policy_names() if create_policy(n).compresses and native_refusal(create_policy(n), LLAMA) is None]
# Budgets that keep a part of a 96-token prompt (the registry's defaults, where they would keep it all).
SPECS: dict[str, Any] = {
    "snapkv": {"name": "snapkv", "ratio": 0.25},
    "adakv": {"name": "adakv", "ratio": 0.25},
    "streaming_llm": {"name": "streaming_llm", "ratio": 0.3},
    # The gates beside the checkpoint (`write_random_gates`) admit about half the keys at tau 0.5.
    "wgkv": {"name": "wgkv", "tau": 0.5},
}
GATE_WINDOW = 16  # the gates' local window (`write_random_gates`)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_suite_model(tmp_path_factory.mktemp("native-policies"), hidden=64, std=0.3)
    write_random_gates(path, GATE_WINDOW)
    return path


@pytest.fixture(scope="module")
def embedded(model: Path) -> LLM:
    return LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE)


def native_llm(
    model: Path, max_num_batched_tokens: int | None = None, num_pages: int = 2048, **additional: Any
) -> VllmLLM:
    # The embedded engines compared with run without a prefix store: each prompt here is prefilled whole, and no
    # page is shared with kept blocks (whose 1/k shares would change `kv_bytes`). Reading kept blocks under a
    # policy is tests/test_vllm_native_runner.py's.
    return vllm_runner_llm(
        model, num_pages, additional, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False
    )


@pytest.fixture(scope="module")
def native(model: Path) -> Iterator[VllmLLM]:
    llm = native_llm(model)
    yield llm
    del llm
    gc.collect()


def prompts() -> list[list[int]]:
    """Two 96-token prompts of random suite tokens."""
    rngs = [random.Random(seed) for seed in (0, 1)]
    return [[rng.randrange(10, len(VOCABULARY)) for _ in range(96)] for rng in rngs]


def native_pool(llm: VllmLLM) -> Any:
    return in_process_worker(llm).model_runner.pool


def assert_same_kept(
    embedded: LLM, native: VllmLLM, name: str, batch: list[list[int]], spec: str | dict[str, Any] | None = None
) -> None:
    """`batch` on both engines under `name`'s policy (`spec`, by default its entry in `SPECS`): the same kept
    entries, tokens and figures, no page leaked."""
    spec = spec if spec is not None else SPECS.get(name, name)
    ours = embedded.generate(
        batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True), policy=spec
    )
    pool = native_pool(native)
    pool.kept_at_compression = {}
    params = VllmSamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_policy": json.dumps(spec) if isinstance(spec, dict) else spec},
    )
    theirs = native.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    kept = list(pool.kept_at_compression.values())  # in the order the requests compressed: the prompts' order
    assert len(kept) == len(ours)
    for mine, vllm_output, vllm_kept in zip(ours, theirs, kept, strict=True):
        assert mine.kv.kept_at_compression is not None
        assert held_sets(vllm_kept) == held_sets(mine.kv.kept_at_compression)
        assert list(vllm_output.outputs[0].token_ids) == mine.output_token_ids
        figures = vllm_output.kv_transfer_params["kvpress"]
        assert figures["policy"] == name
        assert figures["kv_tokens_kept"] == mine.kv.tokens_kept and figures["kv_tokens_full"] == mine.kv.tokens_full
        assert figures["kv_bytes"] == mine.kv.kv_bytes < figures["kv_bytes_peak"]
    held = sum(pool.cache.usage(request_id).pages for request_id in pool.seats)
    assert pool.cache.pool.num_free + held == pool.cache.pool.num_pages


@pytest.mark.parametrize("name", SERVED)
def test_each_policy_keeps_on_vllms_runner_what_it_keeps_on_the_embedded_engine(
    name: str, embedded: LLM, native: VllmLLM
) -> None:
    assert_same_kept(embedded, native, name, prompts())


def test_layerwise_policies_peak_where_the_embedded_engine_peaks(tmp_path: Path) -> None:
    """The layer-wise forms of LAVa (cascading) and XKV (with a saved profile) compress each layer right after
    its attention on both engines when a prompt is one chunk: a layer's pages are allocated as the pass reaches
    it. Both engines keep the same entries, and the request's high-water mark is the embedded engine's, below
    the whole prompt in every layer; the scheduler reserves the policy's declared peak
    (`PoolReport.compresses_layerwise`)."""
    model = write_suite_model(tmp_path / "four-layers", hidden=64, std=0.3, num_layers=4)
    profile = XKVProfile([0.1, 0.5, 0.2, 0.3], window=8).save(tmp_path / "xkv.yaml")
    specs = [{"name": "lava", "cascading": True}, {"name": "xkv", "profile": str(profile)}]
    embedded = LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE)
    batch = [
        torch.randint(10, len(VOCABULARY), (96,), generator=torch.Generator().manual_seed(s)).tolist() for s in (0, 1)
    ]
    whole_prompt = 4 * 2 * -(-len(batch[0]) // PAGE_SIZE)
    for spec in specs:
        native = native_llm(model, kv_policy=spec)  # XKV's profile is a server file: the operator's policy names it
        try:
            pool = native_pool(native)
            pool.kept_at_compression = {}
            greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True)
            ours = embedded.generate(batch, greedy, policy=spec)
            params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            theirs = native.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            kept = list(pool.kept_at_compression.values())
            page_bytes = pool.cache.pool.bytes_per_page
            for mine, output, vllm_kept in zip(ours, theirs, kept, strict=True):
                assert mine.kv.kept_at_compression is not None
                assert held_sets(vllm_kept) == held_sets(mine.kv.kept_at_compression), spec
                assert list(output.outputs[0].token_ids) == mine.output_token_ids, spec
                peak = output.kv_transfer_params["kvpress"]["kv_bytes_peak"]
                assert peak == mine.kv.kv_bytes_peak < whole_prompt * page_bytes, spec
            assert pool.report().compresses_layerwise
        finally:
            del native
            gc.collect()


@pytest.mark.parametrize("name", ["snapkv", "h2o", "gvote", "kvzip", "wgkv"])
def test_a_prompt_in_chunks_keeps_the_same_entries(name: str, model: Path) -> None:
    """Steps of 32 tokens: the 96-token prompt prefills in three chunks on both engines, the capture (the
    window's queries; H2O's every query with its log-sum-exp; GVote's hidden-state statistics, from the QKV
    projection's input) gathered across them, and WG-KV's unadmitted entries dropped after each chunk."""
    embedded = LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE, max_num_batched_tokens=32)
    native = native_llm(model, max_num_batched_tokens=32)
    try:
        for prompt in prompts():  # one at a time: each engine chunks it 32 + 32 + 32
            assert_same_kept(embedded, native, name, [prompt])
    finally:
        del native
        gc.collect()


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_a_prompts_last_token_alone_in_a_chunk_is_prefilled_not_decoded(name: str, model: Path) -> None:
    """Steps of 95 tokens: a 96-token prompt's last token is a chunk of its own, which vLLM schedules like a
    decode (one token, past position 0). It is the prompt's: its query joins the observation window (SnapKV with
    an 8-token window, so the window ranks) and H2O's accumulated attention, and the policy compresses after it."""
    embedded = LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE, max_num_batched_tokens=95)
    native = native_llm(model, max_num_batched_tokens=95)
    spec = {"name": "snapkv", "ratio": 0.25, "window": 8} if name == "snapkv" else name
    try:
        for prompt in prompts():
            assert_same_kept(embedded, native, name, [prompt], spec)
    finally:
        del native
        gc.collect()


@pytest.mark.parametrize("chunk", [None, 32])
def test_wgkv_under_a_cap_keeps_the_same_entries(chunk: int | None, model: Path) -> None:
    """WG-KV composed with eviction (a cap of 8 global entries per KV head): the highest-gated admitted entries
    kept between chunks, the SnapKV-like cut at prefill completion, and decode-time evictions from each step's
    attention over the local ring and the global region; the same on both engines."""
    spec = {"name": "wgkv", "tau": 0.5, "cap": 8, "local_window": GATE_WINDOW}
    chunking = {} if chunk is None else {"max_num_batched_tokens": chunk}
    embedded = LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE, **chunking)
    native = native_llm(model, max_num_batched_tokens=chunk)
    try:
        for prompt in prompts():
            assert_same_kept(embedded, native, "wgkv", [prompt], spec)
    finally:
        del native
        gc.collect()


def test_phi3_keeps_what_the_embedded_engine_keeps_for_its_llama_twin(
    model: Path, embedded: LLM, tmp_path: Path
) -> None:
    """Phi-3, whose attention the project's model code does not run: the runner reads its RoPE from its config
    (`ROPE_ARCHITECTURES`) and hooks its fused QKV projection. Written as the Llama checkpoint's Phi-3 twin (the
    same function, its projections fused as Phi-3 stores them), it keeps under every policy exactly what the
    embedded engine keeps for the Llama, with the same tokens and figures."""
    phi3 = write_phi3_twin(model, tmp_path / "phi3")
    assert native_rope(phi3) is not None and model_facts(str(phi3)).projections
    native = native_llm(phi3)
    try:
        for name in SERVED:
            assert_same_kept(embedded, native, name, prompts())
    finally:
        del native
        gc.collect()


# Gemma 3 (sliding-window layers): the project parses its config, so it knows the RoPE of the global layers,
# the only ones a policy sees, and the only ones where a write gate keeps a local ring.
SERVED_ON_GEMMA3 = SERVED


def test_every_served_policy_keeps_the_embedded_engines_entries_on_gemma3(tmp_path: Path) -> None:
    """A random Gemma 3 with a window of 8 in two of its four layers: on both engines those layers are rings of
    the prompt's last 8 positions, and each policy keeps the same entries of the global layers, alone or with a
    prompt in chunks of 32 (a chunk reads the ring the previous one left)."""
    _, gemma3 = write_suite_gemma3(tmp_path / "gemma3")
    write_random_gates(gemma3, GATE_WINDOW)
    for chunk in (None, 32):
        chunking = {} if chunk is None else {"max_num_batched_tokens": chunk}
        embedded = LLM(gemma3, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE, **chunking)
        native = native_llm(gemma3, max_num_batched_tokens=chunk)
        try:
            for name in SERVED_ON_GEMMA3:
                assert_same_kept(embedded, native, name, prompts() if chunk is None else prompts()[:1])
        finally:
            del native
            gc.collect()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M (the catalog's GGUF file, pulled by `make serve` or `kvpress models pull smollm2-135m`) as
    an fp32 HF directory, which both engines load: vLLM's runner reads no GGUF file."""
    entry = catalog.lookup("smollm2-135m")
    gguf = catalog.cached_path(entry) if entry is not None else None
    if gguf is None or not gguf.is_file():
        pytest.skip("SmolLM2-135M is not pulled (kvpress models pull smollm2-135m)")
    directory = prepare_gguf_model(str(gguf))
    config = json.loads((directory / "config.json").read_text())
    out = save_model(load_model(gguf, dtype=torch.float32), config, tmp_path_factory.mktemp("smollm2-hf"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (directory / name).is_file():
            shutil.copy(directory / name, out / name)
    shutil.copy(shipped_gates()["smollm2-135m"], default_gate_path(out))  # the catalog model's trained gates
    return out


def test_every_served_policy_keeps_the_embedded_engines_entries_on_smollm2(smollm2: Path) -> None:
    """A real model: SmolLM2-135M, fp32, two 200-token prompts, each policy at its defaults."""
    embedded = LLM(smollm2, dtype=torch.float32, num_pages=8192, page_size=PAGE_SIZE)
    native = native_llm(smollm2, num_pages=8192)
    rngs = [random.Random(seed) for seed in (2, 3)]
    batch = [[rng.randrange(100, 40000) for _ in range(200)] for rng in rngs]
    try:
        for name in SERVED:
            assert_same_kept(embedded, native, name, batch)
    finally:
        del native
        gc.collect()


def test_structured_output_is_valid_json_under_snapkv_on_smollm2(smollm2: Path) -> None:
    """vLLM's structured output (xgrammar's bitmask on the logits) under SnapKV 0.25 on vLLM's runner."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    llm = VllmLLM(
        str(smollm2),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=2,
        block_size=PAGE_SIZE,
        additional_config={"kv_runner": "vllm", "kv_num_pages": 8192, "kv_policy": {"name": "snapkv", "ratio": 0.25}},
    )
    try:
        params = VllmSamplingParams(
            max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
        )
        prompt = "Paris is the capital of France. " * 20 + "Give the city and the year it hosted the Olympics, as JSON:"
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        reply = json.loads(out.outputs[0].text)
        assert set(reply) == {"city", "year"} and isinstance(reply["year"], int)
        figures = out.kv_transfer_params["kvpress"]
        assert figures["policy"] == "snapkv" and figures["kv_retention"] < 0.5
    finally:
        del llm
        gc.collect()
