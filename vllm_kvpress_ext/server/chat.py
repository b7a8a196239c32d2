"""`POST /v1/chat/completions`: messages through the model's chat template, an assistant turn out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_kvpress_ext.api.context_policy import NO_SPLIT
from vllm_kvpress_ext.api.errors import bad_request, error_body, unsupported
from vllm_kvpress_ext.engine.llm import chat_token_ids
from vllm_kvpress_ext.server.engine_loop import EngineStepError, RequestHandle, Update
from vllm_kvpress_ext.server.logprobs import StreamedLogprobs, chat_logprobs, vllm_prompt_logprobs
from vllm_kvpress_ext.server.prompts import check_text
from vllm_kvpress_ext.server.protocol import ChatCompletionRequest, ChatMessage
from vllm_kvpress_ext.server.serving import (
    ServerState,
    abort_all,
    check_max_tokens,
    check_model,
    check_unsupported,
    final_response,
    include_usage,
    merged_updates,
    new_id,
    sample_params,
    submit_all,
    usage,
)
from vllm_kvpress_ext.server.streaming import DONE, AbortingStreamingResponse, TextDeltas, sse


def _message_dict(index: int, message: ChatMessage) -> dict[str, str]:
    """A message as the chat template wants it: role and plain-text content."""
    content = message.content
    if content is None and message.role != "assistant":  # vLLM refuses it too; an assistant turn may be empty
        param = f"messages.{index}.content"
        raise bad_request(f"{param}: a {message.role} message needs content", param=param)
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise unsupported(
                    f"messages.{index}.content", f"only text content parts are supported, got {part.type!r}"
                )
            parts.append(part.text)
        text = "\n".join(parts)
    check_text(text, f"messages.{index}.content", allow_empty=True)
    return {"role": message.role, "content": text}


def chat_prompt(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it has no chat template", param="messages")
    rendered = [_message_dict(i, m) for i, m in enumerate(messages)]
    try:
        return chat_token_ids(state.tokenizer, rendered)
    except Exception as exc:  # jinja's TemplateError (e.g. an unsupported role) or a missing template
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None


def context_boundary(state: ServerState, body: ChatCompletionRequest, token_ids: list[int]) -> int:
    """`kv_prefix_messages` as a token boundary: the rendered length of the context messages."""
    count = body.kv_prefix_messages
    assert count is not None
    if body.kv_prefix_tokens is not None:
        raise bad_request("give kv_prefix_messages or kv_prefix_tokens, not both", param="kv_prefix_messages")
    if count >= len(body.messages):
        raise bad_request(
            f"kv_prefix_messages must be below the {len(body.messages)} messages, got {count}",
            param="kv_prefix_messages",
        )
    context = _rendered_context(state, body.messages[:count])
    if not context or token_ids[: len(context)] != context:
        raise bad_request(
            "the chat template does not render the first kv_prefix_messages messages as a prefix of the prompt",
            param="kv_prefix_messages",
        )
    return len(context)


def _rendered_context(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    rendered = [_message_dict(i, m) for i, m in enumerate(messages)]
    try:
        ids = state.tokenizer.apply_chat_template(rendered, add_generation_prompt=False, tokenize=True)
    except Exception as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def default_context(state: ServerState, body: ChatCompletionRequest, token_ids: list[int]) -> int | None:
    """A chat that names no context has the messages before its last user message as one, by default: their
    rendered length, compressed alone by the policy `api/context_policy.py` chooses, so that later questions about
    them attach. With automatic matching it is a fallback: a stored prefix that matches wins (a later turn
    attaches to what the earlier one left). None with prefix caching off, `--context-policy none`, a context
    named by the client, a last message that is not the user's, a template that does not render the earlier
    messages as a prefix of the prompt, or a last message longer than what comes before it: the prompt's tail
    after a context is read, not compressed, so a document pasted into the question is compressed with the
    whole prompt by the request's own policy instead."""
    config = state.config
    if not config.enable_prefix_caching or config.context_policy == NO_SPLIT or len(body.messages) < 2:
        return None
    if body.kv_prefix_tokens is not None or body.kv_prefix_messages is not None:
        return None
    if body.messages[-1].role != "user":
        return None
    context = _rendered_context(state, body.messages[:-1])
    if not context or len(context) >= len(token_ids) or token_ids[: len(context)] != context:
        return None
    if len(context) < len(token_ids) - len(context):
        return None
    return len(context)


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvpress
    check_model(state, body.model)
    check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.stream and body.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "prompt_logprobs are not supported with stream=true")
    if body.echo and body.messages[-1].role == "assistant":
        raise unsupported("echo", "echoing the last assistant message is not supported")
    if body.tool_choice not in (None, "none") and body.tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if body.tools:
        raise unsupported("tools", "tool calling is not supported")
    for param in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(state, getattr(body, param), param)
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "only the text response format is supported")
    token_ids = await asyncio.to_thread(chat_prompt, state, body.messages)  # off the event loop
    if body.kv_prefix_messages is not None:
        boundary = await asyncio.to_thread(context_boundary, state, body, token_ids)
        body = body.model_copy(update={"kv_prefix_tokens": boundary})
    context = await asyncio.to_thread(default_context, state, body, token_ids)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested or max(1, state.max_model_len - len(token_ids))
    samples = sample_params(body, max_tokens, state.vocab_size, 1, top_logprobs, body.prompt_logprobs)
    handles = await submit_all(state, body, [token_ids], samples, arrival, "messages", context)
    completion_id = new_id("chatcmpl")
    created = int(time.time())

    def payload(obj: str, *choices: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": obj,
            "created": created,
            "model": state.model_name,
            "choices": list(choices),
        }

    if body.stream:
        return AbortingStreamingResponse(
            _stream(
                handles, payload, samples[0].stop, include_usage(body), len(token_ids), state.tokenizer, top_logprobs
            ),
            on_close=abort_all(handles),
        )

    def choice(index: int, final: Update) -> dict[str, Any]:
        answer = {
            "index": index,
            "message": {"role": "assistant", "content": final.text},
            "logprobs": None
            if top_logprobs is None
            else chat_logprobs(state.tokenizer, final.logprobs or [], top_logprobs),
            "finish_reason": final.finish_reason,
        }
        if body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(
                state.tokenizer, token_ids, final.prompt_logprobs or [], body.prompt_logprobs
            )
        return answer

    return await final_response(handles, request, partial(payload, "chat.completion"), choice, len(token_ids))


