"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown fields are accepted, logged and ignored, as vLLM's server does (a client written against vLLM,
or a newer OpenAI SDK, sends fields this server does not know), except in this project's own `kv_`
namespace: an unknown `kv_*` field is a 400 naming it in both servers, since a misspelt `kv_polcy`
would otherwise serve an uncompressed request and nobody would notice. vLLM's sampling extensions
are implemented (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `skip_special_tokens`, `stop_token_ids`, `vllm_xargs`; OpenAI's presence
and frequency penalties too). vLLM extensions this engine has no use for (`use_beam_search`,
`length_penalty`, `include_stop_str_in_output`, ...) are accepted at their neutral value
(`NEUTRAL_ONLY`), which is what load generators send, and refused with a 400 otherwise. Parameters
OpenAI defines but this server does not implement (`best_of > 1`, `suffix`, `tools`, ...) are accepted by
the schema and refused with a clear 400 by the handlers, so the message says "not supported"
instead of "unrecognized". OpenAI fields that cannot change the answer (`metadata`, `store`,
`service_tier`, ...: `IGNORED`) are accepted, logged and ignored, as vLLM does; those that would
(`reasoning_effort`, `audio`, ...: `CHANGES_THE_RESULT`) are refused by name. Types are strict
(`strict=True`): `"echo": 0`, `"max_tokens": 2.0` or `"top_k": "3"` is a 400, not a silent
conversion; an integer is still a valid float.

Response bodies are plain dicts built by the handlers (`completions.py`, `chat.py`): their shape is
fixed by OpenAI's API and building them directly keeps the hot streaming path free of model validation.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from vllm_kvpress_ext.api import KV_PREFIX
from vllm_kvpress_ext.api.limits import MAX_TEMPERATURE
from vllm_kvpress_ext.engine.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

PolicyField = str | dict[str, Any] | None

#: vLLM request fields accepted only at the value that changes nothing (None is always accepted).
NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "priority": (0,),
    "return_tokens_as_token_ids": (False,),
}


#: OpenAI request fields that do not change the answer (storage, tracing, billing and routing hints): accepted,
#: logged, ignored. The openai SDK sends some of them (`metadata`, `store`); vLLM accepts them too.
IGNORED: tuple[str, ...] = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "user")

#: OpenAI request fields that would change the answer and that this server does not implement: a 400
#: naming the field whenever one is set (`modalities` only past its neutral `["text"]`).
CHANGES_THE_RESULT: tuple[str, ...] = (
    "reasoning_effort",
    "verbosity",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's name; accepted, usage still comes once at the end


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [key for key in data if key not in cls.model_fields]
            refused = [key for key in unknown if isinstance(key, str) and key.startswith(KV_PREFIX)]
            if refused:
                raise PydanticCustomError(
                    "unknown_kv_field", "unrecognized request argument supplied: {name}", {"name": refused[0]}
                )
            if unknown:
                logger.warning("request fields ignored (this server does not know them): %s", ", ".join(unknown))
        return data

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, description="below 1e-5: greedy")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM extension; 0 or -1 disables it")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="vLLM extension; 0 disables it")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator accepts
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM extension")
    ignore_eos: StrictBool | None = Field(default=None, description="vLLM extension: keep generating past EOS")
    min_tokens: int | None = Field(default=None, ge=0, description="vLLM extension: no EOS/stop token before this")
    skip_special_tokens: StrictBool | None = Field(default=None, description="vLLM extension (default true)")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(
        default=1, ge=1, description="samples per prompt, at most vLLM's limit; they share the compressed prompt"
    )
    best_of: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, description="vLLM extension; 1 = off")
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored (IGNORED): they do not change the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    kv_policy: PolicyField = Field(
        default=None,
        description='KV compression policy for this request: a name ("snapkv") or {"name": ..., params}',
    )
    vllm_xargs: dict[str, Any] | None = Field(
        default=None, description="vLLM-style extra arguments; `kv_policy` is read from here too"
    )
    kv_prefix_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="extension: the first kv_prefix_tokens prompt tokens are a context the policy compresses on "
        "its own before the rest is read from the compressed cache; with prefix caching on, a later request "
        "with the same context, policy and model reuses that compressed context (docs/prefix_reuse.md)",
    )
    # vLLM extensions accepted only at their neutral value (NEUTRAL_ONLY).
    use_beam_search: StrictBool | None = None
    length_penalty: float | None = None
    include_stop_str_in_output: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    add_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: the prompt tokens' logprobs, vLLM's format"
    )
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int | None = None
    return_tokens_as_token_ids: StrictBool | None = None


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, description="0 only with echo: score the prompt")
    echo: StrictBool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. Extra fields are ignored: clients often echo back a whole previous response message."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    kv_prefix_messages: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="extension: the first kv_prefix_messages messages are the context (kv_prefix_tokens = their "
        "rendered length); fewer than the messages, and the chat template must render them as a token prefix",
    )
    max_tokens: int | None = Field(default=None, ge=1)
    echo: StrictBool | None = Field(default=False, description="vLLM extension; refused after an assistant message")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # ignored: tools are refused, so there are no calls
    # OpenAI fields that would change the answer (CHANGES_THE_RESULT): refused with a 400 naming them.
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
