"""What completions and chat share: server state, sampling parameters, submission, usage, waiting.

Everything that turns an HTTP body into an engine request is checked here, in the handler, so the
engine loop only ever sees requests it can run and clients get a precise 4xx.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_kvpress_ext.api import limits
from vllm_kvpress_ext.api.context_policy import context_policy
from vllm_kvpress_ext.api.errors import APIError, bad_request, unsupported
from vllm_kvpress_ext.api.policy_spec import policy_spec, resolve_policy
from vllm_kvpress_ext.api.usage import combine_figures, kv_figures, usage_fields
from vllm_kvpress_ext.engine import LLMEngine, RequestRejectedError, SamplingParams
from vllm_kvpress_ext.engine.sampling_params import MAX_LOGIT_BIAS
from vllm_kvpress_ext.policies import PolicyConfigError
from vllm_kvpress_ext.server.config import ServerConfig
from vllm_kvpress_ext.server.engine_loop import (
    EngineLoop,
    EngineStepError,
    EngineUnavailableError,
    Failure,
    QueueFullError,
    RequestHandle,
    Update,
)
from vllm_kvpress_ext.server.metrics import ServerMetrics
from vllm_kvpress_ext.server.protocol import (
    CHANGES_THE_RESULT,
    IGNORED,
    NEUTRAL_ONLY,
    ChatCompletionRequest,
    CompletionRequest,
)

_DISCONNECT_POLL_S = 0.5
logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What every handler needs; stored on `app.state.kvpress`."""

    config: ServerConfig
    engine: LLMEngine
    loop: EngineLoop
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def tokenizer(self) -> Any:
        # Read-only use from the event loop (encode, chat template) alongside the loop thread's
        # decodes: HF fast tokenizers take shared borrows for both, so this is safe.
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self.engine.config.vocab_size)


def check_max_tokens(state: ServerState, max_tokens: int | None, param: str) -> None:
    """vLLM refuses an output longer than the model's context, whatever the prompt."""
    if max_tokens is not None and max_tokens > state.max_model_len:
        raise bad_request(
            f"{param}={max_tokens} cannot be greater than max_model_len={state.max_model_len}. "
            "Please request fewer output tokens.",
            param=param,
        )


