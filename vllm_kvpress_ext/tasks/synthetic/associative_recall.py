"""Associative recall: a dense list of key/value records, every record queried.

This is the family to *train* on. A needle sample supervises one answer token per context; here every
record is queried once, so one context supervises ``num_records`` answers, and by default there is no
filler (``context_length=None``) so nothing but the binding itself has to be learned. Measured on this
project's CPU setup, dense recall with single-token keys is the task a ~1M-parameter model starts to
learn within minutes, where sparse needles stayed near chance.

Format. ``question``/``answer`` hold the *first* query, so a sample is also a normal single-query item
for :func:`~vllm_kvpress_ext.tasks.synthetic.prompt.build_prompt` and
:func:`~vllm_kvpress_ext.tasks.synthetic.prompt.score`. ``metadata["turns"]`` holds every query in asking order
as ``{"question", "answer", "evidence"}`` dicts (turn 0 = ``question``/``answer``).
:meth:`Sample.split_turns` gives one single-query sample per turn (to score every record), and
:func:`~vllm_kvpress_ext.tasks.synthetic.training.training_example` renders all turns as one multi-turn
training sequence with the answer spans marked.

Example (3 records)::

    context:  key owl 17 . key fox 53 . key cat 8 .
    turns:    what is key fox ? answer : -> 53 | what is key cat ? answer : -> 8 | what is key owl ? answer : -> 17
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import Sample, join, require, require_int
from .haystack import filler_budget, layout, measured_budget
from .records import KeyValueParams, key_question, record, record_length


@dataclass(frozen=True, kw_only=True)
class AssociativeRecall(KeyValueParams):
    """Parameters (defaults in brackets).

    - ``num_records`` [16]: records in the context.
    - ``num_queries`` [None]: turns to ask (distinct records, random order); ``None`` = every record.
    - ``context_length`` [None]: no filler by default; if given, the context + *first* question are
      padded with filler to exactly this many tokens (later turns come on top).
    - ``num_keys`` [64], ``num_values`` [64]: smaller pools than the needle tasks, for learnability.
    - inherited: ``filler`` ["random"], ``key_length`` [1], ``value_length`` [1].
    """

    name: ClassVar[str] = "associative_recall"

    context_length: int | None = None
    num_keys: int = 64
    num_values: int = 64
    num_records: int = 16
    num_queries: int | None = None

    def validate(self) -> None:
        super().validate()
        require_int("num_records", self.num_records, 1)
        if self.num_queries is not None:
            require_int("num_queries", self.num_queries, 1)
            require(
                self.num_queries <= self.num_records,
                f"num_queries={self.num_queries} must be <= num_records={self.num_records}",
            )
        self.require_distinct(self.num_records)
        filler_budget(self.name, self.context_length, self._needed())

    def _needed(self) -> int:
        return self.num_records * record_length(self.key_length, self.value_length) + self.key_length + 6

    def _generate(self, rng: random.Random) -> Sample:
        keys = self.draw_keys(rng, self.num_records)
        values = self.draw_values(rng, self.num_records)
        asked = rng.sample(range(self.num_records), self.num_queries or self.num_records)
        blocks = [record(k, v) for k, v in zip(keys, values, strict=True)]
        words, spans = layout(
            rng,
            blocks,
            n_filler=measured_budget(self.name, self.context_length, blocks, key_question(keys[asked[0]])),
            kind=self.filler,
        )
        turns: list[dict[str, Any]] = [
            {"question": join(key_question(keys[i])), "answer": join(values[i]), "evidence": [list(spans[i])]}
            for i in asked
        ]
        return Sample(
            task=self.name,
            context=join(words),
            question=turns[0]["question"],
            answer=turns[0]["answer"],
            metadata={"evidence": turns[0]["evidence"], "turns": turns, "num_context_tokens": len(words)},
        )