async def _stream(
    handles: list[RequestHandle],
    payload: Any,
    stop: tuple[str, ...],
    with_usage: bool,
    prompt_tokens: int,
    tokenizer: Any,
    top_logprobs: int | None,
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk"
    deltas = [TextDeltas(stop) for _ in handles]
    streamed = StreamedLogprobs(len(handles))

    def logprobs(index: int, update: Update) -> dict[str, Any] | None:
        return None if top_logprobs is None else streamed.chat_chunk(index, tokenizer, update, top_logprobs)

    finals: list[Update] = []
    # Each choice's role goes first, before any token, as OpenAI does: clients key message assembly on it.
    for index in range(len(handles)):
        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield sse(payload(obj, first))
    try:
        async for index, update in merged_updates(handles):
            text = deltas[index].delta(update.text, update.finished)
            if text:
                delta = {
                    "index": index,
                    "delta": {"content": text},
                    "logprobs": logprobs(index, update),
                    "finish_reason": None,
                }
                yield sse(payload(obj, delta))
            if update.finished:
                finals.append(update)
                rest = logprobs(index, update)  # tokens whose text was held back or never shown (a stop)
                end = {"index": index, "delta": {}, "logprobs": rest, "finish_reason": update.finish_reason}
                yield sse(payload(obj, end))
        if with_usage:
            yield sse({**payload(obj), "usage": usage(prompt_tokens, finals)})
    except EngineStepError as exc:
        yield sse(error_body(str(exc), status=exc.status))
    yield DONE
