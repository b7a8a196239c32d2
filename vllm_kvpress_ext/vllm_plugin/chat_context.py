"""A chat's default context on `vllm serve`: every message before the last user message, as in `kvpress serve`.

A chat that names no context (`kv_prefix_tokens`) has one by default: the messages before its last user
message (a system prompt, a document, earlier turns). This layer, in vLLM's API process, renders them with
vLLM's own renderer (the template, content format and options the request itself is rendered with) and names
their rendered length as the request's `kv_prefix_tokens`, so the context is compressed alone and later
questions about it attach to it (contexts.py). The policy that compresses it is the one `kvpress serve`'s
`--context-policy` chooses (api/context_policy.py): the request's own where it keeps what every later question
needs (KVzip, Expected Attention, StreamingLLM), else the server's context policy
(`additional_config["kv_context_policy"]`, default KVzip) at the request's budget; `usage.kv_policy` names it.

No split (the request runs as sent) where it could not be right or would be refused: prefix caching off,
`kv_context_policy: none`, a request with no compressing policy or one a context
cannot serve (contexts.py), fewer than two messages, a last message that is not the user's, tools, a chat
template or generation options of the request's own, prompt log-probabilities, a context the template does
not render as a token prefix of the prompt, or a last message longer than what comes before it (a document
pasted into the question is compressed with the whole prompt by the request's own policy instead).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from vllm_kvpress_ext.api import DEFAULT_CONTEXT_POLICY
from vllm_kvpress_ext.api.context_policy import NO_SPLIT, OWN_POLICY, context_spec, parse_context_policy
from vllm_kvpress_ext.api.errors import APIError
from vllm_kvpress_ext.api.policy_spec import policy_fields, policy_spec, resolve_policy
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.config import RUNNER_KEY
from vllm_kvpress_ext.vllm_plugin.contexts import CONTEXT_FIELD, context_refusal, contexts_kept
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy

logger = logging.getLogger("vllm.kvpress.chat_context")

CONTEXT_POLICY_KEY = "kv_context_policy"
# Body fields with which the request's own rendering may differ from a render of its messages alone.
_OWN_RENDERING = ("tools", "chat_template", "chat_template_kwargs", "continue_final_message", "documents")


@dataclass(frozen=True)
class ChatContexts:
    """The server's settings for default chat contexts, read once from vLLM's config."""

    configured: str | dict[str, Any]  # `kv_context_policy`, parsed (`NO_SPLIT`: off)
    default: KVPolicy | None  # the server's default policy
    runner: str = "vllm"

    @classmethod
    def from_config(cls, vllm_config: Any) -> ChatContexts:
        additional = dict(getattr(vllm_config, "additional_config", None) or {})
        runner = str(additional.get(RUNNER_KEY, "project"))
        if vllm_config is None or not contexts_kept(vllm_config, runner):
            return cls(NO_SPLIT, None, runner)
        return cls(context_policy_setting(additional), default_policy(additional), runner)


def context_policy_setting(additional: dict[str, Any]) -> str | dict[str, Any]:
    """`additional_config["kv_context_policy"]`, parsed as `kvpress serve --context-policy` (PolicyConfigError)."""
    value = additional.get(CONTEXT_POLICY_KEY, DEFAULT_CONTEXT_POLICY)
    return parse_context_policy(value if isinstance(value, str) else json.dumps(value))


def _settings(app_state: Any) -> ChatContexts:
    settings = getattr(app_state, "kvpress_chat_contexts", None)
    if settings is None:
        settings = ChatContexts.from_config(getattr(app_state, "vllm_config", None))
        app_state.kvpress_chat_contexts = settings
    return settings


async def name_default_context(app_state: Any, payload: dict[str, Any]) -> None:
    """Name the chat's default context in `payload["vllm_xargs"]` (and its policy, where the server's context
    policy compresses it), or leave the payload as it is."""
    settings = _settings(app_state)
    renderer = getattr(app_state, "online_renderer", None)
    messages = payload.get("messages")
    xargs = payload.get("vllm_xargs") or {}
    if (
        settings.configured == NO_SPLIT
        or renderer is None
        or not isinstance(messages, list)
        or len(messages) < 2
        or not isinstance(messages[-1], dict)
        or messages[-1].get("role") != "user"
        or not isinstance(xargs, dict)
        or CONTEXT_FIELD in xargs
        or payload.get("prompt_logprobs") is not None
        or payload.get("add_generation_prompt") is False
        or any(payload.get(field) for field in _OWN_RENDERING)
    ):
        return
    fields = policy_fields(xargs)
    try:
        requested = resolve_policy(policy_spec(None, fields)) if fields else settings.default
    except APIError:  # refused with its reason when vLLM validates the request
        return
    spec = context_spec(settings.configured, requested)
    if spec is None:
        return
    policy = requested if spec == OWN_POLICY else resolve_policy(spec)
    if policy is None or context_refusal(policy, settings.runner) is not None:
        return
    prompt = await _render(renderer, payload)
    context = await _render(renderer, {**payload, "messages": messages[:-1], "add_generation_prompt": False})
    if prompt is None or context is None or not context or prompt[: len(context)] != context:
        return
    if len(context) >= len(prompt) or len(context) < len(prompt) - len(context):
        return
    xargs = dict(xargs)
    xargs[CONTEXT_FIELD] = len(context)
    if spec != OWN_POLICY:
        for key in fields:
            del xargs[key]
        xargs["kv_policy"] = json.dumps(spec)
    payload["vllm_xargs"] = xargs


async def _render(renderer: Any, payload: dict[str, Any]) -> list[int] | None:
    """The token ids vLLM's renderer gives the chat in `payload` (None where it does not render it)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        rendered = await renderer.render_chat(ChatCompletionRequest.model_validate(payload))
    except Exception:  # the request's own render reports what is wrong with it
        logger.debug("vllm-kvpress-ext: the chat's default context could not be rendered", exc_info=True)
        return None
    if not isinstance(rendered, tuple):  # an ErrorResponse
        return None
    _, inputs = rendered
    tokens = inputs[0].get("prompt_token_ids") if inputs and isinstance(inputs[0], dict) else None
    return [int(t) for t in tokens] if tokens is not None else None