def check_model(state: ServerState, model: str | None) -> None:
    """Clients must name the served model (or omit it); anything else is OpenAI's 404."""
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.model_name}`",
            param="model",
        )


def check_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse OpenAI parameters this server does not implement instead of silently ignoring them, and what
    vLLM's server refuses (`api/limits.py`), with vLLM's words where it has them."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")
    stops = [] if body.stop is None or isinstance(body.stop, str) else body.stop
    if len(stops) > limits.MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {limits.MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    for name, neutral in NEUTRAL_ONLY.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            allowed = " or ".join(repr(v) for v in (None, *neutral))
            raise unsupported(name, f"only {allowed} is supported, got {value!r}")
    for name in CHANGES_THE_RESULT:
        value = getattr(body, name, None)
        if value is not None and not (name == "modalities" and value == ["text"]):
            raise unsupported(name, f"{name} is not supported (it would change the answer)")
    ignored = [name for name in IGNORED if getattr(body, name, None) is not None]
    if ignored:
        logger.info("request fields accepted and ignored (they do not change the answer): %s", ", ".join(ignored))


def logit_bias(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs: ids in the vocabulary, biases clamped to [-100, 100] as vLLM does."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not math.isfinite(bias):  # JSON parsers take NaN and Infinity; neither is a bias
            raise bad_request(f"logit_bias values must be finite numbers, got {bias!r}", param="logit_bias")
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", param="logit_bias"
            )
        pairs.append((token, min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))))
    return tuple(pairs)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    vocab_size: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            min_tokens=body.min_tokens or 0,
            skip_special_tokens=body.skip_special_tokens is not False,
            logit_bias=logit_bias(body, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def sample_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    vocab_size: int,
    prompts: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """One `SamplingParams` per sample (`n`): with a seed, sample j is seeded `seed + j`, as vLLM seeds
    the n children of a request, so each sample is reproducible alone and the n differ."""
    n = 1 if body.n is None else body.n
    # vLLM's bound on n; here it bounds the engine requests one HTTP request starts (prompts x n) too: each
    # holds its own pages and queue slot.
    most = limits.MAX_SAMPLES
    if n > most:
        raise bad_request(f"n must be at most {most}, got {n} (VLLM_MAX_N_SEQUENCES)", param="n")
    if n * prompts > most:
        raise bad_request(f"n x prompts may be at most {most}, got {n} x {prompts}", param="n")
    params = sampling_params(body, max_tokens, vocab_size, logprobs, prompt_logprobs)
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + j) % 2**64) for j in range(n)]


def prefix_boundary(body: CompletionRequest | ChatCompletionRequest, token_ids: list[int]) -> int | None:
    """`kv_prefix_tokens`: the context the policy compresses before the rest of the prompt is read."""
    boundary = body.kv_prefix_tokens
    if boundary is not None and boundary >= len(token_ids):
        raise bad_request(
            f"kv_prefix_tokens must be below the prompt's {len(token_ids)} tokens, got {boundary}",
            param="kv_prefix_tokens",
        )
    return boundary


async def submit(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    token_ids: list[int],
    params: list[SamplingParams],
    arrival: float,
    prompt_param: str,
    default_context: int | None = None,
) -> list[RequestHandle]:
    """Resolve the request's policy and hand the prompt's samples to the engine loop (one command: the
    samples after the first fork its compressed prompt); every refusal becomes an APIError.

    `default_context`: a chat's default context boundary (`chat.default_context`), compressed alone by the policy
    `contexts.context_policy` chooses for the request's, if any; with automatic matching only as a fallback."""
    policy = resolve_policy(policy_spec(body.kv_policy, body.vllm_xargs))
    try:
        boundary = prefix_boundary(body, token_ids)
        requested = policy if policy is not None else state.engine.default_policy
        for_context = context_policy(state.config.context_policy, requested) if default_context is not None else None
        if boundary is None and default_context is not None and for_context is not None:
            fallback = state.config.prefix_matching == "auto"
            return await state.loop.submit_samples(
                token_ids, params, for_context, arrival, default_context, context_is_fallback=fallback
            )
        return await state.loop.submit_samples(token_ids, params, policy, arrival, boundary)
    except QueueFullError as exc:
        raise APIError(429, str(exc)) from None
    except RequestRejectedError as exc:
        raise bad_request(str(exc), param=prompt_param) from None
    except PolicyConfigError as exc:
        raise bad_request(str(exc), param="kv_policy") from None
    except EngineUnavailableError as exc:
        raise APIError(503, str(exc)) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def wait_final(handle: RequestHandle, is_disconnected: Callable[[], Awaitable[bool]]) -> Update | None:
    """The finished update, or None if the client went away (the request is then aborted).

    Non-streaming clients that hang up would otherwise keep generating into a closed socket and
    keep their KV pages until `max_tokens`.
    """
    clock = asyncio.get_running_loop().time
    next_check = clock() + _DISCONNECT_POLL_S
    try:
        while True:
            # Updates arrive every step, so the disconnect check runs on a clock, not on idle timeouts.
            item: Update | Failure | None
            try:
                item = await asyncio.wait_for(handle.queue.get(), timeout=max(0.0, next_check - clock()))
            except TimeoutError:
                item = None
            if clock() >= next_check:
                if await is_disconnected():
                    return None
                next_check = clock() + _DISCONNECT_POLL_S
            if item is None:
                continue
            if isinstance(item, Failure):
                handle.finished = True
                raise EngineStepError(item.message, item.code)
            if item.finished:
                handle.finished = True
                return item
    finally:
        handle.abort()  # no-op once finished


async def submit_all(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    params: list[SamplingParams],
    arrival: float,
    prompt_param: str,
    default_context: int | None = None,
) -> list[RequestHandle]:
    """One engine request per (prompt, sample): `params[j]` is sample j's; prompt-major order (choice
    index = prompt * samples + sample, as vLLM numbers them). A prompt's samples share its compressed
    pages (engine/samples.py). A refusal aborts what was already submitted. `default_context` is a chat's
    default context boundary (`submit`)."""
    handles: list[RequestHandle] = []
    try:
        for token_ids in prompts:
            handles += await submit(state, body, token_ids, params, arrival, prompt_param, default_context)
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return handles


def _shared_disconnect_check(is_disconnected: Callable[[], Awaitable[bool]]) -> Callable[[], Awaitable[bool]]:
    """`is_disconnected` for many waiters at once: one of them asks the connection, the rest reuse its answer."""
    lock = asyncio.Lock()
    clock = asyncio.get_running_loop().time
    last: list[float | bool] = [-_DISCONNECT_POLL_S, False]

    async def check() -> bool:
        async with lock:
            if clock() - float(last[0]) >= _DISCONNECT_POLL_S / 2:
                last[:] = [clock(), await is_disconnected()]
            return bool(last[1])

    return check


async def wait_all(handles: list[RequestHandle], is_disconnected: Callable[[], Awaitable[bool]]) -> list[Update] | None:
    """Every handle's finished update (in order), or None if the client went away; all are aborted then,
    and when one of them fails (its `EngineStepError` is raised)."""
    check = _shared_disconnect_check(is_disconnected) if len(handles) > 1 else is_disconnected
    waiters = [asyncio.ensure_future(wait_final(handle, check)) for handle in handles]
    try:
        finals = await asyncio.gather(*waiters)
    finally:
        for waiter in waiters:
            waiter.cancel()  # a failed sibling leaves the others waiting; no-op for the done ones
        for handle in handles:
            handle.abort()  # no-op for the finished ones
    if any(final is None for final in finals):
        return None
    return [final for final in finals if final is not None]


async def merged_updates(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Update]]:
    """(choice index, update) as they arrive from every handle, until all finished; an engine failure of
    any choice is raised (`EngineStepError`) and ends the stream."""
    if len(handles) == 1:
        async for update in handles[0].updates():
            yield 0, update
        return
    arrivals: asyncio.Queue[tuple[int, Update | EngineStepError]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for update in handle.updates():
                arrivals.put_nowait((index, update))
        except EngineStepError as exc:
            arrivals.put_nowait((index, exc))

    pumps = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            index, item = await arrivals.get()
            if isinstance(item, EngineStepError):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for task in pumps:
            task.cancel()


def abort_all(handles: list[RequestHandle]) -> Callable[[], None]:
    def abort() -> None:
        for handle in handles:
            handle.abort()

    return abort


def engine_failure(exc: EngineStepError) -> APIError:
    return APIError(exc.status, str(exc))


async def final_response(
    handles: list[RequestHandle],
    request: Request,
    payload: Callable[..., dict[str, Any]],
    choice: Callable[[int, Update], dict[str, Any]],
    prompt_tokens: int,
    finalize: Callable[[Update], Update] | None = None,
) -> Response:
    """The non-streaming answer: wait for every choice's finished update, then one JSON body with the usage.

    `choice(index, final)` builds one choice; `prompt_tokens` counts each prompt once (n samples of a
    prompt share it), as OpenAI and vLLM count it; `finalize` rewrites each final update first (e.g.
    drops the token a prompt-scoring request generated only because the engine always generates one).
    """
    try:
        finals = await wait_all(handles, request.is_disconnected)
    except EngineStepError as exc:
        raise engine_failure(exc) from None
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    if finalize is not None:
        finals = [finalize(final) for final in finals]
    # Off the event loop: per-token log-probabilities of a long echoed prompt mean many decodes.
    choices = await asyncio.to_thread(lambda: [choice(index, final) for index, final in enumerate(finals)])
    return JSONResponse({**payload(*choices), "usage": usage(prompt_tokens, finals)})


def usage(prompt_tokens: int, finals: list[Update]) -> dict[str, Any]:
    """OpenAI's usage block plus the KV figures the page pool reported, summed over the request's choices
    (`api.usage.combine_figures`: the plugin's rule too)."""
    completion = sum(len(final.token_ids) for final in finals)
    block: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    cached = sum(final.cached_tokens for final in finals)
    if cached:  # vLLM's shape, present when some prompt tokens came from a cached compressed prefix
        block["prompt_tokens_details"] = {"cached_tokens": cached}
    figures = [kv_figures(final.kv.policy, final.kv) for final in finals if final.kv is not None]
    if figures:
        block.update(usage_fields(combine_figures(figures)))
    return block


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)
