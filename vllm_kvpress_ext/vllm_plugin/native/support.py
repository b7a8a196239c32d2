"""Which policies run on vLLM's own model runner, and why the others do not there.

On vLLM's runner the attention backend sees each layer's queries, keys and values after RoPE. A policy
runs there when what it asks the pass to capture is within that: the observation window's queries and
their log-sum-exps (SnapKV, PyramidKV, AdaKV, LAVa, XKV, K-VEC, H2O, StreamingLLM), and for decode-time
policies each step's attention (H2O). Where the project parses the model's config (the Llama family and
Gemma 3) it knows the model's RoPE (`native_rope`) and finds each layer's fused QKV projection in vLLM's
model (`layer_projections`), and the runner hooks it:

- the captured queries are turned back to before RoPE, which is what Expected Attention reads;
- the projection's input is the normed hidden states GVote keeps statistics of, and its weights' query
  rows give GVote's synthetic queries;
- its output holds each key before RoPE, which WG-KV's write gates read.

KVzip's pass runs vLLM's model with the embedded engine's reconstruction attention
(`NativePool._score_by_reconstruction`), on any model, under each layer's logit soft cap where it has one, and
over pipeline stages one after another (`KVPressModelRunner._reconstruction_forward`).

Outside those, for architectures whose vLLM implementation applies the same full-width RoPE as their config
describes (`ROPE_ARCHITECTURES`: Phi-3, OLMo-2, Gemma 2, Mixtral, Qwen3-MoE), the project reads that RoPE from
the config, and where vLLM fuses the model's projections into one `qkv_proj` (all of them: Phi-3 on vLLM's Llama
implementation, OLMo-2 on its Transformers backend, whose query and key norms span all heads) hooks the projection
too. On any other model Expected Attention, GVote and WG-KV are refused by name (`native_refusal`).

Under a logit soft cap (Gemma 2) the backend's attention applies the cap everywhere, WG-KV's rings and
vertical-slash prefill included, and so does KVzip's scoring. Expected Attention's expected logits and GVote's
sampled queries' attention are taken without it: both estimate where future queries will attend, and the cap,
which is monotone in each logit, changes how sharp that attention is, not its order within a query.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.models.rope import RotaryEmbedding
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import AdmissionPolicy

QueryProjection = Callable[[torch.Tensor], torch.Tensor]
KeySplit = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerProjections:
    """One layer's fused QKV projection in vLLM's model, and what the plugin reads through it."""

    module: torch.nn.Module
    queries: QueryProjection  # normed hidden states `[S, D]` -> queries before RoPE `[S, Hq, d]`
    keys: KeySplit  # the module's output `[S, (Hq + 2 Hkv) d]` -> keys before RoPE `[S, Hkv, d]`


#: Mixture-of-experts architectures vLLM's runner runs on the plugin's CPU platform (`native/moe.py`): top-k
#: softmax routing over SiLU experts, no shared expert.
SUPPORTED_MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def layer_projections(model: torch.nn.Module, layers: list[int]) -> list[LayerProjections] | None:
    """Per layer of the model's `layers` (its own indices: all of them, or a pipeline stage's), vLLM's fused QKV
    projection, the query projection it holds (with the layer's query norm where it has one, as Qwen3) and the
    split of its output into the keys before RoPE (with the key norm); None where the model is not laid out as
    vLLM's Llama-family implementations are."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)\.self_attn$", name)
        if match is not None and _llama_layout(module):
            found[int(match.group(1))] = module
    if sorted(found) != layers:
        return None
    return [
        LayerProjections(found[layer].qkv_proj, _query_projection(found[layer]), _key_split(found[layer]))
        for layer in layers
    ]


def _head_counts(attention: Any) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head size) of a fused `qkv_proj`: the attention module's own (vLLM's Llama family)
    or its projection's (vLLM's Transformers backend, whose modules are HF's with `qkv_proj` fused in)."""
    qkv = getattr(attention, "qkv_proj", None)
    for source in (attention, qkv):
        if source is not None and all(hasattr(source, n) for n in ("num_heads", "num_kv_heads")):
            head_dim = getattr(attention, "head_dim", None) or getattr(qkv, "head_size", None)
            if head_dim is not None:
                return int(source.num_heads), int(source.num_kv_heads), int(head_dim)
    return None


def _llama_layout(attention: Any) -> bool:
    """A fused `qkv_proj` holding queries, keys and values in that order, the head counts and size it splits them
    by, and query/key norms (if any) either per head (vLLM's Llama family, Qwen3) or over all of the layer's
    query or key heads at once (OLMo-2, on vLLM's Transformers backend)."""
    counts = _head_counts(attention)
    if counts is None:
        return False
    heads, kv_heads, head_dim = counts
    widths = {"q_norm": (head_dim, heads * head_dim), "k_norm": (head_dim, kv_heads * head_dim)}
    return all(
        getattr(attention, name, None) is None or getattr(attention, name).weight.numel() in allowed
        for name, allowed in widths.items()
    )


def _normed(norm: Any, x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """`x [T, heads * head_dim]` through a query or key norm (per head, or over all heads at once), as `[T, heads,
    head_dim]`."""
    if norm is not None and norm.weight.numel() == head_dim:
        return norm.forward_native(x.reshape(-1, head_dim)).view(-1, heads, head_dim)
    if norm is not None:
        x = norm.forward_native(x)
    return x.reshape(-1, heads, head_dim)


def _query_projection(attention: Any) -> QueryProjection:
    from vllm_kvpress_ext.vllm_plugin.native.adapter import projection

    qkv = attention.qkv_proj
    counts = _head_counts(attention)
    assert counts is not None
    heads, _, head_dim = counts
    rows = heads * head_dim
    norm = getattr(attention, "q_norm", None)

    def project(hidden: torch.Tensor) -> torch.Tensor:
        # The whole fused product, then its query columns: the weight may be packed (`adapter.pack_projections`),
        # whose rows cannot be sliced; the keys and values computed besides cost less than a second weight copy.
        h = hidden.to(device=qkv.weight.device, dtype=qkv.weight.dtype)
        fused = projection(qkv, h, qkv.weight, getattr(qkv, "bias", None))
        return _normed(norm, fused[:, :rows], heads, head_dim)

    return project


def _key_split(attention: Any) -> KeySplit:
    counts = _head_counts(attention)
    assert counts is not None
    heads, kv_heads, head_dim = counts
    begin, end = heads * head_dim, (heads + kv_heads) * head_dim
    norm = getattr(attention, "k_norm", None)

    def split(qkv: torch.Tensor) -> torch.Tensor:
        return _normed(norm, qkv[:, begin:end], kv_heads, head_dim)

    return split


# Architectures the project's own model code does not implement, whose vLLM implementation rotates queries and keys
# with the full-width "rotate_half" RoPE their config describes (as the Llama family's), each with whether vLLM lays
# it out as its Llama family (a fused `qkv_proj`, a query norm per head or none), whose projection the runner hooks.
# Phi-3 runs on vLLM's Llama implementation; OLMo-2 on vLLM's Transformers backend, HF's own modules with the
# projections fused into a `qkv_proj` (its query and key norms span all heads); Gemma 2, Mixtral and Qwen3-MoE
# (a key norm per head, as Qwen3) on vLLM's own implementations of them, laid out as its Llama.
ROPE_ARCHITECTURES: dict[str, bool] = {
    "Phi3ForCausalLM": True,
    "Olmo2ForCausalLM": True,
    "Gemma2ForCausalLM": True,
    "MixtralForCausalLM": True,
    "Qwen3MoeForCausalLM": True,
}


@dataclass(frozen=True)
class ModelFacts:
    """What vLLM's runner captures for a model, as its config tells it: the same answer in the API process, which
    refuses requests before any model is built, as in the worker."""

    rope: bool = False  # the project knows the model's RoPE (`native_rope`)
    projections: bool = False  # the runner hooks its QKV projections (`layer_projections`), and knows its RoPE
    tensor_parallel: int = 1  # workers that split each layer's heads (`--tensor-parallel-size`)


def with_parallelism(facts: ModelFacts, vllm_config: Any) -> ModelFacts:
    """`facts` with the tensor parallelism `vllm_config` serves the model with (pipeline stages refuse nothing)."""
    return dataclasses.replace(facts, tensor_parallel=int(vllm_config.parallel_config.tensor_parallel_size))


@functools.cache
def model_facts(model_dir: str) -> ModelFacts:
    """`ModelFacts` of the model directory vLLM serves, asked once per model and process."""
    from vllm_kvpress_ext.models.loader import load_config

    rope = native_rope(model_dir) is not None
    try:
        load_config(model_dir)
        parsed = True
    except Exception:
        parsed = False
    laid_out = parsed or ROPE_ARCHITECTURES.get(_architecture(model_dir) or "", False)
    return ModelFacts(rope=rope, projections=rope and laid_out)


def native_rope(model_dir: str | Path) -> RotaryEmbedding | None:
    """The model's RoPE as the project computes it, where the project parses the model's config (the Llama
    family and Gemma 3, whose full-width RoPE is the one vLLM's implementations of them apply in the layers a
    policy compresses) or reads its RoPE (`ROPE_ARCHITECTURES`); else None."""
    from vllm_kvpress_ext.models.config import rope_of_hf_config
    from vllm_kvpress_ext.models.loader import load_config

    try:
        config = load_config(model_dir)
    except Exception:  # not a directory the project reads, or an architecture it does not implement
        if _architecture(model_dir) not in ROPE_ARCHITECTURES:
            return None
        try:
            raw = json.loads((Path(model_dir) / "config.json").read_text())
            head_dim, theta, scaling = rope_of_hf_config(raw, str(model_dir))
        except Exception:  # a RoPE of another kind (partial, long-context variants): not the one computed here
            return None
        return RotaryEmbedding(head_dim, theta, scaling)
    # Gemma 3's sliding layers rotate with a base of their own (`local_rope_theta`), but they are rings no policy
    # sees (`engine/compression.py`): the policies' RoPE is the global layers'.
    return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


def _architecture(model_dir: str | Path) -> str | None:
    try:
        architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None]
    except (OSError, ValueError, AttributeError):
        return None
    return str(architectures[0]) if architectures[0] else None


