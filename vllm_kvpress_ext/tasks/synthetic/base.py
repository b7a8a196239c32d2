"""The sample type and the generator base class shared by every task family.

Text conventions (every family follows them, and the tokenizer's exact round trip relies on them):

- ``context``, ``question`` and ``answer`` are words joined by single spaces: no leading, trailing or
  repeated whitespace, no newlines. Every word is one token of the suite's vocabulary, so a length in
  words *is* a length in tokens.
- Every question ends with the answer cue ``answer :`` (:data:`ANSWER_CUE`). The "strict" protocol
  compresses the cache just before the cue, so every answer token is decoded from the compressed cache.
- Answers made of several items (several values, several variables, several words) join the items with
  ``" , "`` (:data:`ITEM_SEP`), in an order the task defines, so exact match is well defined.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: Words that end every question: the model answers right after them.
ANSWER_CUE: tuple[str, ...] = ("answer", ":")
#: Separator between the items of a multi-item answer.
ITEM_SEP = ","


@dataclass(frozen=True)
class Sample:
    """One generated example: a context, a question about it, and the answer (correct by construction).

    ``metadata`` is JSON-serialisable and always holds ``params`` (the generator's fields), ``seed``
    (when the sample was drawn from an integer seed) and ``evidence``: ``[start, end)`` word spans of
    ``context`` that the answer depends on -- the tokens a compression policy must keep. Tasks with
    several queries per context (associative recall) also hold ``turns``: a list of
    ``{"question", "answer", "evidence"}`` dicts whose first entry equals ``question``/``answer``.
    """

    task: str
    context: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """Context and question as one whitespace-normalised string (what a completion API receives)."""
        return f"{self.context} {self.question}"

    @property
    def turns(self) -> list[tuple[str, str]]:
        """Every (question, answer) pair about this context; a single pair for single-query tasks."""
        turns = self.metadata.get("turns")
        if not turns:
            return [(self.question, self.answer)]
        return [(t["question"], t["answer"]) for t in turns]

    def split_turns(self) -> list[Sample]:
        """One single-query sample per turn (same context), for scoring every query of a dense task."""
        turns = self.metadata.get("turns")
        if not turns:
            return [self]
        base = {k: v for k, v in self.metadata.items() if k != "turns"}
        return [
            Sample(
                task=self.task,
                context=self.context,
                question=t["question"],
                answer=t["answer"],
                metadata={**base, "evidence": t["evidence"], "turn": i},
            )
            for i, t in enumerate(turns)
        ]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for writing datasets as JSONL)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`."""
        return cls(
            task=data["task"],
            context=data["context"],
            question=data["question"],
            answer=data["answer"],
            metadata=dict(data.get("metadata", {})),
        )


def as_rng(rng: random.Random | int) -> random.Random:
    """A private ``random.Random``: an int seeds a new one; a ``Random`` is used (and advanced) as is.

    Never the global ``random`` state, so samples do not depend on what else ran in the process.
    """
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, bool) or not isinstance(rng, int):
        raise TypeError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")
    return random.Random(rng)


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: parameter checks read as one line each."""
    if not condition:
        raise ValueError(message)


def require_int(name: str, value: object, minimum: int) -> None:
    """Check that a parameter is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    require(value >= minimum, f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class TaskGenerator:
    """Base of every task family: a frozen dataclass of parameters with a :meth:`sample` method.

    Parameters are checked at construction (``ValueError`` with the reason), so a bad configuration
    fails before any sample is drawn. Subclasses implement :meth:`_generate` and extend :meth:`validate`.
    """

    name: ClassVar[str]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` for inconsistent parameters. Subclasses call ``super().validate()``."""

    def sample(self, rng: random.Random | int) -> Sample:
        """Draw one sample; the same int seed gives the same sample on every run and machine."""
        seed = rng if isinstance(rng, int) and not isinstance(rng, bool) else None
        drawn = self._generate(as_rng(rng))
        metadata = {**drawn.metadata, "params": dataclasses.asdict(self), "seed": seed}
        return dataclasses.replace(drawn, metadata=metadata)

    def _generate(self, rng: random.Random) -> Sample:
        """Draw one sample from ``rng`` (metadata ``params``/``seed`` are added by :meth:`sample`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _generate")


def join(words: list[str] | tuple[str, ...]) -> str:
    """Join words with single spaces (the suite's only whitespace)."""
    return " ".join(words)


def join_items(items: list[tuple[str, ...]] | list[list[str]]) -> str:
    """Join multi-word items as ``a b , c d , e f``."""
    return f" {ITEM_SEP} ".join(join(list(item)) for item in items)
