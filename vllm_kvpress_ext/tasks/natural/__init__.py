"""Natural-language long-context tasks for real tokenizers (RULER-style), rendered at any length.

`filler.py` (noise sentences, prose shipped with Python), `tasks.py` (the task templates),
`render.py` (tokenisation to a length, the served and question-agnostic protocols, scoring).
"""

from .filler import FILLER_KINDS, NOISE, FillerKind, filler_sentences, prose_sentences
from .render import HELD_OUT_SEED, NATURAL_PROTOCOLS, NaturalPrompt, NaturalProtocol, render, render_questions, score
from .tasks import NATURAL_TASKS, QUESTIONS_PER_CONTEXT, Draft

__all__ = [
    "FILLER_KINDS",
    "HELD_OUT_SEED",
    "NATURAL_PROTOCOLS",
    "NATURAL_TASKS",
    "NOISE",
    "QUESTIONS_PER_CONTEXT",
    "Draft",
    "FillerKind",
    "NaturalPrompt",
    "NaturalProtocol",
    "filler_sentences",
    "prose_sentences",
    "render",
    "render_questions",
    "score",
]
