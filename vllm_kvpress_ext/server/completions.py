"""`POST /v1/completions`: text or token-id prompts in, text out (whole or as SSE chunks).

`prompt` may be one prompt (a string or a list of token ids) or a batch (a list of strings or of token
lists), as OpenAI and vLLM accept it. Each prompt, and each of its `n` samples, is its own engine
request and its own choice (`index` = prompt x n + sample, vLLM's numbering); `usage` sums over them
and counts each prompt's tokens once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_kvpress_ext.api import limits
from vllm_kvpress_ext.api.errors import bad_request, error_body, unsupported
from vllm_kvpress_ext.server.engine_loop import EngineStepError, RequestHandle, Update
from vllm_kvpress_ext.server.logprobs import StreamedLogprobs, completion_logprobs, vllm_prompt_logprobs
from vllm_kvpress_ext.server.prompts import check_text, encode_bounded
from vllm_kvpress_ext.server.protocol import CompletionRequest
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

Prompt = str | list[int] | list[str] | list[list[int]]


def _one_prompt(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", param=param)
        check_text(prompt, param)
        return encode_bounded(state.tokenizer, prompt, state.max_model_len)
    return [int(t) for t in prompt]


def prompt_batch(state: ServerState, prompt: Prompt) -> list[list[int]]:
    """The request's prompts as token ids: one for a string or a token list, several for a batch."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > limits.MAX_PROMPTS:
            raise bad_request(
                f"at most {limits.MAX_PROMPTS} prompts per request, got {len(prompt)} (VLLM_MAX_COMPLETION_PROMPTS)",
                param="prompt",
            )
        return [_one_prompt(state, p, "prompt") for p in prompt]
    return [_one_prompt(state, prompt, "prompt")]  # type: ignore[arg-type]


def _check_request(body: CompletionRequest) -> bool:
    """Refuse what this endpoint cannot do; True for a prompt-scoring request (`max_tokens=0` with `echo`)."""
    check_unsupported(body)
    if body.suffix:
        raise unsupported("suffix", "suffix is not supported")
    if body.stream and body.max_tokens == 0:
        raise unsupported("max_tokens", "max_tokens=0 is not supported with stream=true")
    if body.stream and body.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "prompt_logprobs are not supported with stream=true")
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise bad_request("max_tokens=0 needs echo=true: it returns the prompt (and its logprobs)", param="max_tokens")
    return score_only


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvpress
    check_model(state, body.model)
    score_only = _check_request(body)
    check_max_tokens(state, body.max_tokens, "max_tokens")
    # Off the event loop: a long prompt must not stall other connections (or /health) while it tokenizes.
    prompts = await asyncio.to_thread(prompt_batch, state, body.prompt)
    # The engine always generates at least one token; a prompt-scoring request's is dropped below.
    max_tokens = 1 if score_only else (16 if body.max_tokens is None else body.max_tokens)
    # The prompt's logprobs feed echo's legacy lists and vLLM's `prompt_logprobs`: the larger top-k serves both.
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    samples = sample_params(body, max_tokens, state.vocab_size, len(prompts), body.logprobs, prompt_logprobs)
    handles = await submit_all(state, body, prompts, samples, arrival, "prompt")
    prompt_tokens = sum(len(p) for p in prompts)
    view = _Choices(body, state, prompts, len(samples), new_id("cmpl"), int(time.time()))
    if body.stream:
        return AbortingStreamingResponse(
            _stream(
                handles,
                view.payload,
                samples[0].stop,
                include_usage(body),
                prompt_tokens,
                state.tokenizer,
                body.logprobs,
                view.echo_chunk if body.echo else None,
            ),
            on_close=abort_all(handles),
        )
    finalize = _without_generation if score_only else None
    return await final_response(handles, request, view.payload, view.choice, prompt_tokens, finalize)


def _without_generation(final: Update) -> Update:
    return dataclasses.replace(final, token_ids=[], text="", logprobs=[] if final.logprobs is not None else None)


@dataclasses.dataclass(frozen=True)
class _Choices:
    """How one completion request's choices are written: choice `index` answers prompt `index // n`."""

    body: CompletionRequest
    state: ServerState
    prompts: list[list[int]]
    n: int  # samples per prompt
    completion_id: str
    created: int

    def payload(self, *choices: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": list(choices),
        }

    def echoed_text(self, prompt_index: int) -> str:
        prompt = self.body.prompt
        given = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            given = str(prompt[prompt_index])
        if given is not None:
            return given
        tokenizer = self.state.tokenizer
        return str(tokenizer.decode(self.prompts[prompt_index])) if tokenizer is not None else ""

    def echo_chunk(self, index: int, first: Update) -> dict[str, Any]:
        """A stream's first chunk of a choice with `echo`: the prompt, with its logprobs when asked."""
        prompt_index = index // self.n
        logprobs = None
        if self.body.logprobs is not None:
            entries = first.prompt_logprobs or []
            logprobs = completion_logprobs(
                self.state.tokenizer, self.prompts[prompt_index], entries, self.body.logprobs
            )
        return {"index": index, "text": self.echoed_text(prompt_index), "logprobs": logprobs, "finish_reason": None}

    def choice(self, index: int, final: Update) -> dict[str, Any]:
        body, prompt_index = self.body, index // self.n
        text = (self.echoed_text(prompt_index) if body.echo else "") + final.text
        logprobs = None
        if body.logprobs is not None:
            token_ids, entries = list(final.token_ids), list(final.logprobs or [])
            if body.echo:
                token_ids = self.prompts[prompt_index] + token_ids
                entries = list(final.prompt_logprobs or []) + entries
            logprobs = completion_logprobs(self.state.tokenizer, token_ids, entries, body.logprobs)
        answer = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": final.finish_reason}
        if body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(
                self.state.tokenizer, self.prompts[prompt_index], final.prompt_logprobs or [], body.prompt_logprobs
            )
        return answer


async def _stream(
    handles: list[RequestHandle],
    payload: Any,
    stop: tuple[str, ...],
    with_usage: bool,
    prompt_tokens: int,
    tokenizer: Any,
    top_logprobs: int | None,
    echo: Callable[[int, Update], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    deltas = [TextDeltas(stop) for _ in handles]
    streamed = StreamedLogprobs(len(handles))
    echoed: set[int] = set()
    finals: list[Update] = []
    try:
        async for index, update in merged_updates(handles):
            if echo is not None and index not in echoed:
                echoed.add(index)
                chunk = echo(index, update)
                if chunk["logprobs"] is not None:  # the answer's text offsets continue after the prompt's
                    streamed.offset[index] = sum(len(t) for t in chunk["logprobs"]["tokens"])
                yield sse(payload(chunk))
            text = deltas[index].delta(update.text, update.finished)
            if text or update.finished:
                reason = update.finish_reason if update.finished else None
                logprobs = (
                    None if top_logprobs is None else streamed.completion_chunk(index, tokenizer, update, top_logprobs)
                )
                yield sse(payload({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}))
            if update.finished:
                finals.append(update)
        if with_usage:
            yield sse({**payload(), "usage": usage(prompt_tokens, finals)})
    except EngineStepError as exc:
        yield sse(error_body(str(exc), status=exc.status))
    yield DONE
