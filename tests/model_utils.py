"""Test helpers for `vllm_kvpress_ext.models`: tiny random HF models and a dense reference context.

`DenseContext` is the simplest correct `AttentionContext`: no cache, each sequence of the varlen
batch attends causally to itself only. It records what every layer handed it, so tests can check
the tensors the model exposes to compression policies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from vllm_kvpress_ext.engine.kept import KeptEntries
from vllm_kvpress_ext.models import ModelConfig

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

# Each family exercises a different part of the model: llama3 RoPE + GQA + untied head; Llama 2 style
# linear RoPE + MHA + tied embeddings + attention/MLP biases; Mistral; Qwen2 q/k/v bias + tied;
# Qwen3 q/k norm with head_dim (24) != hidden / heads (16); Gemma 3 with a sliding window (4) shorter than the
# prompts, its own RoPE base for that layer, linear scaling in the global one, and a softmax scale (1/sqrt(20))
# that is not 1/sqrt(head_dim).
FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False, "eos_token_id": [2, 3]},
    ),
    "llama2_linear_tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        {"tie_word_embeddings": False, "rope_parameters": {"rope_theta": 1e6}},
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24, "tie_word_embeddings": False}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 24,
            "query_pre_attn_scalar": 20,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        },
    ),
}


def tiny_hf_model(family: str, seed: int = 0) -> PreTrainedModel:
    """A tiny HF model of `family` whose every parameter (norms and biases too) is random.

    HF initialises norms to 1 and biases to 0, which would let a loader that skipped them pass;
    randomising everything makes each tensor matter.
    """
    config_cls, model_cls, extra = FAMILIES[family]
    return randomised(model_cls(config_cls(**{**TINY, **extra})), seed)


def randomised(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """`model` in eval mode with norms drawn from U(0.5, 1.5) and every other parameter from N(0, 0.15)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def hf_logits(model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """Reference logits [L, vocab] of one sequence."""
    with torch.no_grad():
        kwargs = {} if position_ids is None else {"position_ids": position_ids[None]}
        return model(input_ids=input_ids[None], **kwargs).logits[0].float()


@dataclass
class Captured:
    """What one layer passed to `attend`."""

    hidden: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    k_pre_rope: Tensor


class DenseContext:
    """Cache-less reference attention over a varlen batch split by sequence lengths.

    With `config`, its softmax scale and its layers' sliding windows (a key is seen while q - k < window).
    """

    def __init__(self, seq_lens: list[int], config: ModelConfig | None = None) -> None:
        self.cu_seqlens = [0, *itertools.accumulate(seq_lens)]
        self.captured: dict[int, Captured] = {}
        self.scale = config.attention_scale if config is not None else None
        self.windows = config.layer_windows if config is not None else None

    def attend(self, layer_idx: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor, k_pre_rope: Tensor) -> Tensor:
        self.captured[layer_idx] = Captured(hidden, q, k, v, k_pre_rope)
        assert q.shape[0] == self.cu_seqlens[-1], "batch size does not match the sequence lengths"
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(self.cu_seqlens):
            qs = q[start:end].transpose(0, 1)  # [Hq, L, d]
            ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)  # query head h -> KV head h // group
            vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
            n = end - start
            distance = torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)
            window = self.windows[layer_idx] if self.windows is not None else None
            mask = (distance >= 0) & (distance < (window or n))
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[start:end] = attended.transpose(0, 1)
        return out


