"""GGUF metadata (`llama.*`, `qwen2.*`, `qwen3.*`, `gemma3.*`, `tokenizer.ggml.*`) -> `ModelConfig`.

The metadata is first rewritten as the `config.json` dict transformers would save for the same
model and then parsed by `ModelConfig.from_dict`, so a GGUF file and an HF directory go through the
same validation and family defaults (Qwen2's q/k/v bias, Qwen3's q/k norm, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import ModelConfig
from .errors import ModelConfigError, UnsupportedModelError

#: GGUF `general.architecture` -> the HF architecture this package runs it as.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# `general.file_type` (llama.cpp's LLAMA_FTYPE) of files whose weights are all floats of one width;
# "auto" loads those in that dtype. Quantised files dequantise to float32.
FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def gguf_architecture(metadata: Mapping[str, Any], source: str) -> tuple[str, str]:
    """(GGUF architecture prefix, HF architecture name); an unsupported one is a clear error."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return str(arch), GGUF_ARCHITECTURES[str(arch)]


def hf_config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """The HF `config.json` dict equivalent to a GGUF file's metadata.

    `tensor_names` settles what the metadata does not say: a file without `output.weight` ties the
    LM head to the embedding, and a Llama file with `blk.0.attn_q.bias` has attention biases.
    """
    arch, hf_arch = gguf_architecture(metadata, source)

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelConfigError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    rotary_dims = get("rope.dimension_count")
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        raise ModelConfigError(
            f"{source}: {arch}.rope.dimension_count={rotary_dims} rotates part of a {head_dim}-dim head; "
            "only full rotary embeddings are supported"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ModelConfigError(
            f"{source}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style scaling) are not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelConfigError(f"{source}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or tokens)")

    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10_000.0)),
        "rope_scaling": _rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor"), source),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_tokens(metadata),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": FLOAT_FILE_TYPES.get(int(metadata.get("general.file_type", -1)), "float32"),
    }
    if arch == "gemma3":
        # llama.cpp writes neither the layer pattern nor the sliding layers' RoPE base nor the attention
        # scalar: its Gemma 3 code fixes them (every sixth layer global, base 10000, 1/sqrt(head_dim)).
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(need("attention.sliding_window")),
            sliding_window_pattern=6,
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=head_dim,
        )
        del config["hidden_act"]
    return config


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config_from_gguf(metadata, tensor_names, source), source=source)


def _rope_scaling(kind: Any, factor: Any, source: str) -> dict[str, Any] | None:
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelConfigError(f"{source}: GGUF RoPE scaling type {kind!r} is not supported (only linear)")


def _stop_tokens(metadata: Mapping[str, Any]) -> list[int]:
    """End-of-sequence plus end-of-turn tokens: chat models stop on either."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids
