"""Named contexts in the vLLM plugin: compressed once, without a question, for every prompt that starts with one.

A request names its context with `kv_prefix_tokens` = c, the body field `kvpress serve` reads (or
`vllm_xargs.kv_prefix_tokens`). Its first c prompt tokens are the context. Its policy compresses the context
alone, with no question in it, and the rest of the prompt (the question) is read from the compressed cache.
A later request with the same context, policy and model reuses that compressed context: it prefills only
its question. Compressing a context costs a prefill (KVzip: three), so document QA, RAG and agents with a
long system prompt pay it once (docs/prefix_reuse.md).

vLLM's scheduler cuts a prompt into chunks of its own choosing, never at c, so the cut is made by the plugin:

- `KVPressScheduler` holds a request whose context is not stored back from vLLM's queue, and queues a *context
  build* in its place: a request of the scheduler's own whose prompt is the c context tokens, under the same
  policy, one token long, whose output no client sees. Its prefill completes at c, so its policy compresses
  there, as the request's own would; the worker then keeps the compressed row in its store
  (`NativePool.contexts`) under the embedded engine's content key (model, policy with every parameter,
  tokens: `prefix_key`). Requests naming the same context while it builds wait for the same build.
- When the build's report lists the entry, the held requests go back to vLLM's queue. Each is told c tokens
  are computed (`get_computed_blocks`), so vLLM schedules only the question; the pool seats it on a fork of
  the stored row (pages shared, copy-on-write) with a copy of the policy state, and runs the question as one
  prefill chunk over it. Until it is seated, the worker holds the entry for it, so that nothing evicts it.
- Stored contexts nobody reads are memory nobody needs: their pages count as free to the scheduler, and the
  pool drops them, least recently used first, before any request fails or waits for pages.

A request so served produces the tokens and keeps the entries the embedded engine's run of the same request
does (its policy compresses at c, then the question runs as a chunk): tests/test_vllm_contexts.py.

The plugin's own runner needs no build: its worker stops the chunk vLLM scheduled at c, the runner compresses
there, and the question runs in the same step (`KVPressWorker._schedule`); its prefix store keeps the context.

Refused with a 400 that names the field: a boundary that is not an integer in [1, prompt tokens - 1]; a
context under a policy that gates writes during the prefill (WG-KV), or, on vLLM's runner, one that acts at
every decode step (H2O: the question would have to run as decode steps, which vLLM's runner does not
schedule); prompt log-probabilities (the context's are never computed); prefix caching turned off. A
request without a compressing policy (`full`) has nothing to compress: its boundary is ignored, as in
`kvpress serve`, and vLLM's own prefix caching serves its repeats.
"""

from __future__ import annotations

from typing import Any

from vllm_kvpress_ext.engine.prefix_store import prefix_key
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import AdmissionPolicy

CONTEXT_FIELD = "kv_prefix_tokens"
# What a context build's request id starts with (a random suffix follows).
BUILD_PREFIX = "kvpress-context-"


class ContextError(ValueError):
    """A `kv_prefix_tokens` the plugin cannot serve: an HTTP 400 naming the field."""


def named_boundary(extra_args: dict[str, Any] | None) -> int | None:
    """The request's `kv_prefix_tokens` (None: it names no context); ContextError when it is not an integer."""
    value = (extra_args or {}).get(CONTEXT_FIELD)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContextError(f"{CONTEXT_FIELD} must be an integer, got {value!r}")
    return value


def context_refusal(policy: KVPolicy | None, runner: str = "vllm") -> str | None:
    """Why a context cannot be compressed alone under `policy` on `runner` (None: it can, or there is nothing to
    compress). The plugin's own runner runs a question as decode steps where the policy acts at every one."""
    if policy is None:
        return None
    if isinstance(policy, AdmissionPolicy):
        return (
            f"{CONTEXT_FIELD} with {policy.name}: its write gate decides during the prefill, so its context is not "
            "kept for reuse; send the prompt without it"
        )
    if runner == "vllm" and (policy.wants_decode_steps or policy.wants_decode_attention):
        return (
            f"{CONTEXT_FIELD} with {policy.name}: the question after the context would run as decode steps (the "
            "policy acts at every one), which vLLM's runner does not schedule; `kvpress serve` serves it"
        )
    return None


def named_context(extra_args: dict[str, Any] | None, policy: KVPolicy | None, prompt_tokens: int) -> int | None:
    """The boundary a request's policy compresses at (`compress_after`), or None: none named, nothing to compress,
    or one the API process would have refused."""
    try:
        boundary = named_boundary(extra_args)
    except ContextError:
        return None
    if boundary is None or policy is None or not 0 < boundary < prompt_tokens or isinstance(policy, AdmissionPolicy):
        return None
    return boundary


def check_context(
    extra_args: dict[str, Any] | None,
    prompt_tokens: int,
    policy: KVPolicy | None,
    *,
    runner: str,
    enabled: bool,
    prompt_logprobs: bool,
) -> None:
    """Refuse (ContextError) a `kv_prefix_tokens` this server cannot serve; nothing when the request names none."""
    boundary = named_boundary(extra_args)
    if boundary is None:
        return
    if not 1 <= boundary < prompt_tokens:
        raise ContextError(
            f"{CONTEXT_FIELD} must be in [1, {prompt_tokens - 1}] (below the prompt's {prompt_tokens} tokens), "
            f"got {boundary}"
        )
    if policy is None:
        return
    if not enabled:
        raise ContextError(f"{CONTEXT_FIELD} needs prefix caching, which this server runs with turned off")
    if prompt_logprobs:
        raise ContextError(f"{CONTEXT_FIELD} with prompt_logprobs: the context's are never computed")
    refusal = context_refusal(policy, runner)
    if refusal is not None:
        raise ContextError(refusal)


def contexts_kept(vllm_config: Any, runner: str) -> bool:
    """Whether this server keeps named contexts: prefix caching on (vLLM's on vLLM's runner; the plugin's store on
    its own runner, where vLLM's is always off), on one worker (a stored context would be a row in every
    tensor-parallel worker's or pipeline stage's pool, each dropped on its own: not kept there yet)."""
    if runner == "vllm":
        parallel = vllm_config.parallel_config
        one_worker = parallel.tensor_parallel_size == 1 and parallel.pipeline_parallel_size == 1
        return bool(vllm_config.cache_config.enable_prefix_caching) and one_worker
    from vllm_kvpress_ext.vllm_plugin.config import prefix_matching_mode

    return prefix_matching_mode(dict(vllm_config.additional_config or {})) is not None


def context_key(model_dir: str, policy: KVPolicy, prompt: list[int], boundary: int) -> str:
    """The stored context's key: the embedded engine's (`prefix_key`), so both stores name a context alike."""
    return prefix_key(model_dir, policy, prompt[:boundary])
