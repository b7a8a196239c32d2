"""Render a natural-language task for a real tokenizer at a given length, and score a continuation.

Prompts are plain text completions (no chat template: small instruct models retrieve better that
way, and every tokenizer has no-template text): `CONTEXT \\n QUESTION ANSWER-PREFIX`. The context and
the question are tokenised separately and concatenated, so the context's tokens are an exact prefix
of the prompt: that is where the question-agnostic protocol compresses (kvpress's pipeline
protocol: context compressed, question prefilled after), and what a bench can prefill once and
share between policies. The served protocol compresses after the whole prompt.

Length: the largest haystack whose prompt fits `context_length` tokens (prompt tokens, answer
excluded) is found by bisection on the task's size, each try drawn from the same seed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .filler import FillerKind
from .tasks import NATURAL_TASKS, QUESTIONS_PER_CONTEXT, Draft

NaturalProtocol = Literal["served", "agnostic"]
NATURAL_PROTOCOLS: tuple[str, ...] = get_args(NaturalProtocol)
HELD_OUT_SEED = 2_000_000  # nothing is trained on these tasks; a fixed base keeps samples stable across runs


@dataclass(frozen=True)
class NaturalPrompt:
    """A tokenised sample: `token_ids` = context + question; `compress_after` per the protocol."""

    task: str
    token_ids: list[int]
    context_tokens: int
    compress_after: int | None  # None: after the whole prompt (served)
    answers: tuple[str, ...]
    max_new_tokens: int
    seed: int
    question: int = 0  # which of the context's questions (QUESTIONS_PER_CONTEXT) this prompt asks


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _tokens(tokenizer: Any, draft: Draft) -> tuple[list[int], list[int]]:
    context = _ids(tokenizer, draft.context, special=True)
    question = _ids(tokenizer, f"\n{draft.question} {draft.answer_prefix}", special=False)
    return context, question


def render(
    task: str,
    tokenizer: Any,
    context_length: int,
    seed: int,
    protocol: NaturalProtocol = "agnostic",
    filler: FillerKind = "noise",
) -> NaturalPrompt:
    """Sample `seed` of `task` as at most `context_length` prompt tokens of `tokenizer`."""
    return render_questions(task, tokenizer, context_length, seed, 1, protocol, filler)[0]


def render_questions(
    task: str,
    tokenizer: Any,
    context_length: int,
    seed: int,
    count: int,
    protocol: NaturalProtocol = "agnostic",
    filler: FillerKind = "noise",
) -> list[NaturalPrompt]:
    """Sample `seed` of `task` asked its first `count` questions: one context, token for token the same in
    every prompt, each prompt at most `context_length` tokens (the haystack is sized for the longest question).
    """
    if task not in NATURAL_TASKS:
        raise ValueError(f"unknown natural task {task!r}; known: {', '.join(NATURAL_TASKS)}")
    if protocol not in NATURAL_PROTOCOLS:
        raise ValueError(f"protocol must be one of {NATURAL_PROTOCOLS}, got {protocol!r}")
    if not 1 <= count <= QUESTIONS_PER_CONTEXT.get(task, 1):
        raise ValueError(f"{task} asks 1 to {QUESTIONS_PER_CONTEXT.get(task, 1)} questions per context, not {count}")
    build = NATURAL_TASKS[task]

    def draw(size: int, question: int) -> tuple[Draft, list[int], list[int]]:
        rng = random.Random(f"{task}-{seed}")  # str seeds are stable across runs
        draft = build(rng, size, filler, question=question) if question else build(rng, size, filler)  # type: ignore[call-arg]
        return (draft, *_tokens(tokenizer, draft))

    @functools.cache  # the growth check asks a size again
    def length(size: int) -> int:
        drawn = [draw(size, q) for q in range(count)]
        return len(drawn[0][1]) + max(len(question) for _, _, question in drawn)

    low, high = 0, 1
    if length(low) > context_length:
        raise ValueError(f"{task}: context_length={context_length} is too short for the task without any haystack")
    while (reached := length(high)) <= context_length:  # grow until too long, then bisect
        # A bounded haystack (the word list's vocabulary) is full. Below 64, a task's own minimum size may
        # make two sizes equal (the coded-word count is at least 30).
        if high >= 64 and reached == length(high // 2):
            raise ValueError(f"{task}: its largest haystack makes {reached} tokens, short of {context_length}")
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if length(mid) <= context_length else (low, mid)
    prompts = []
    for question_index in range(count):
        draft, context, question = draw(low, question_index)
        prompts.append(
            NaturalPrompt(
                task=task,
                token_ids=context + question,
                context_tokens=len(context),
                compress_after=len(context) if protocol == "agnostic" else None,
                answers=draft.answers,
                max_new_tokens=draft.max_new_tokens,
                seed=seed,
                question=question_index,
            )
        )
    return prompts


def score(prompt: NaturalPrompt, text: str) -> float:
    """Fraction of the reference answers found in the continuation (case-insensitive substring)."""
    lowered = text.lower()
    return sum(answer.lower() in lowered for answer in prompt.answers) / len(prompt.answers)
