"""Synthetic long-context tasks (RULER-like) for scoring KV-cache compression on a self-trained model.

No model weights can be downloaded, so the suite ships its own tasks, tokenizer
(:mod:`vllm_kvpress_ext.tasks.tokenizer`) and, later, a small model trained on them. Tasks are:

- deterministic by seed (``random.Random(seed)``, never global state) with answers correct by
  construction;
- human-readable, whitespace-normalised text over a ~500-word vocabulary, one token per word;
- learnable by a tiny model (single-token keys, disjoint word sets per role, explicit delimiters,
  a dense-supervision family, and curriculum knobs: records, key pool, filler, length);
- sensitive to compression: each sample records in ``metadata["evidence"]`` the context spans its
  answer depends on.

Usage::

    from vllm_kvpress_ext.tasks.synthetic import generate, build_prompt, score
    sample = generate("niah_multikey", seed=0, context_length=512, num_records=8)
    spec = build_prompt(sample, protocol="strict")  # token ids + where to compress
    ok = score(spec, generated_ids)
"""

from __future__ import annotations

from typing import Any

from .aggregation import Aggregation
from .associative_recall import AssociativeRecall
from .base import ANSWER_CUE, ITEM_SEP, Sample, TaskGenerator
from .haystack import FILLER_KINDS, NOISE_SENTENCES, FillerKind
from .niah_multikey import NiahMultiKey
from .niah_multiquery import NiahMultiQuery
from .niah_multivalue import NiahMultiValue
from .prompt import PROTOCOLS, PromptSpec, Protocol, aggregate, build_prompt, chat_messages, score
from .training import TrainingExample, chat_conversation, training_example
from .variable_tracking import VariableTracking

#: Task name -> generator class (a dataclass of parameters with a ``sample(rng_or_seed)`` method).
TASKS: dict[str, type[TaskGenerator]] = {
    cls.name: cls
    for cls in (NiahMultiKey, NiahMultiValue, NiahMultiQuery, VariableTracking, AssociativeRecall, Aggregation)
}


def make(task: str, **params: Any) -> TaskGenerator:
    """The generator for ``task`` with ``params`` (checked: bad values raise ``ValueError``)."""
    try:
        cls = TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}") from None
    try:
        return cls(**params)
    except TypeError as exc:  # unknown keyword: name the valid ones
        fields = sorted(cls.__dataclass_fields__)
        raise ValueError(f"{task}: {exc}; valid parameters: {', '.join(fields)}") from None


def generate(task: str, seed: int, **params: Any) -> Sample:
    """One sample of ``task`` drawn with ``seed`` (same seed and params -> same sample, everywhere)."""
    return make(task, **params).sample(seed)


__all__ = [
    "ANSWER_CUE",
    "FILLER_KINDS",
    "ITEM_SEP",
    "NOISE_SENTENCES",
    "PROTOCOLS",
    "TASKS",
    "Aggregation",
    "AssociativeRecall",
    "FillerKind",
    "NiahMultiKey",
    "NiahMultiQuery",
    "NiahMultiValue",
    "PromptSpec",
    "Protocol",
    "Sample",
    "TaskGenerator",
    "TrainingExample",
    "VariableTracking",
    "aggregate",
    "build_prompt",
    "chat_conversation",
    "chat_messages",
    "generate",
    "make",
    "score",
    "training_example",
]
