"""Write a Llama model as an ordinary HF directory (config.json + model.safetensors).

Used for the project's own models (random test and benchmark models, trained checkpoints); the
output loads in this engine and in plain transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_kvpress_ext.models.config import ModelConfig
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.models.loader import _checkpoint_name


def llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10_000.0,
    tie_word_embeddings: bool = True,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """An HF `config.json` dict for a `LlamaForCausalLM`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def random_model(hf_config: dict[str, Any], seed: int = 0, std: float = 0.02) -> LlamaFamilyForCausalLM:
    """A model with normal(0, std) weights and unit norms."""
    torch.manual_seed(seed)
    model = LlamaFamilyForCausalLM(ModelConfig.from_dict(hf_config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
    return model


def save_model(model: LlamaFamilyForCausalLM, hf_config: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (HF tensor names) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {_checkpoint_name(name): t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out
