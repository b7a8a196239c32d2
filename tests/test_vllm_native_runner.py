"""vLLM's own model runner and model zoo under the plugin (`additional_config={"kv_runner": "vllm"}`), first
step: the full cache, exact. Each architecture is a tiny random checkpoint written here with transformers;
vLLM's implementation of it, run by vLLM's `CPUModelRunner` with the plugin's attention backend, must
produce HF transformers' greedy tokens, for a batch of two prompts of different lengths (prefill and
decode batched together; Gemma 3's sliding window shorter than the prompts)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError

pytestmark = pytest.mark.slow

COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"eos_token_id": 1, "pad_token_id": 0}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,  # shorter than both prompts: the first layer attends to a window only
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
PROMPTS = [list(range(5, 17)), list(range(30, 70))]
NEW_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def in_process_engine() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


def write_checkpoint(root: Path, name: str) -> tuple[Path, list[list[int]]]:
    """A random fp32 checkpoint of `name`, and HF's greedy continuation of each prompt."""
    config_name, model_name, extra = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(config).eval()
    path = root / name
    model.save_pretrained(path)
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(prompt) :].tolist())
    return path, expected


def native_llm(path: Path, **additional: Any) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
        skip_tokenizer_init=True,
        additional_config={"kv_runner": "vllm", **additional},
    )


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_vllms_model_code_equals_transformers_token_for_token(name: str, tmp_path: Path) -> None:
    path, expected = write_checkpoint(tmp_path, name)
    llm = native_llm(path)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert type(llm.llm_engine.model_config).__name__ == "ModelConfig"
    finally:
        del llm
        gc.collect()


def test_compression_is_refused_on_this_path_until_it_runs_there(tmp_path: Path) -> None:
    path, _ = write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="full cache only"):  # vLLM wraps the plugin's error in its own
        native_llm(path, kv_policy="snapkv")
    llm = native_llm(path, kv_policy="full")
    try:
        refused = VllmSamplingParams(max_tokens=2, extra_args={"kv_policy": "snapkv"})
        with pytest.raises(VLLMValidationError, match="full cache only"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], refused, use_tqdm=False)
    finally:
        del llm
        gc.collect()


def test_a_bad_runner_name_is_refused(tmp_path: Path) -> None:
    path, _ = write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="kv_runner must be one of"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, additional_config={"kv_runner": "mine"})


def test_a_mixture_of_experts_model_is_refused_at_start(tmp_path: Path) -> None:
    """vLLM's fused-MoE layer has no kernel on this platform (measured: its forward fails); refused up front."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        native_llm(tmp_path / "moe")
