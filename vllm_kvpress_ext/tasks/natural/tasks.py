"""RULER-style natural-language tasks: needles, variable chains and word counting in readable English.

Each task is a function `(rng, size, filler) -> Draft`: `size` is how much haystack to use
(filler sentences, or list length for the word-counting tasks), and the renderer
(`render.py`) searches the largest size whose prompt fits the requested number of tokens of the
model's own tokenizer. Templates follow RULER's wording; answers are scored by whether each
reference string appears in the model's continuation (RULER's "string match all").
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .filler import FillerKind, filler_sentences

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
_ADJECTIVES = (  # noqa: SIM905 (a word list reads better as text)
    "quiet bright ancient gentle rapid silver golden hidden frozen humble brave clever curious "
    "eager fancy fierce jolly lively mighty proud shiny sleepy tidy witty bold calm dusty grand "
    "happy lucky"
).split()
_NOUNS = (  # noqa: SIM905 (a word list reads better as text)
    "river mountain garden window forest harbor castle meadow lantern valley island bridge candle "
    "compass falcon orchard canyon desert glacier temple village tower anchor basket feather mirror "
    "pebble rocket saddle violin"
).split()


@dataclass(frozen=True)
class Draft:
    """A sample before tokenisation: context sentences, the question, and the reference answers."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int


TaskFn = Callable[[random.Random, int, FillerKind], Draft]


def _number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in _ADJECTIVES for b in _NOUNS]
    return rng.sample(pairs, n)


def _haystack(rng: random.Random, size: int, filler: FillerKind, needles: list[str]) -> str:
    """`size` filler sentences with each needle sentence at a random depth (needles keep their order)."""
    sentences = filler_sentences(filler, size, rng)
    spots = sorted(rng.randint(0, size) for _ in needles)
    for offset, (spot, needle) in enumerate(zip(spots, needles, strict=True)):
        sentences.insert(spot + offset, needle)
    return " ".join(sentences)


def _niah(
    rng: random.Random,
    size: int,
    filler: FillerKind,
    num_keys: int,
    values_per_key: int,
    queried: int,
    question: int = 0,
) -> Draft:
    """Needles for `num_keys` keys; the question asks for keys `question` .. `question + queried - 1`.

    The question's index draws nothing from `rng`, so every question of one seed has the same context.
    """
    if not 0 <= question <= num_keys - queried:
        raise ValueError(f"question {question} is out of range: this task asks about {num_keys - queried + 1} keys")
    keys = _keys(rng, num_keys)
    values = {k: [_number(rng) for _ in range(values_per_key)] for k in keys}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
    rng.shuffle(needles)
    asked = keys[question : question + queried]
    context = f"{NIAH_INTRO}\n{_haystack(rng, size, filler, needles)}"
    answers = tuple(v for k in asked for v in values[k])
    if queried == 1 and values_per_key == 1:
        text = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
    else:
        what = ", ".join(asked)
        text = f"What are all the special magic numbers for {what} mentioned in the provided text?"
        prefix = f"The special magic numbers for {what} mentioned in the provided text are"
    return Draft(context, text, prefix, answers, max_new_tokens=8 + 8 * len(answers))


def passkey(rng: random.Random, size: int, filler: FillerKind) -> Draft:
    key = _number(rng)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    context = f"{PASSKEY_INTRO}\n{_haystack(rng, size, filler, [needle])}"
    return Draft(context, "What is the pass key?", "The pass key is", (key,), max_new_tokens=10)


def niah_single(rng: random.Random, size: int, filler: FillerKind) -> Draft:
    return _niah(rng, size, filler, num_keys=1, values_per_key=1, queried=1)


def niah_multikey(rng: random.Random, size: int, filler: FillerKind, question: int = 0) -> Draft:
    return _niah(rng, size, filler, num_keys=4, values_per_key=1, queried=1, question=question)


def niah_multivalue(rng: random.Random, size: int, filler: FillerKind) -> Draft:
    return _niah(rng, size, filler, num_keys=1, values_per_key=4, queried=1)


