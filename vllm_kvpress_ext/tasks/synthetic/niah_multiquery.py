"""Multi-query needle: several keys are queried at once; their values are returned in query order.

A policy must keep several needles scattered over the context at once, which stresses per-head and
per-layer budget allocation more than a single needle does.

Example (``context_length=None``, 3 records, 2 queries)::

    context:  key owl 17 . key fox 53 . key cat 8 .
    question: what are keys cat , owl ? answer :
    answer:   8 , 17
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import ANSWER_CUE, ITEM_SEP, Sample, join, join_items, require, require_int
from .haystack import filler_budget, layout, measured_budget, validate_depth
from .records import KeyValueParams, record, record_length


@dataclass(frozen=True, kw_only=True)
class NiahMultiQuery(KeyValueParams):
    """Parameters (defaults in brackets).

    - ``num_records`` [8]: key/value records in the context.
    - ``num_queries`` [2]: how many of them the question asks for (in a random order).
    - ``depth`` [None]: if given, the queried records sit together at this fraction of the filler.
    - inherited: ``context_length`` [256], ``filler`` ["random"], ``num_keys`` [128], ``key_length`` [1],
      ``num_values`` [100], ``value_length`` [1].
    """

    name: ClassVar[str] = "niah_multiquery"

    num_records: int = 8
    num_queries: int = 2
    depth: float | None = None

    def validate(self) -> None:
        super().validate()
        require_int("num_records", self.num_records, 1)
        require_int("num_queries", self.num_queries, 1)
        require(
            self.num_queries <= self.num_records,
            f"num_queries={self.num_queries} must be <= num_records={self.num_records}",
        )
        self.require_distinct(self.num_records)
        validate_depth(self.depth)
        filler_budget(self.name, self.context_length, self._needed())

    def _needed(self) -> int:
        question = self.num_queries * (self.key_length + 1) + 5
        return self.num_records * record_length(self.key_length, self.value_length) + question

    def _generate(self, rng: random.Random) -> Sample:
        keys = self.draw_keys(rng, self.num_records)
        values = self.draw_values(rng, self.num_records)
        queried = rng.sample(range(self.num_records), self.num_queries)
        asked: list[str] = []
        for n, i in enumerate(queried):
            asked += [ITEM_SEP, *keys[i]] if n else list(keys[i])
        question = ["what", "are", "keys", *asked, "?", *ANSWER_CUE]
        blocks = [record(k, v) for k, v in zip(keys, values, strict=True)]
        words, spans = layout(
            rng,
            blocks,
            n_filler=measured_budget(self.name, self.context_length, blocks, question),
            kind=self.filler,
            needles=sorted(queried),
            depth=self.depth,
        )
        return Sample(
            task=self.name,
            context=join(words),
            question=join(question),
            answer=join_items([values[i] for i in queried]),
            metadata={
                "evidence": [list(spans[i]) for i in queried],
                "query_keys": [join(keys[i]) for i in queried],
                "num_context_tokens": len(words),
            },
        )
