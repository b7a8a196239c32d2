"""Which policies run on vLLM's own model runner today, and why the others do not yet.

On vLLM's runner the attention backend sees each layer's queries, keys and values after RoPE, and
nothing else of the forward pass. A policy runs there when what it asks the pass to capture is within
that: the observation window's queries and their log-sum-exps (SnapKV, PyramidKV, AdaKV, LAVa, XKV,
K-VEC, H2O, StreamingLLM), and for decode-time policies each step's attention (H2O). The others need
what only the project's own model code gives today, and are refused by name until the backend captures
it: the hidden states' statistics and the model's projections (GVote), the queries before RoPE
(Expected Attention), a second pass over the prompt (KVzip), the keys before RoPE for learned write
gates (WG-KV).
"""

from __future__ import annotations

from vllm_kvpress_ext.policies import KVPolicy


def native_refusal(policy: KVPolicy | None) -> str | None:
    """Why `policy` cannot run on vLLM's runner yet (None: it runs)."""
    if policy is None:
        return None
    spec = policy.capture_spec()
    missing = [
        what
        for what, needed in (
            ("the hidden states' statistics", spec.hidden_stats),
            ("the keys before RoPE", spec.keys_pre_rope),
            ("the queries before RoPE", spec.query_moments or spec.leading_queries > 0),
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