def niah_multiquery(rng: random.Random, size: int, filler: FillerKind) -> Draft:
    return _niah(rng, size, filler, num_keys=4, values_per_key=1, queried=4)


def variable_tracking(rng: random.Random, size: int, filler: FillerKind, hops: int = 4) -> Draft:
    """One chain `VAR A = 12345`, `VAR B = VAR A`, ...; every variable holding the value is the answer."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = _number(rng)
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    context = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n" + _haystack(
        rng, size, filler, needles
    )
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"According to the chain(s) of variable assignment in the text above, {len(names)} variables are "
        f"assigned the value {value}, they are:"
    )
    return Draft(context, question, prefix, tuple(names), max_new_tokens=8 * len(names) + 8)


WORDS_FILE = Path(__file__).with_name("words.txt")


@lru_cache(maxsize=1)
def common_word_vocabulary() -> tuple[str, ...]:
    """The 1,207 English words (four letters or more, sorted) that the word-counting task draws from.

    They ship with the package (`words.txt`), so a sample is the same on every machine and Python. The
    list is the set of words of the filler prose as CPython 3.11.7 carries it, frozen: the figures
    measured before it shipped are reproduced draw for draw.
    """
    return tuple(WORDS_FILE.read_text().split())


def common_words(rng: random.Random, size: int, filler: FillerKind, common: int = 10, repeats: int = 12) -> Draft:
    """A numbered word list: `common` words `repeats` times each, `size` other words 3 times at most (as
    many as the vocabulary holds: 1,197)."""
    del filler  # the list itself is the haystack
    vocabulary = list(common_word_vocabulary())
    rng.shuffle(vocabulary)
    frequent, rare = vocabulary[:common], vocabulary[common : common + max(1, size)]
    items = frequent * repeats + [w for i, w in enumerate(rare) for _ in range(1 + i % 3)]
    rng.shuffle(items)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    context = f"Below is a numbered list of words. In these words, some appear more often than others.\n{listing}"
    question = f"What are the {common} most common words in the above list?"
    prefix = f"The top {common} words that appear most often in the list are:"
    return Draft(context, question, prefix, tuple(frequent), max_new_tokens=6 * common + 8)


def frequent_words(rng: random.Random, size: int, filler: FillerKind, top: int = 3, alpha: float = 2.0) -> Draft:
    """Coded words drawn with Zipf frequencies (counts strictly decreasing over the top ranks)."""
    del filler
    vocabulary: list[str] = []
    while len(vocabulary) < 50:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
        if word not in vocabulary:
            vocabulary.append(word)
    total = max(top * 10, size)
    counts = [max(1, round(total / (rank + 1) ** alpha)) for rank in range(len(vocabulary))]
    items = [w for w, c in zip(vocabulary, counts, strict=True) for _ in range(c)]
    rng.shuffle(items)
    context = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        f"frequently appeared coded words.\n{' '.join(items)}"
    )
    question = "What are the three most frequently appeared words in the above coded text?"
    prefix = "According to the coded text above, the three most frequently appeared words are:"
    return Draft(context, question, prefix, tuple(vocabulary[:top]), max_new_tokens=20)


#: Tasks whose context answers several distinct questions (their builder takes `question`), and how many:
#: what a reused compressed context is asked again and again.
QUESTIONS_PER_CONTEXT: dict[str, int] = {"nl_niah_multikey": 4}

#: Task name -> builder. Names carry an `nl_` prefix to stay apart from the synthetic suite's.
NATURAL_TASKS: dict[str, TaskFn] = {
    "nl_passkey": passkey,
    "nl_niah_single": niah_single,
    "nl_niah_multikey": niah_multikey,
    "nl_niah_multivalue": niah_multivalue,
    "nl_niah_multiquery": niah_multiquery,
    "nl_variable_tracking": variable_tracking,
    "nl_common_words": common_words,
    "nl_frequent_words": frequent_words,
}
