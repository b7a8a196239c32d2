"""Log-probabilities in OpenAI's two response shapes, from the engine's `TokenLogprob`s.

Completions (`"logprobs": k`) use the legacy shape: parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a dict of the k most likely tokens plus the chosen one, as vLLM returns it) and
`text_offset`. With `echo`, the prompt's tokens come first, the first with `null` entries (nothing
predicts it). Chat (`"logprobs": true, "top_logprobs": k`) uses `choices[].logprobs.content`, one
object per generated token with its UTF-8 `bytes`.

Token strings are each token decoded alone, as vLLM writes them; `-inf` becomes -9999.0 (JSON has no
infinity), as in vLLM and OpenAI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vllm_kvpress_ext.engine.sampler import TokenLogprob

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return max(value, _FLOOR) if not math.isnan(value) else _FLOOR


def _decode(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def completion_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    top: int,
    offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for `token_ids` (one entry each, None where nothing predicts it);
    `text_offset` counts from `offset` (a stream's chunks continue where the previous one ended)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = _decode(tokenizer, token_id)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        alternatives = {token: _finite(entry.logprob)}
        for alt_id, alt_logprob in entry.top[:top]:
            alternatives.setdefault(_decode(tokenizer, alt_id), _finite(alt_logprob))
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def vllm_prompt_logprobs(
    tokenizer: Any, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` extension: per prompt token, None for the first, else a dict keyed by token
    id (the prompt token and its `top` most likely alternatives) of `logprob`, `rank`, `decoded_token`."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        position = {str(token_id): _vllm_item(tokenizer, token_id, entry.logprob, entry.rank)}
        for rank, (alt_id, alt_logprob) in enumerate(entry.top[:top], start=1):
            position.setdefault(str(alt_id), _vllm_item(tokenizer, alt_id, alt_logprob, rank))
        out.append(position)
    return out


def _vllm_item(tokenizer: Any, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": _decode(tokenizer, token_id)}


class StreamedLogprobs:
    """A stream's log-probabilities per choice: each chunk carries those of the tokens new since the last."""

    def __init__(self, choices: int) -> None:
        self.sent = [0] * choices
        self.offset = [0] * choices

    def take(
        self, index: int, token_ids: Sequence[int], entries: Sequence[TokenLogprob] | None
    ) -> tuple[list[int], list[TokenLogprob]]:
        start, end = self.sent[index], len(entries or ())
        self.sent[index] = end
        return list(token_ids[start:end]), list((entries or [])[start:end])

    def completion_chunk(self, index: int, tokenizer: Any, update: Any, top: int) -> dict[str, Any]:
        ids, entries = self.take(index, update.token_ids, update.logprobs)
        chunk = completion_logprobs(tokenizer, ids, entries, top, self.offset[index])
        self.offset[index] += sum(len(t) for t in chunk["tokens"])
        return chunk

    def chat_chunk(self, index: int, tokenizer: Any, update: Any, top: int) -> dict[str, Any]:
        _, entries = self.take(index, update.token_ids, update.logprobs)
        return chat_logprobs(tokenizer, entries, top)


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [...]}`, one item per generated token."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = _decode(tokenizer, token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    for entry in entries:
        content.append(
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(alt_id, alt_logprob) for alt_id, alt_logprob in entry.top[:top]],
            }
        )
    return {"content": content}