def native_refusal(policy: KVPolicy | None, facts: ModelFacts) -> str | None:
    """Why `policy` cannot run on vLLM's runner for a model of these `facts` (None: it runs). With its RoPE
    known, queries captured after RoPE are turned back to before it; with its projections hooked, the runner
    records each layer's attention input and the keys before RoPE, and knows the query projection."""
    if policy is None:
        return None
    # WG-KV's gates run per KV head on each worker; its cap ranks the admitted entries across heads, after the
    # prefill and at every decode step, which no exchange serves yet.
    admits = isinstance(policy, AdmissionPolicy)
    if facts.tensor_parallel > 1 and admits and getattr(policy, "cap", None) is not None:
        return (
            f"kv_policy {policy.name!r} with a cap ranks entries across KV heads at every step, which tensor "
            "parallelism does not serve yet; serve it without a cap, or with --tensor-parallel-size 1"
        )
    spec = policy.capture_spec()
    missing = [
        what
        for what, needed in (
            ("the hidden states' statistics", spec.hidden_stats and not (facts.projections and facts.rope)),
            ("the keys before RoPE", spec.keys_pre_rope),
            ("the queries before RoPE", (spec.query_moments or spec.leading_queries > 0) and not facts.rope),
            # The pass runs vLLM's model over the repeat prompt, with the project's attention over the pool (a softmax
            # within each layer's window, of logits under the layer's soft cap where it has one): any architecture's.
            # The gates read each key before RoPE, which the runner reads off the hooked QKV projection's output.
            ("write-time admission gates", admits and not facts.projections),
        )
        if needed
    ]
    if not missing:
        return None
    return (
        f"kv_policy {policy.name!r} needs {' and '.join(missing)}, which vLLM's runner (kv_runner 'vllm') does not "
        "capture yet; the plugin's own runner (kv_runner 'project') serves it"
    )
