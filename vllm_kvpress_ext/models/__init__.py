"""Llama-family model code (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch, loading HF directories.

The model runs a flat varlen batch of new tokens and owns no KV cache: each layer hands its q/k/v
to an `AttentionContext` supplied by the caller, which stores them (paged, per head, compressible)
and computes attention. That is what lets compression policies see and drop KV entries without the
model knowing.

    model = load_model("/path/to/Llama-3.2-1B", dtype=torch.bfloat16, device="cuda")
    hidden = model(input_ids, positions, ctx)        # [T, D]
    logits = model.compute_logits(hidden[last_rows])  # fp32 [n, vocab]

Files: `config.py` (config.json -> ModelConfig), `rope.py` (rotary embeddings incl. llama3/linear
scaling), `layers.py` (RMSNorm, MLP, Attention, DecoderLayer), `llama.py` (the model),
`loader.py` (safetensors, single or sharded), `base.py` (AttentionContext), `errors.py`.
"""

from .base import AttentionContext
from .config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig, RopeScaling
from .errors import ModelConfigError, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from .layers import MLP, Attention, DecoderLayer, RMSNorm
from .llama import LlamaFamilyForCausalLM
from .loader import find_tensor_files, load_config, load_model, resolve_dtype
from .rope import RotaryEmbedding, apply_rope, inverse_frequencies, rotate_half

__all__ = [
    "MLP",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "Attention",
    "AttentionContext",
    "DecoderLayer",
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
    "load_config",
    "load_model",
    "resolve_dtype",
    "rotate_half",
]
