"""Multi-value needle: one key has several records, and all its values must be returned.

Every one of the queried key's records is evidence, so a policy that keeps only the most salient
needle loses the answer. Values are returned in their order of appearance in the context (a
deterministic order makes exact match well defined).

Example (``context_length=None``, 2 values, 1 distractor)::

    context:  key fox 53 . key owl 17 . key fox 8 .
    question: what are all values of key fox ? answer :
    answer:   53 , 8
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import ANSWER_CUE, Sample, join, join_items, require_int
from .haystack import filler_budget, layout, measured_budget, validate_depth
from .records import KeyValueParams, record, record_length


@dataclass(frozen=True, kw_only=True)
class NiahMultiValue(KeyValueParams):
    """Parameters (defaults in brackets).

    - ``values_per_key`` [4]: records of the queried key (each with a different value).
    - ``num_distractors`` [4]: records of other keys, one each.
    - ``depth`` [None]: if given, the queried key's records sit together at this fraction of the
      filler; ``None`` scatters them at random.
    - inherited: ``context_length`` [256], ``filler`` ["random"], ``num_keys`` [128], ``key_length`` [1],
      ``num_values`` [100], ``value_length`` [1].
    """

    name: ClassVar[str] = "niah_multivalue"

    values_per_key: int = 4
    num_distractors: int = 4
    depth: float | None = None

    def validate(self) -> None:
        super().validate()
        require_int("values_per_key", self.values_per_key, 1)
        require_int("num_distractors", self.num_distractors, 0)
        self.require_distinct(1 + self.num_distractors, "1 + num_distractors")
        self.require_distinct(self.values_per_key + self.num_distractors, "values_per_key + num_distractors")
        validate_depth(self.depth)
        filler_budget(self.name, self.context_length, self._needed())

    def _needed(self) -> int:
        records = (self.values_per_key + self.num_distractors) * record_length(self.key_length, self.value_length)
        return records + self.key_length + 9

    def _generate(self, rng: random.Random) -> Sample:
        keys = self.draw_keys(rng, 1 + self.num_distractors)
        values = self.draw_values(rng, self.values_per_key + self.num_distractors)
        target = keys[0]
        pairs = [(target, v) for v in values[: self.values_per_key]]
        pairs += list(zip(keys[1:], values[self.values_per_key :], strict=True))
        rng.shuffle(pairs)
        needles = [i for i, (k, _) in enumerate(pairs) if k == target]
        question = ["what", "are", "all", "values", "of", "key", *target, "?", *ANSWER_CUE]
        blocks = [record(k, v) for k, v in pairs]
        words, spans = layout(
            rng,
            blocks,
            n_filler=measured_budget(self.name, self.context_length, blocks, question),
            kind=self.filler,
            needles=needles,
            depth=self.depth,
        )
        needles.sort(key=lambda i: spans[i])
        return Sample(
            task=self.name,
            context=join(words),
            question=join(question),
            answer=join_items([pairs[i][1] for i in needles]),
            metadata={
                "evidence": [list(spans[i]) for i in needles],
                "query_key": join(target),
                "num_context_tokens": len(words),
            },
        )