def write_suite_model(
    path: Path,
    *,
    hidden: int = 32,
    seed: int = 1,
    std: float = 0.3,
    max_positions: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> Path:
    """A random-weight GQA Llama over the synthetic suite's vocabulary, with its tokenizer, in `path`."""
    from vllm_kvpress_ext.models.writer import llama_config, random_model, save_model
    from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY, save_tokenizer

    save_tokenizer(path)
    config = llama_config(
        vocab_size=len(VOCABULARY),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_positions,
    )
    save_model(random_model(config, seed=seed, std=std), config, path)
    return path


def write_suite_gemma3(
    path: Path,
    *,
    window: int = 8,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    seed: int = 5,
) -> tuple[PreTrainedModel, Path]:
    """A random Gemma 3 (sliding layers of `window`, GQA) over the synthetic suite's vocabulary, with its tokenizer."""
    from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY, save_tokenizer

    config = Gemma3TextConfig(
        vocab_size=len(VOCABULARY),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=12,
        sliding_window=window,
        layer_types=list(layer_types),
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = randomised(Gemma3ForCausalLM(config), seed=seed)
    model.save_pretrained(path)
    save_tokenizer(path)  # KVzip's reconstruction prompt needs the model's tokenizer
    return model, path


def hf_greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Transformers' greedy continuation of one prompt, never stopping at `<eos>`."""
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]  # transformers types generate loosely
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # else pad-id tokens get masked
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@dataclass
class FinishedRequest:
    """A finished request's output and the positions each (layer, KV head) held when it finished."""

    output: Any
    held: list[list[set[int]]]


def run_recording(engine: Any, prompts: list[list[int]], params: Any, **kwargs: Any) -> list[FinishedRequest]:
    """Run `prompts` together on `engine` (extra `add_request` arguments in `kwargs`), recording held positions."""
    held: dict[str, list[list[set[int]]]] = {}

    def record(request: Any) -> None:
        positions, lengths = engine.cache.entry_positions(request.request_id)
        held[request.request_id] = [
            [set(positions[layer, head, : int(lengths[layer, head])].tolist()) for head in range(positions.shape[1])]
            for layer in range(positions.shape[0])
        ]

    engine.finish_hooks.append(record)
    try:
        ids = [engine.add_request(p, params, **kwargs) for p in prompts]
        outputs: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    finally:
        engine.finish_hooks.remove(record)
    return [FinishedRequest(outputs[i], held[i]) for i in ids]


def budget_per_head(policy: Any, n: int) -> int:
    """Prompt entries a `ratio` / `tokens` budget keeps per (layer, KV head) on average (policies/base.py)."""
    if getattr(policy, "tokens", None) is not None:
        return min(n, policy.tokens)
    return min(n, max(1, round(policy.ratio * n)))


def check_kept(finished: FinishedRequest, prompt_len: int, decoded: int, prompt_kept: int | None) -> None:
    """Every decoded token's entry is held by every head; the prompt entries held average `prompt_kept` exactly.

    `prompt_kept` None: a budget-free policy, checked only against the prompt's length.
    """
    kv = finished.output.kv
    generated = set(range(prompt_len, prompt_len + decoded))
    layers, heads = len(finished.held), len(finished.held[0])
    prompt_total = 0
    for per_layer in finished.held:
        for positions in per_layer:
            assert generated <= positions
            assert positions <= set(range(prompt_len + decoded))
            prompt_total += len(positions) - decoded
    assert kv.tokens_kept == prompt_total + layers * heads * decoded
    assert kv.tokens_full == layers * heads * (prompt_len + decoded)
    if prompt_kept is not None:
        assert prompt_total == layers * heads * prompt_kept


def write_phi3_twin(llama: Path, path: Path) -> Path:
    """The Llama checkpoint at `llama` (no biases, RoPE without scaling) as the Phi-3 checkpoint that computes the
    same function: Phi-3 is the Llama architecture with its query/key/value and gate/up projections fused, which
    is how its checkpoints store them. The tokenizer and any write gates come along."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Phi3Config

    from vllm_kvpress_ext.models.write_gate import default_gate_path

    raw = json.loads((llama / "config.json").read_text())
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("rope_scaling"):
        raise ValueError("only a Llama without biases or RoPE scaling has a Phi-3 twin")
    path.mkdir(parents=True, exist_ok=True)
    shared = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "hidden_act",
    )
    config = Phi3Config(
        **{key: raw[key] for key in shared},
        original_max_position_embeddings=raw["max_position_embeddings"],
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config.architectures = ["Phi3ForCausalLM"]
    config.to_json_file(path / "config.json")
    weights = load_file(llama / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            continue
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            parts = [weights[prefix + f"{p}_proj.weight"] for p in "qkv"]
            fused[prefix + "qkv_proj.weight"] = torch.cat(parts)
        elif name.endswith("mlp.gate_proj.weight"):
            prefix = name.removesuffix("gate_proj.weight")
            fused[prefix + "gate_up_proj.weight"] = torch.cat([tensor, weights[prefix + "up_proj.weight"]])
        else:
            fused[name] = tensor
    save_file({k: v.contiguous() for k, v in fused.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    for file in llama.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, path / file.name)
    if default_gate_path(llama).is_file():
        shutil.copy(default_gate_path(llama), default_gate_path(path))
    return path


def write_random_gates(model: Path, window: int = 16, seed: int = 7) -> Path:
    """Random WG-KV write gates for `model`, spread widely around 0.5 (about half the keys admitted at tau 0.5),
    where every engine looks by default: beside the model."""
    import json

    from vllm_kvpress_ext.models.write_gate import WriteGates, default_gate_path

    raw = json.loads((model / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    torch.manual_seed(seed)
    gates = WriteGates(raw["num_hidden_layers"], raw["num_key_value_heads"], head_dim, init_bias=0.0)
    with torch.no_grad():
        gates.w2.normal_(0.0, 3.0)
    return gates.save(default_gate_path(model), {"local_window": window})


def held_sets(kept: KeptEntries) -> list[list[set[int]]]:
    """The positions each (layer, KV head) holds, as sets: what two engines' kept entries are compared by."""
    layers, heads = kept.lengths.shape
    return [[set(kept.head(layer, head)) for head in range(heads)] for layer in range(layers)]
