"""Prompt inputs of the offline API: plain prompts and (context, question) pairs compressed in between."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


def _check_part(name: str, part: object) -> None:
    if isinstance(part, str):
        return
    if isinstance(part, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in part):
        return
    raise TypeError(f"{name} must be a string or a list of token ids, got {type(part).__name__}")


@dataclass(frozen=True)
class ContextQuestion:
    """A prompt whose context is compressed before the question is read (kvpress's question-agnostic protocol).

    The context is prefilled and compressed by the policy; the question then runs token by token from
    the compressed cache, and so does every answer token. Text parts are tokenised separately (the
    context with the tokenizer's special tokens, the question without), so the context is an exact
    token prefix of the prompt. An empty question compresses after the whole prompt, like a plain one.
    """

    context: str | list[int]
    question: str | list[int] = ""

    def __post_init__(self) -> None:
        _check_part("context", self.context)
        _check_part("question", self.question)
        if len(self.context) == 0:
            raise ValueError("the context is empty: there is nothing to compress before the question")


Prompt = str | list[int] | ContextQuestion


@dataclass(frozen=True)
class PreparedPrompt:
    """Token ids for the engine and where the policy compresses (None: after the whole prompt)."""

    token_ids: list[int]
    compress_after: int | None


def is_single_prompt(prompts: object) -> bool:
    """One prompt rather than a batch: text, a `ContextQuestion`, or a list of token ids."""
    if isinstance(prompts, str | ContextQuestion):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def compress_points(compress_after: int | Sequence[int | None] | None, count: int) -> list[int | None]:
    """One `compress_after` per prompt: a single value applies to all, a sequence gives one each."""
    if compress_after is None or isinstance(compress_after, int):
        return [compress_after] * count
    if isinstance(compress_after, str) or not isinstance(compress_after, Sequence):
        raise TypeError(f"compress_after must be an integer, None or a sequence of them, got {compress_after!r}")
    points = list(compress_after)
    if len(points) != count:
        raise ValueError(f"{len(points)} compress_after values for {count} prompts")
    return points


def _token_ids(part: str | list[int], encode: Callable[[str, bool], list[int]], special: bool) -> list[int]:
    if isinstance(part, str):
        return encode(part, special) if part else []
    return list(part)


def prepare_prompt(
    prompt: Prompt, compress_after: int | None, encode: Callable[[str, bool], list[int]]
) -> PreparedPrompt:
    """Token ids and compression point of one prompt; `encode(text, add_special_tokens)` tokenises text.

    `compress_after` is checked against the prompt's length by the engine; here only its clash with a
    `ContextQuestion`, which sets it itself.
    """
    if isinstance(prompt, ContextQuestion):
        if compress_after is not None:
            raise ValueError("a ContextQuestion sets its own compression point; do not pass compress_after for it")
        context = _token_ids(prompt.context, encode, special=True)
        # The question continues the prompt: no special tokens (a BOS mid-prompt would change the answer).
        question_ids = _token_ids(prompt.question, encode, special=False)
        if not context:
            raise ValueError("the context has no tokens: there is nothing to compress before the question")
        return PreparedPrompt(context + question_ids, len(context) if question_ids else None)
    if isinstance(prompt, str):
        return PreparedPrompt(encode(prompt, True), compress_after)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return PreparedPrompt(list(prompt), compress_after)
    raise TypeError(f"a prompt must be a string, a list of token ids or a ContextQuestion, got {type(prompt).__name__}")
