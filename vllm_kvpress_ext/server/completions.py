"""`POST /v1/completions`: a text or token-id prompt in, text out (whole or as SSE chunks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_kvpress_ext.server.engine_loop import EngineStepError, RequestHandle
from vllm_kvpress_ext.server.errors import bad_request, error_body, unsupported
from vllm_kvpress_ext.server.prompts import check_text, encode_bounded
from vllm_kvpress_ext.server.protocol import CompletionRequest
from vllm_kvpress_ext.server.serving import (
    ServerState,
    check_model,
    check_unsupported,
    final_response,
    include_usage,
    new_id,
    sampling_params,
    submit,
    usage,
)
from vllm_kvpress_ext.server.streaming import DONE, AbortingStreamingResponse, TextDeltas, sse


def prompt_token_ids(state: ServerState, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """One prompt as token ids. Batches (several prompts) are refused: one request, one stream."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
        return prompt_token_ids(state, prompt[0])
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", param="prompt")
        check_text(prompt, "prompt")
        return encode_bounded(state.tokenizer, prompt, state.max_model_len)
    return [int(t) for t in prompt]  # type: ignore[arg-type]


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvpress
    check_model(state, body.model)
    check_unsupported(body)
    if body.echo:
        raise unsupported("echo", "echo=true is not supported")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    if body.logprobs is not None:
        raise unsupported("logprobs", "logprobs are not supported")
    if body.suffix:
        raise unsupported("suffix", "suffix is not supported")
    # Off the event loop: a long prompt must not stall other connections (or /health) while it tokenizes.
    token_ids = await asyncio.to_thread(prompt_token_ids, state, body.prompt)
    params = sampling_params(body, body.max_tokens or 16)
    handle = await submit(state, body, token_ids, params, arrival, "prompt")
    completion_id = new_id("cmpl")
    created = int(time.time())

    def payload(*choices: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": list(choices),
        }

    if body.stream:
        return AbortingStreamingResponse(
            _stream(handle, payload, params.stop, include_usage(body)), on_close=handle.abort
        )
    return await final_response(
        handle,
        request,
        payload,
        lambda final: {"index": 0, "text": final.text, "logprobs": None, "finish_reason": final.finish_reason},
    )


async def _stream(handle: RequestHandle, payload: Any, stop: tuple[str, ...], with_usage: bool) -> AsyncIterator[str]:
    deltas = TextDeltas(stop)
    try:
        async for update in handle.updates():
            text = deltas.delta(update.text, update.finished)
            if text or update.finished:
                reason = update.finish_reason if update.finished else None
                yield sse(payload({"index": 0, "text": text, "logprobs": None, "finish_reason": reason}))
            if update.finished and with_usage:
                yield sse({**payload(), "usage": usage(handle, update)})
    except EngineStepError as exc:
        yield sse(error_body(str(exc), type="server_error", code=exc.code))
    yield DONE
