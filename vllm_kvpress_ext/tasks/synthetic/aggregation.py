"""Aggregation: count item words scattered through the filler (RULER's common / frequent words).

Item words (fruits, vegetables) occur several times each among the filler. Unlike the needle tasks,
the evidence is spread thin: no single token matters much, but a policy that drops a share of the
occurrences shifts the counts. Two queries:

- ``"most_common"``: ``what are 2 most common words ? answer :`` -> the ``top_k`` most frequent items,
  most frequent first. Counts are drawn so the top ``top_k`` are strictly ordered and strictly above
  every other item, so the answer is unique.
- ``"count"``: ``how many times does fig appear ? answer :`` -> ``3``. Every occurrence of that item
  is evidence.

Example (``context_length=None``, 3 items, top 1)::

    context:  fig corn fig apple fig corn
    question: what are 1 most common words ? answer :
    answer:   fig
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from ..tokenizer import ITEM_WORDS, VALUE_WORDS
from .base import ANSWER_CUE, Sample, join, join_items, require, require_int
from .haystack import HaystackParams, filler_budget, layout, measured_budget

AggregationQuery = Literal["most_common", "count"]
QUESTION_LENGTH = 9  # both question forms; generation measures the real one


@dataclass(frozen=True, kw_only=True)
class Aggregation(HaystackParams):
    """Parameters (defaults in brackets).

    - ``query`` ["most_common"]: ``"most_common"`` or ``"count"`` (see the module docstring).
    - ``num_distinct`` [8]: distinct item words in the context.
    - ``top_k`` [1]: items to return for ``"most_common"``.
    - ``max_count`` [6]: the most occurrences of one item (at most 99: counts are number words).
    - ``distractor_max_count`` [2]: ``"most_common"`` only -- the non-top items occur 1..this many
      times, the top items strictly more.
    - ``num_items`` [64]: item pool size (first N item words).
    - inherited: ``context_length`` [256], ``filler`` ["random"].
    """

    name: ClassVar[str] = "aggregation"

    query: AggregationQuery = "most_common"
    num_distinct: int = 8
    top_k: int = 1
    max_count: int = 6
    distractor_max_count: int = 2
    num_items: int = len(ITEM_WORDS)

    def validate(self) -> None:
        super().validate()
        queries = get_args(AggregationQuery)
        require(self.query in queries, f"query must be one of {queries}, got {self.query!r}")
        require_int("num_items", self.num_items, 1)
        require(self.num_items <= len(ITEM_WORDS), f"num_items must be <= {len(ITEM_WORDS)}, got {self.num_items}")
        require_int("num_distinct", self.num_distinct, 1)
        require(
            self.num_distinct <= self.num_items,
            f"num_distinct={self.num_distinct} must be <= num_items={self.num_items}",
        )
        require_int("max_count", self.max_count, 1)
        require(self.max_count < len(VALUE_WORDS), f"max_count must be <= {len(VALUE_WORDS) - 1}, got {self.max_count}")
        if self.query == "most_common":
            require_int("top_k", self.top_k, 1)
            require(self.top_k <= self.num_distinct, f"top_k={self.top_k} must be <= num_distinct={self.num_distinct}")
            require_int("distractor_max_count", self.distractor_max_count, 1)
            room = self.max_count - self.distractor_max_count
            require(
                self.top_k <= room,
                f"{self.name}: top_k={self.top_k} needs {self.top_k} distinct counts above "
                f"distractor_max_count={self.distractor_max_count} but max_count={self.max_count} "
                f"leaves {max(room, 0)}",
            )
        filler_budget(self.name, self.context_length, self._max_items() + QUESTION_LENGTH)

    def _max_items(self) -> int:
        """The most item occurrences a sample can have (the length check must hold for every draw)."""
        if self.query == "count":
            return self.num_distinct * self.max_count
        top = sum(range(self.max_count - self.top_k + 1, self.max_count + 1))
        return top + (self.num_distinct - self.top_k) * self.distractor_max_count

    def _counts(self, rng: random.Random) -> list[int]:
        if self.query == "count":
            return [rng.randint(1, self.max_count) for _ in range(self.num_distinct)]
        top = sorted(rng.sample(range(self.distractor_max_count + 1, self.max_count + 1), self.top_k), reverse=True)
        rest = [rng.randint(1, self.distractor_max_count) for _ in range(self.num_distinct - self.top_k)]
        return top + rest

    def _generate(self, rng: random.Random) -> Sample:
        items = rng.sample(ITEM_WORDS[: self.num_items], self.num_distinct)
        counts = self._counts(rng)
        occurrences = [[item] for item, n in zip(items, counts, strict=True) for _ in range(n)]
        rng.shuffle(occurrences)
        target = 0 if self.query == "most_common" else rng.randrange(self.num_distinct)
        if self.query == "most_common":
            question = ["what", "are", str(self.top_k), "most", "common", "words", "?", *ANSWER_CUE]
            answer = join_items([[w] for w in items[: self.top_k]])
        else:
            question = ["how", "many", "times", "does", items[target], "appear", "?", *ANSWER_CUE]
            answer = str(counts[target])
        n_filler = measured_budget(self.name, self.context_length, occurrences, question)
        words, spans = layout(rng, occurrences, n_filler=n_filler, kind=self.filler)
        if self.query == "most_common":
            evidence = sorted(spans)
        else:
            evidence = sorted(s for s, occ in zip(spans, occurrences, strict=True) if occ[0] == items[target])
        return Sample(
            task=self.name,
            context=join(words),
            question=join(question),
            answer=answer,
            metadata={
                "evidence": [list(s) for s in evidence],
                "counts": dict(zip(items, counts, strict=True)),
                "query": self.query,
                "num_context_tokens": len(words),
            },
        )
