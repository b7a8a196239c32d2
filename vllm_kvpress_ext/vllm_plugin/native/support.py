"""Which policies run on vLLM's own model runner today, and why the others do not yet.

On vLLM's runner the attention backend sees each layer's queries, keys and values after RoPE, and
nothing else of the forward pass. A policy runs there when what it asks the pass to capture is within
that: the observation window's queries and their log-sum-exps (SnapKV, PyramidKV, AdaKV, LAVa, XKV,
K-VEC, H2O, StreamingLLM), and for decode-time policies each step's attention (H2O). Where the project
knows the model's RoPE (a Llama-family config it parses itself: `native_rope`), the queries are turned
back to before RoPE, which is what Expected Attention reads. The others need what only the project's own
model code gives today, and are refused by name until the backend captures it: the hidden states'
statistics and the model's projections (GVote), a second pass over the prompt (KVzip), the keys before
RoPE and admission during prefill for learned write gates (WG-KV), and Expected Attention on a model
whose RoPE the project does not know.
"""

from __future__ import annotations

from pathlib import Path

from vllm_kvpress_ext.models.rope import RotaryEmbedding
from vllm_kvpress_ext.policies import KVPolicy


def native_rope(model_dir: str | Path) -> RotaryEmbedding | None:
    """The model's RoPE as the project computes it, where the project parses the model's config (the Llama
    family it implements, whose full-width RoPE is the one vLLM's implementations of it apply); else None."""
    from vllm_kvpress_ext.models.loader import load_config

    try:
        config = load_config(model_dir)
    except Exception:  # not a directory the project reads, or an architecture it does not implement
        return None
    return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


def native_refusal(policy: KVPolicy | None, rope_known: bool = False) -> str | None:
    """Why `policy` cannot run on vLLM's runner yet (None: it runs). `rope_known`: the project knows the
    model's RoPE (`native_rope`), so queries captured after it can be turned back to before it."""
    if policy is None:
        return None
    spec = policy.capture_spec()
    missing = [
        what
        for what, needed in (
            ("the hidden states' statistics", spec.hidden_stats),
            ("the keys before RoPE", spec.keys_pre_rope),
            ("the queries before RoPE", (spec.query_moments or spec.leading_queries > 0) and not rope_known),
            ("a reconstruction pass over the prompt", spec.reconstruction is not None),
            ("write-time admission gates", type(policy).admission is not KVPolicy.admission),
        )
        if needed
    ]
    if not missing:
        return None
    return (
        f"kv_policy {policy.name!r} needs {' and '.join(missing)}, which vLLM's runner (kv_runner 'vllm') does not "
        "capture yet; the plugin's own runner (kv_runner 'project') serves it"
    )
