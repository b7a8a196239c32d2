"""Multi-key needle in a haystack: many key/value records in filler, one of them queried.

The distractor records look exactly like the needle, so keeping "some record-like tokens" is not
enough: a policy must keep the queried record's value, which only the question identifies.

Example (``context_length=None``, 3 records)::

    context:  key owl 17 . key fox 53 . key cat 8 .
    question: what is key fox ? answer :
    answer:   53
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Sample, join, require_int
from .haystack import filler_budget, layout, measured_budget, validate_depth
from .records import KeyValueParams, key_question, record, record_length


@dataclass(frozen=True, kw_only=True)
class NiahMultiKey(KeyValueParams):
    """Parameters (defaults in brackets).

    - ``num_records`` [8]: key/value records in the context; one is queried, the rest distract.
    - ``depth`` [None]: where the queried record sits, as a fraction of the filler (0 = start,
      1 = end); ``None`` places it uniformly at random like the others.
    - inherited: ``context_length`` [256], ``filler`` ["random"], ``num_keys`` [128], ``key_length`` [1],
      ``num_values`` [100], ``value_length`` [1].

    Keys and values are distinct across records, so the answer is unique.
    """

    name: ClassVar[str] = "niah_multikey"

    num_records: int = 8
    depth: float | None = None

    def validate(self) -> None:
        super().validate()
        require_int("num_records", self.num_records, 1)
        self.require_distinct(self.num_records)
        validate_depth(self.depth)
        filler_budget(self.name, self.context_length, self._needed())

    def _needed(self) -> int:
        question = self.key_length + 6
        return self.num_records * record_length(self.key_length, self.value_length) + question

    def _generate(self, rng: random.Random) -> Sample:
        keys = self.draw_keys(rng, self.num_records)
        values = self.draw_values(rng, self.num_records)
        target = rng.randrange(self.num_records)
        question = key_question(keys[target])
        blocks = [record(k, v) for k, v in zip(keys, values, strict=True)]
        words, spans = layout(
            rng,
            blocks,
            n_filler=measured_budget(self.name, self.context_length, blocks, question),
            kind=self.filler,
            needles=[target],
            depth=self.depth,
        )
        start, end = spans[target]
        return Sample(
            task=self.name,
            context=join(words),
            question=join(question),
            answer=join(values[target]),
            metadata={
                "evidence": [[start, end]],
                "query_key": join(keys[target]),
                "needle_depth": start / max(1, len(words)),
                "num_context_tokens": len(words),
            },
        )
