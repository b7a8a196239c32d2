"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown fields are rejected (`extra="forbid"`, answered 400 naming the field) rather than silently
ignored: a misspelt `kv_polcy` would otherwise serve an uncompressed request and nobody would
notice. The vLLM extensions this engine can honour (`top_k`, `ignore_eos`, `stop_token_ids`,
`vllm_xargs`) are accepted; parameters OpenAI defines but this server does not implement (`n > 1`,
`echo`, `logprobs`, penalties, ...) are accepted by the schema and refused with a clear 400 by
the handlers, so the message says "not supported" instead of "unrecognized".

Response bodies are plain dicts built in `responses.py`: their shape is fixed by OpenAI's API and
building them directly keeps the hot streaming path free of model validation.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PolicyField = str | dict[str, Any] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's name; accepted, usage still comes once at the end


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM extension; 0 or -1 disables it")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator accepts
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM extension")
    ignore_eos: bool | None = Field(default=None, description="vLLM extension: keep generating past EOS")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    kv_policy: PolicyField = Field(
        default=None,
        description='KV compression policy for this request: a name ("snapkv") or {"name": ..., params}',
    )
    vllm_xargs: dict[str, Any] | None = Field(
        default=None, description="vLLM-style extra arguments; `kv_policy` is read from here too"
    )


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
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
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
