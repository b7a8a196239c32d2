"""Per-request policies and the features the plugin refuses, checked in vLLM's API process.

`Platform.validate_request` runs before a request reaches the engine; anything raised there as
`VLLMValidationError` becomes an OpenAI-shaped HTTP 400 and the server keeps serving. The policy is
parsed by the embedded server's own `policy_spec` / `resolve_policy`, so both servers accept the
same fields and give the same messages.
"""

from __future__ import annotations

from typing import Any

from vllm_kvpress_ext.api.errors import APIError
from vllm_kvpress_ext.api.policy_spec import policy_fields, policy_spec, resolve_policy
from vllm_kvpress_ext.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm_kvpress_ext.policies import KVPolicy, load_policy


# vLLM itself puts `kv_transfer_params` into extra_args (disaggregated prefill); `kv_prefix_tokens` names a
# context (`contexts.py`). Neither is a policy field.
class RequestPolicyError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def request_policy(extra_args: dict[str, Any] | None, default: KVPolicy | None) -> KVPolicy | None:
    """The policy a request runs under: its own (validated), else the server's default; None = full cache."""
    fields = policy_fields(extra_args)
    try:
        spec = policy_spec(None, fields) if fields else None
        policy = resolve_policy(spec) if spec is not None else default
    except APIError as exc:
        raise RequestPolicyError(str(exc), exc.param) from None
    return policy if policy is not None and policy.compresses else None


def default_policy(additional_config: dict[str, Any] | None) -> KVPolicy | None:
    spec = (additional_config or {}).get("kv_policy")
    policy = load_policy(spec) if spec is not None else None
    return policy if policy is not None and policy.compresses else None


def unsupported_sampling(params: Any) -> tuple[str, str] | None:
    """(parameter, reason) for the first sampling feature the plugin's worker does not implement, or for a
    value outside the bounds its sampler (the embedded server's) accepts."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            return name, f"{name} must be in [0, {MAX_LOGPROBS}] with the vllm-kvpress-ext worker, got {value}"
    try:  # the bounds the runner's sampler enforces (penalties up to MAX_PENALTY, min_p in [0, 1], ...)
        SamplingParams(
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
    except ValueError as exc:
        return str(exc).split(" ", 1)[0], f"{exc} with the vllm-kvpress-ext worker"
    checks: list[tuple[str, bool]] = [
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(params.bad_words)),
        ("structured_outputs", params.structured_outputs is not None),
        ("logprob_token_ids", bool(getattr(params, "logprob_token_ids", None))),
    ]
    for name, used in checks:
        if used:
            return name, f"{name} is not supported by the vllm-kvpress-ext worker yet"
    return None
