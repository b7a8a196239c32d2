"""Filler ("haystack") and the placement of records into it, with exact length control.

Every family builds its context the same way: a list of *blocks* (records, assignments, counted items)
is inserted into a filler stream sized so that context + question is exactly ``context_length`` tokens.
Because every word is one token, the filler size is a subtraction, and the requested length is hit
exactly (tolerance 0), whatever the filler kind.

Two filler kinds, as in RULER: ``"random"`` draws words uniformly from the filler vocabulary (blocks
go between any two words); ``"noise"`` repeats a few fixed sentences (blocks go only at sentence
boundaries, so sentences stay intact; the last sentence may be cut to hit the length).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ..tokenizer import FILLER_WORDS
from .base import TaskGenerator, require, require_int

FillerKind = Literal["random", "noise"]
FILLER_KINDS: tuple[str, ...] = get_args(FillerKind)

#: The repeated sentences of ``"noise"`` filler; filler words and ``.`` only.
NOISE_SENTENCES: tuple[str, ...] = (
    "the grass grows green .",
    "the sky looks blue .",
    "the sun shines bright .",
    "here we go .",
    "there and back again .",
)


@dataclass(frozen=True, kw_only=True)
class HaystackParams(TaskGenerator):
    """Parameters shared by every family that hides its records in filler.

    - ``context_length``: total tokens of context + question (``<bos>`` and chat markers excluded),
      hit exactly by sizing the filler. ``None`` means no filler: the context is just the records
      (the shortest, easiest form, for the start of a curriculum).
    - ``filler``: ``"random"`` (uniform filler words) or ``"noise"`` (repeated sentences).
    """

    context_length: int | None = 256
    filler: FillerKind = "random"

    def validate(self) -> None:
        super().validate()
        if self.context_length is not None:
            require_int("context_length", self.context_length, 1)
        require(self.filler in FILLER_KINDS, f"filler must be one of {FILLER_KINDS}, got {self.filler!r}")


def filler_budget(task: str, context_length: int | None, needed: int) -> int:
    """Filler tokens to add so the total is ``context_length``; a clear error if it cannot fit."""
    if context_length is None:
        return 0
    require(
        context_length >= needed,
        f"{task}: context_length={context_length} is too short: its records and question alone take "
        f"{needed} tokens (raise context_length, or lower the number of records / key or value length)",
    )
    return context_length - needed


def measured_budget(
    task: str, context_length: int | None, blocks: Sequence[Sequence[str]], question: Sequence[str]
) -> int:
    """:func:`filler_budget` from the actual blocks and question (what generators use, so lengths are exact)."""
    return filler_budget(task, context_length, sum(len(b) for b in blocks) + len(question))


def make_filler(kind: FillerKind, n: int, rng: random.Random) -> list[str]:
    """``n`` filler words of the given kind."""
    if kind == "random":
        return [rng.choice(FILLER_WORDS) for _ in range(n)]
    words: list[str] = []
    i = 0
    while len(words) < n:
        words.extend(NOISE_SENTENCES[i % len(NOISE_SENTENCES)].split())
        i += 1
    return words[:n]


def insertion_gaps(filler: Sequence[str], kind: FillerKind) -> list[int]:
    """Indices of ``filler`` before which a block may go (``len(filler)`` = at the end)."""
    if kind == "random":
        return list(range(len(filler) + 1))
    ends = [i + 1 for i, w in enumerate(filler) if w == "."]
    return sorted({0, *ends, len(filler)})


def gap_at_depth(gaps: Sequence[int], depth: float, n_filler: int) -> int:
    """The allowed gap nearest to ``depth`` (0 = start of the context, 1 = end)."""
    target = depth * n_filler
    return min(gaps, key=lambda g: (abs(g - target), g))


def layout(
    rng: random.Random,
    blocks: Sequence[Sequence[str]],
    *,
    n_filler: int,
    kind: FillerKind,
    needles: Sequence[int] = (),
    depth: float | None = None,
    ordered: Sequence[Sequence[int]] = (),
) -> tuple[list[str], list[tuple[int, int]]]:
    """Insert ``blocks`` into ``n_filler`` filler words; return the context words and each block's span.

    - Each block goes into a uniformly random allowed gap. Blocks sharing a gap keep their list order,
      so callers shuffle ``blocks`` first when order should be random.
    - ``needles`` (block indices) all go at ``depth`` when it is given, adjacent, in list order.
    - ``ordered``: groups of block indices (increasing) whose blocks must appear in that order, such
      as the assignments of one variable chain; their drawn gaps are sorted to respect it.

    Spans are ``[start, end)`` word offsets into the returned context, aligned with ``blocks``.
    """
    filler = make_filler(kind, n_filler, rng)
    gaps = insertion_gaps(filler, kind)
    chosen = [rng.choice(gaps) for _ in blocks]
    if depth is not None:
        at = gap_at_depth(gaps, depth, n_filler)
        for i in needles:
            chosen[i] = at
    for group in ordered:
        require(list(group) == sorted(group), "ordered block groups must list indices in increasing order")
        for i, g in zip(group, sorted(chosen[i] for i in group), strict=True):
            chosen[i] = g

    order = sorted(range(len(blocks)), key=lambda i: (chosen[i], i))
    words: list[str] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(blocks)
    cursor = 0
    for i in order:
        words.extend(filler[cursor : chosen[i]])
        cursor = max(cursor, chosen[i])
        spans[i] = (len(words), len(words) + len(blocks[i]))
        words.extend(blocks[i])
    words.extend(filler[cursor:])
    return words, spans


def validate_depth(depth: float | None) -> None:
    """``depth`` is ``None`` (random) or a fraction in [0, 1]."""
    if depth is not None:
        require(
            isinstance(depth, int | float) and not isinstance(depth, bool) and 0.0 <= depth <= 1.0,
            f"depth must be None (random) or a fraction in [0, 1], got {depth!r}",
        )
