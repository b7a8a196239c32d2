"""Test helpers for GGUF: write small GGUF files the way llama.cpp's converter does, and decode K-quants.

`write_gguf` turns a tiny HF model into a `.gguf` file with a byte-level BPE tokenizer and a chat
template in its metadata, quantising each tensor kind to the GGML type asked for and permuting a
Llama's q/k rows as the converter does. `dequantize_q4_k` / `dequantize_q6_k` are independent
scalar-layout decoders (written from ggml's block layout) that the reader's output is checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from model_utils import randomised
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_ARCH = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokens() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIAL_TOKENS + byte_level_alphabet() + merged


def tiny_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A 2-layer GQA model over `tokens()` with every parameter random (norms and biases too)."""
    config_cls, model_cls = _ARCH[arch]
    config = config_cls(
        vocab_size=len(tokens()),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        tie_word_embeddings=arch == "qwen2",
        bos_token_id=1,
        eos_token_id=2,
    )
    return randomised(model_cls(config), seed)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama q/k projection: interleave each head's two halves."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
#: A mix of the types a real file uses: every quantisable matrix kind gets a different type.
MIXED_TYPES: dict[str, Q] = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
    "output": Q.F16,
}


def gguf_tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, float32, q/k permuted for Llama."""
    config = model.config
    out = {}
    for name, value in model.state_dict().items():
        array = value.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = array
        elif name == "model.norm.weight":
            out["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = array
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                array = llama_cpp_permute(array, config.num_attention_heads)
            if arch == "llama" and rest.startswith("self_attn.k_proj"):
                array = llama_cpp_permute(array, config.num_key_value_heads)
            out[gguf_name] = array
    return out


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str = "llama",
    types: dict[str, Q] | None = None,
    *,
    with_tokenizer: bool = True,
    metadata_overrides: dict[str, Any] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> Path:
    """Write `model` as a GGUF file; `types` maps a tensor kind ("attn_q", "token_embd", ...) to its type.

    Kinds not in `types`, and every 1-D tensor (norms, biases), stay F32, as in llama.cpp's files.
    """
    types = types or {}
    config = model.config
    writer = _writer_with_shape(path, arch, config)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if types else gguf.LlamaFileType.ALL_F32)
    if with_tokenizer:
        vocab = tokens()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(vocab)
        writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in vocab])
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata_overrides or {}).items():  # replaces a key already written, or adds one
        kind = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}.get(type(value))
        writer.kv_data[0][key] = gguf.GGUFValue(value, kind or gguf.GGUFValueType.STRING)
    for name, array in gguf_tensors(model, arch).items():
        kind = name.split(".")[-2]
        qtype = types.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        _add(writer, name, array, qtype)
    for name, (raw, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gemma3_gguf(path: Path, model: PreTrainedModel) -> Path:
    """Write a Gemma 3 text model as llama.cpp's converter does: gguf-py's tensor names, every RMSNorm weight
    stored plus one (GGUF's Gemma norms multiply by the weight itself), all F32, and no tokenizer."""
    config = model.config
    writer = _writer_with_shape(path, "gemma3", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        array = value.detach().float().numpy().copy()
        if name.endswith("norm.weight"):
            array = array + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _writer_with_shape(path: Path, arch: str, config: Any) -> gguf.GGUFWriter:
    """A GGUF writer for `arch` with the sizes every architecture's metadata carries."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


def _add(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


# ---------------------------------------------------------------- K-quant blocks and reference decoders


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K blocks [rows, cols/256 * 144] with random 6-bit scales/mins and 4-bit quants."""
    n = rows * cols // 256
    d = _f16_bytes(rng.uniform(0.001, 0.01, n))
    dmin = _f16_bytes(rng.uniform(0.001, 0.01, n))
    scales = rng.integers(0, 256, (n, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qs], axis=1).reshape(rows, -1)


def random_q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q6_K blocks [rows, cols/256 * 210]: 4-bit low and 2-bit high quants, int8 scales, fp16 d."""
    n = rows * cols // 256
    ql = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    scales = rng.integers(-64, 64, (n, 16), dtype=np.int8).view(np.uint8)
    d = _f16_bytes(rng.uniform(0.0005, 0.002, n))
    return np.concatenate([ql, qh, scales, d], axis=1).reshape(rows, -1)


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """One value at a time, following ggml's Q4_K layout: 8 sub-blocks of 32 with 6-bit scale and min."""
    blocks = raw.reshape(-1, 144)
    out = np.empty((len(blocks), 256), dtype=np.float32)
    for b, block in enumerate(blocks):
        d, dmin = block[0:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
        sc_bytes, qs = block[4:16].astype(np.int64), block[16:144]
        for sub in range(8):
            if sub < 4:
                scale, minimum = sc_bytes[sub] & 63, sc_bytes[sub + 4] & 63
            else:
                scale = (sc_bytes[sub + 4] & 0xF) | ((sc_bytes[sub - 4] >> 6) << 4)
                minimum = (sc_bytes[sub + 4] >> 4) | ((sc_bytes[sub] >> 6) << 4)
            chunk = qs[32 * (sub // 2) : 32 * (sub // 2) + 32]
            quants = chunk & 0xF if sub % 2 == 0 else chunk >> 4
            for i in range(32):
                out[b, 32 * sub + i] = float(d) * scale * int(quants[i]) - float(dmin) * minimum
    return out.reshape(raw.shape[0], -1)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """One value at a time, following ggml's Q6_K layout: two halves of 128, 16 int8 scales per block."""
    blocks = raw.reshape(-1, 210)
    out = np.empty((len(blocks), 256), dtype=np.float32)
    for b, block in enumerate(blocks):
        ql, qh = block[0:128].astype(np.int64), block[128:192].astype(np.int64)
        scales = block[192:208].view(np.int8).astype(np.int64)
        d = float(block[208:210].view(np.float16)[0])
        for half in range(2):
            low, high, sc = ql[64 * half :], qh[32 * half :], scales[8 * half :]
            for i in range(32):
                quarter = i // 16
                values = (
                    (low[i] & 0xF) | ((high[i] & 3) << 4),
                    (low[i + 32] & 0xF) | (((high[i] >> 2) & 3) << 4),
                    (low[i] >> 4) | (((high[i] >> 4) & 3) << 4),
                    (low[i + 32] >> 4) | (((high[i] >> 6) & 3) << 4),
                )
                for k, q in enumerate(values):
                    out[b, 128 * half + 32 * k + i] = d * sc[quarter + 2 * k] * (q - 32)
    return out.reshape(raw.shape[0], -1)
