"""Natural filler text: RULER's repeated noise sentences, or prose that ships with Python itself.

The prose is the English text of the Python language reference that every CPython installation
carries in `pydoc_data.topics` (the `help()` topics): ordinary sentences kept in their original
order, so the haystack reads as coherent documentation rather than a word salad. Nothing is
downloaded; a sample's seed picks where in that text its haystack starts. That text changes between
Python versions, so a prose sample is the same only on the same Python (the noise filler, and the
word list of the word-counting task, `words.txt`, are the same everywhere).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Literal, get_args

FillerKind = Literal["noise", "prose"]
FILLER_KINDS: tuple[str, ...] = get_args(FillerKind)

#: RULER's noise haystack, repeated.
NOISE: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PLAIN_SENTENCE = re.compile(r"[A-Za-z ,;'()\-]+[.]")


@lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Plain English sentences of the language reference (letters and light punctuation only, no code)."""
    from pydoc_data.topics import topics  # part of the standard library

    text = re.sub(r"\s+", " ", " ".join(topics[name] for name in sorted(topics)))
    sentences = (s.strip() for s in _SENTENCE_END.split(text))
    return tuple(s for s in sentences if 40 <= len(s) <= 200 and _PLAIN_SENTENCE.fullmatch(s))


def filler_sentences(kind: FillerKind, count: int, rng: random.Random) -> list[str]:
    """`count` filler sentences: the noise cycle, or consecutive prose from a random starting point."""
    if kind not in FILLER_KINDS:
        raise ValueError(f"filler must be one of {FILLER_KINDS}, got {kind!r}")
    source = NOISE if kind == "noise" else prose_sentences()
    start = 0 if kind == "noise" else rng.randrange(len(source))
    return [source[(start + i) % len(source)] for i in range(count)]
