"""Key/value records, shared by the needle families and associative recall.

A record reads ``key <key words> <value words> .`` -- e.g. ``key fox 53 .`` -- and the question
about it ``what is key fox ? answer :``. The ``key`` / ``.`` markers delimit records, and keys
(animals) and values (numbers) come from disjoint word sets, so a multi-token key or value is still
unambiguous to read.

Why the value follows the key directly: a model finds a value by matching the token before it
against the queried key. With a word in between (the first format was ``key fox is 53 .``) the
match is two tokens back; with the value right after the key it is the one-token-back pattern of
induction heads, the simplest retrieval circuit a small model can form (docs/model.md records
what training found).

Curriculum knobs: ``num_keys`` and ``num_values`` take the *first* N words of each role set (a fixed
pool, so a curriculum that grows the pool keeps the words already learned); ``key_length`` and
``value_length`` make keys / values sequences of words (single-token keys are much easier to learn).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..tokenizer import KEY_WORDS, VALUE_WORDS
from .base import ANSWER_CUE, require, require_int
from .haystack import HaystackParams

Words = tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class KeyValueParams(HaystackParams):
    """Key and value pools shared by the key/value families.

    - ``num_keys``: size of the key pool (first N animals, at most 128).
    - ``key_length``: words per key (1 = single-token keys, the learnable default).
    - ``num_values``: size of the value pool (first N of the numbers 0..99).
    - ``value_length``: words per value.
    """

    num_keys: int = len(KEY_WORDS)
    key_length: int = 1
    num_values: int = len(VALUE_WORDS)
    value_length: int = 1

    def validate(self) -> None:
        super().validate()
        require_int("num_keys", self.num_keys, 1)
        require(self.num_keys <= len(KEY_WORDS), f"num_keys must be <= {len(KEY_WORDS)}, got {self.num_keys}")
        require_int("key_length", self.key_length, 1)
        require_int("num_values", self.num_values, 1)
        require(self.num_values <= len(VALUE_WORDS), f"num_values must be <= {len(VALUE_WORDS)}, got {self.num_values}")
        require_int("value_length", self.value_length, 1)

    @property
    def distinct_keys(self) -> int:
        """How many different keys the pool can form (``num_keys ** key_length``)."""
        return int(self.num_keys**self.key_length)

    @property
    def distinct_values(self) -> int:
        """How many different values the pool can form (``num_values ** value_length``)."""
        return int(self.num_values**self.value_length)

    def require_distinct(self, records: int, what: str = "num_records") -> None:
        """Records need distinct keys (one answer per key) and distinct values (one record per value)."""
        require(
            records <= self.distinct_keys,
            f"{self.name}: {what}={records} needs {records} distinct keys but num_keys={self.num_keys} "
            f"with key_length={self.key_length} gives only {self.distinct_keys}",
        )
        require(
            records <= self.distinct_values,
            f"{self.name}: {what}={records} needs {records} distinct values but num_values={self.num_values} "
            f"with value_length={self.value_length} gives only {self.distinct_values}",
        )

    def draw_keys(self, rng: random.Random, n: int) -> list[Words]:
        """``n`` distinct keys, uniformly among all ``distinct_keys``."""
        return draw_distinct(rng, KEY_WORDS[: self.num_keys], self.key_length, n)

    def draw_values(self, rng: random.Random, n: int) -> list[Words]:
        """``n`` distinct values, uniformly among all ``distinct_values``."""
        return draw_distinct(rng, VALUE_WORDS[: self.num_values], self.value_length, n)


def draw_distinct(rng: random.Random, pool: tuple[str, ...], length: int, n: int) -> list[Words]:
    """``n`` distinct ``length``-word sequences over ``pool``: sample indices, then spell them in base ``len(pool)``.

    Sampling indices (rather than rejecting duplicates) is exact and fast even when ``n`` is close to
    the number of possible sequences.
    """
    base = len(pool)
    out = []
    for index in rng.sample(range(base**length), n):
        digits = []
        for _ in range(length):
            index, d = divmod(index, base)
            digits.append(pool[d])
        out.append(tuple(reversed(digits)))
    return out


def record(key: Words, value: Words) -> list[str]:
    """``key <key> <value> .``"""
    return ["key", *key, *value, "."]


def record_length(key_length: int, value_length: int) -> int:
    """Tokens in one record."""
    return key_length + value_length + 2


def key_question(key: Words) -> list[str]:
    """``what is key <key> ? answer :``"""
    return ["what", "is", "key", *key, "?", *ANSWER_CUE]
