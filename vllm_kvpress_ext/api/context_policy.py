"""Which policy compresses a chat's context on its own, so that every later question about it attaches.

A chat that names no context (no `kv_prefix_messages`, no `kv_prefix_tokens`) has one by default: every
message before the last user message (a system prompt, a document, earlier turns). Its policy compresses
that context alone, before the question is read, and the prefix store keeps it under the policy and its
tokens; a later question about the same context attaches to it and prefills only itself.

A context compressed before any question exists must keep what every later question needs. Policies that
choose from the prompt alone do (`KVPolicy.question_agnostic`: KVzip, Expected Attention, StreamingLLM), and
a request under one of them compresses its context with it. Policies that choose by the attention of the
prompt's last tokens (SnapKV, AdaKV, ...) do not: compressed before the question, their window is the
context's own last sentences, and reused they answered 1.0% of the questions they answer 64.6% of per
request (docs/prefix_reuse.md). A request under one of them compresses its context with the server's
`--context-policy` instead (default KVzip), at the request policy's budget, and `usage.kv_policy` names
the policy that ran. `--context-policy request` keeps each request's own policy for its context, and
`--context-policy none` splits no chat by default.

A request without a compressing policy (`full`) is not split: its cache is exact and reused as such. A
request whose policy gates writes during its prefill (WG-KV) is not split either: its cache is not stored.
"""

from __future__ import annotations

from typing import Any

from vllm_kvpress_ext.api.policy_spec import parse_operator_policy
from vllm_kvpress_ext.policies import KVPolicy, load_policy
from vllm_kvpress_ext.policies.base import AdmissionPolicy, PolicyConfigError

#: `--context-policy` values that name no policy: each request's own policy, or no default split.
OWN_POLICY, NO_SPLIT = "request", "none"
BUDGET_FIELDS = ("ratio", "tokens")


def parse_context_policy(text: str) -> str | dict[str, Any]:
    """`--context-policy`: `request`, `none`, or a policy (name, JSON object or preset) that compresses a context
    well without its question. Raises `PolicyConfigError` otherwise."""
    if text.strip() in (OWN_POLICY, NO_SPLIT):
        return text.strip()
    spec = parse_operator_policy(text, flag="--context-policy")
    policy = load_policy(spec)
    if policy is None or not policy.compresses:
        raise PolicyConfigError("--context-policy must compress: give a policy, `request` or `none`")
    if isinstance(policy, AdmissionPolicy):
        raise PolicyConfigError(f"--context-policy {policy.name}: a write-gated cache is not kept for reuse")
    return spec


def context_spec(configured: str | dict[str, Any], requested: KVPolicy | None) -> str | dict[str, Any] | None:
    """What compresses a chat's default context for a request under `requested` (its own policy, or the server's
    default): `OWN_POLICY` (the request's own), the spec of the server's context policy at the request's budget,
    or None when the chat is not split (no compressing policy, a write gate, `none`)."""
    if (
        configured == NO_SPLIT
        or requested is None
        or not requested.compresses
        or isinstance(requested, AdmissionPolicy)
    ):
        return None
    if configured == OWN_POLICY or requested.question_agnostic:
        return OWN_POLICY
    spec: dict[str, Any] = {"name": configured} if isinstance(configured, str) else dict(configured)
    if not any(spec.get(field) is not None for field in BUDGET_FIELDS):  # the request's budget, where it has one
        spec.update({field: getattr(requested, field) for field in BUDGET_FIELDS if hasattr(requested, field)})
    try:
        load_policy(spec)
    except (PolicyConfigError, TypeError, ValueError):  # a budget the context policy does not take
        return {k: v for k, v in spec.items() if k not in BUDGET_FIELDS}
    return spec


def context_policy(configured: str | dict[str, Any], requested: KVPolicy | None) -> KVPolicy | None:
    """The policy `context_spec` chooses, as an instance (None: the chat is not split)."""
    spec = context_spec(configured, requested)
    if spec is None:
        return None
    return requested if spec == OWN_POLICY else load_policy(spec)
