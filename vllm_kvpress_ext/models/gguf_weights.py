"""GGUF tensors -> this package's parameters: names, llama.cpp's Q/K row order, dtype.

llama.cpp's converter stores a Llama model's q_proj and k_proj rows permuted: within every head,
HF's "rotate half" layout pairs row i with row i + d/2, while ggml's Llama RoPE pairs rows 2i and
2i + 1, so the converter interleaves the two halves. `unpermute_rows` undoes that; without it
the model still loads and runs, but attention scores are wrong and the text is noise. Qwen2/Qwen3
files are converted without the permutation (ggml runs them with the NEOX, i.e. rotate-half, RoPE).
"""

from __future__ import annotations

import re

import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_file import GGUFFile

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors some converters add that carry nothing this model reads (RoPE tables are recomputed).
_IGNORED = ("rope_freqs.weight",)


def parameter_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """Our parameter name for a GGUF tensor name, or None for a tensor we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_BLOCK_NAMES if architecture == "Gemma3ForCausalLM" else _BLOCK_NAMES
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"layers.{layer}.{names[part]}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (weights [rows, cols] or biases [rows]).

    The converter viewed each head's rows as (2, d/2) and transposed them to (d/2, 2); viewing them
    as (d/2, 2) and transposing back restores HF's order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ModelLoadError(f"cannot un-permute {rows} rows over {num_heads} heads (need a multiple of 2 x heads)")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_state_dict(
    gguf: GGUFFile,
    config: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Every parameter of the model, dequantised, un-permuted and cast, after checking names and shapes."""
    mapping: dict[str, str] = {}
    unknown = []
    for name in gguf.tensor_names():
        param = parameter_name(name, config.architecture)
        if param is None:
            if name not in _IGNORED:
                unknown.append(name)
        elif not (config.tie_word_embeddings and param == "lm_head.weight"):
            mapping[param] = name
    missing = sorted(p for p in expected if p not in mapping)
    extra = sorted(mapping[p] for p in mapping if p not in expected) + sorted(unknown)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors for {_short(missing)}")
        if extra:
            parts.append(f"tensors this model does not use: {_short(extra)}")
        raise ModelLoadError(f"{gguf.path} does not match its own metadata: " + "; ".join(parts))
    bad = [
        f"{mapping[p]} has shape {list(gguf.tensor_shape(mapping[p]))}, expected {list(shape)}"
        for p, shape in expected.items()
        if gguf.tensor_shape(mapping[p]) != shape
    ]
    if bad:
        raise ModelLoadError(f"{gguf.path}: {len(bad)} tensor shape(s) disagree with the metadata: {_short(bad)}")

    permuted_heads = {}
    if config.architecture == "LlamaForCausalLM":
        permuted_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    state = {}
    for param, name in mapping.items():
        value = torch.from_numpy(gguf.tensor(name))
        projection = param.split(".")[-2]
        if projection in permuted_heads:
            value = unpermute_rows(value, permuted_heads[projection])
        if config.norm_offset and param.endswith("norm.weight"):
            value = value - 1.0
        state[param] = value.to(device=device, dtype=dtype)
    return state


def _short(items: list[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" ... and {len(items) - shown} more" if len(items) > shown else "")
