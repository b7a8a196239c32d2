"""Llama-family model code (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch, loading HF directories or GGUF.

The model runs a flat varlen batch of new tokens and owns no KV cache: each layer hands its q/k/v
to an `AttentionContext` supplied by the caller, which stores them (paged, per head, compressible)
and computes attention. That is what lets compression policies see and drop KV entries without the
model knowing.

    model = load_model("/path/to/Llama-3.2-1B", dtype=torch.bfloat16, device="cuda")
    hidden = model(input_ids, positions, ctx)        # [T, D]
    logits = model.compute_logits(hidden[last_rows])  # fp32 [n, vocab]

Files: `config.py` (config.json -> ModelConfig), `rope.py` (rotary embeddings incl. llama3/linear
scaling), `layers.py` (RMSNorm, MLP, Attention, DecoderLayer), `llama.py` (the model),
`loader.py` (safetensors, single or sharded, or a `.gguf` file), `gguf_file.py` (GGUF reading and
dequantisation), `gguf_config.py` (GGUF metadata -> ModelConfig), `gguf_weights.py` (GGUF tensor names,
llama.cpp's Q/K row order), `tokenizer.py` (HF or GGUF tokenizer), `base.py` (AttentionContext), `errors.py`.
"""

from .base import AttentionContext
from .config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig, RopeScaling
from .errors import ModelConfigError, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from .gguf_file import GGUFFile, is_gguf_path
from .layers import MLP, Attention, DecoderLayer, RMSNorm
from .llama import LlamaFamilyForCausalLM
from .loader import find_tensor_files, load_config, load_model, resolve_dtype
from .rope import RotaryEmbedding, apply_rope, inverse_frequencies, rotate_half
from .tokenizer import load_tokenizer

__all__ = [
    "MLP",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "Attention",
    "AttentionContext",
    "DecoderLayer",
    "GGUFFile",
    "LlamaFamilyForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "UnsupportedModelError",
    "apply_rope",
    "find_tensor_files",
    "inverse_frequencies",
    "is_gguf_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "rotate_half",
]
