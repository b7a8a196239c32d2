"""Prompts for the three evaluation protocols, and exact-match scoring.

The engine compresses; this module only says *where*. A :class:`PromptSpec` is the prompt's token ids
plus ``compress_after``: how many prompt tokens are prefilled before the policy runs. The remaining
prompt tokens are prefilled on top of the compressed cache, then the answer is decoded.

- ``"served"``: compress after the whole prompt -- what a serving engine does. The first answer token
  comes from the prefill's last position, which attended to the *full* cache, so a single-token answer
  is immune to compression; this protocol flatters policies on short answers.
- ``"strict"``: compress before the answer cue ``answer :`` (and the chat ``<|assistant|>`` marker).
  The question itself is seen before compression, so query-aware policies can use it, but every answer
  token is decoded from the compressed cache. Caveat: a model can look the answer up while reading the
  question, and the question's own entries then carry it past compression: with the bundled model a
  5% recent window keeps full accuracy on needles here, as if it had kept them (docs/model.md).
  ``"agnostic"`` has no such leak.
- ``"agnostic"``: compress after the context, before the question: the policy cannot know what will
  be asked (the cache is reused for unknown future queries).

Token layout, chat form (the default; identical to ``apply_chat_template`` on :func:`chat_messages`)::

    <bos> <|user|> CONTEXT QUESTION-BODY answer : <|assistant|>  ->  ANSWER <eos>
                          ^agnostic      ^strict               ^served

Raw form (``chat=False``; identical to encoding ``sample.prompt`` with ``<bos>``) drops the two markers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union, get_args

from tokenizers import Tokenizer

from ..tokenizer import ASSISTANT, BOS, EOS, PAD, SYSTEM, USER, default_tokenizer
from .base import ANSWER_CUE, Sample, join

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenizerLike = Union[Tokenizer, "PreTrainedTokenizerBase"]
Protocol = Literal["served", "strict", "agnostic"]
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
#: Generation stops at these: end of answer, or the model starting a new turn / line.
STOP_TOKENS: tuple[str, ...] = (EOS, USER, SYSTEM, ASSISTANT, PAD, BOS)
STOP_STRINGS: tuple[str, ...] = (*STOP_TOKENS, "\n")


@dataclass(frozen=True)
class PromptSpec:
    """A tokenised prompt and where to compress it.

    - ``token_ids``: the full prompt, ``<bos>`` included.
    - ``compress_after``: prompt tokens prefilled before compression (``0 < compress_after <= len``).
    - ``answer_ids``: the expected answer tokens, without ``<eos>``; decode ``max_new_tokens``
      (= ``len(answer_ids) + 1``) tokens greedily and stop at ``stop_ids``.
    - ``question_start`` / ``cue_start``: token index where the question / the answer cue begins.
    - ``evidence``: ``[start, end)`` token spans the answer depends on (from the sample's metadata;
      empty when the tokenizer is not one-token-per-word, where word spans do not map to tokens).
    """

    token_ids: list[int]
    compress_after: int
    answer_ids: list[int]
    protocol: str = "served"
    task: str = ""
    answer: str = ""
    question_start: int = 0
    cue_start: int = 0
    stop_ids: tuple[int, ...] = ()
    evidence: tuple[tuple[int, int], ...] = ()

    @property
    def max_new_tokens(self) -> int:
        """Answer tokens plus one for ``<eos>``."""
        return len(self.answer_ids) + 1


def encode(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without ``<bos>``, for a ``tokenizers.Tokenizer`` or an HF tokenizer."""
    if not text:
        return []
    if isinstance(tokenizer, Tokenizer):
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_id(tokenizer: TokenizerLike, token: str) -> int:
    """The id of one token; ``ValueError`` if the tokenizer does not have it."""
    tid = token_id_or_none(tokenizer, token)
    if tid is None:
        raise ValueError(f"tokenizer has no token {token!r}")
    return tid


def token_id_or_none(tokenizer: TokenizerLike, token: str) -> int | None:
    """The id of ``token``, or ``None`` if the tokenizer does not have it (HF maps those to ``<unk>``)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.token_to_id(token)
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return tid


def split_question(sample: Sample) -> tuple[str, str]:
    """``(body, cue)`` of the question; every suite question ends with the answer cue."""
    cue = join(ANSWER_CUE)
    words = sample.question.split()
    if tuple(words[-len(ANSWER_CUE) :]) != ANSWER_CUE:
        raise ValueError(f"question must end with the answer cue {cue!r}: {sample.question!r}")
    return join(words[: -len(ANSWER_CUE)]), cue


def chat_messages(sample: Sample) -> list[dict[str, str]]:
    """The single-query chat request for ``sample`` (what ``/v1/chat/completions`` receives)."""
    return [{"role": "user", "content": sample.prompt}]


def build_prompt(
    sample: Sample,
    tokenizer: TokenizerLike | None = None,
    protocol: Protocol = "served",
    *,
    chat: bool = True,
) -> PromptSpec:
    """Tokenise ``sample`` and mark where ``protocol`` compresses (see the module docstring).

    ``tokenizer`` defaults to the suite's own. Pieces are encoded separately, which with the suite's
    word-level tokenizer equals encoding the whole prompt (tests check it against the chat template).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    tok = tokenizer if tokenizer is not None else default_tokenizer()
    body, cue = split_question(sample)
    head = [token_id(tok, BOS)] + ([token_id(tok, USER)] if chat else [])
    context_ids = encode(tok, sample.context)
    body_ids, cue_ids = encode(tok, body), encode(tok, cue)
    tail = [token_id(tok, ASSISTANT)] if chat else []
    ids = [*head, *context_ids, *body_ids, *cue_ids, *tail]

    question_start = len(head) + len(context_ids)
    cue_start = question_start + len(body_ids)
    compress_after = {"served": len(ids), "strict": cue_start, "agnostic": question_start}[protocol]

    evidence: tuple[tuple[int, int], ...] = ()
    if len(context_ids) == len(sample.context.split()):  # one token per word: word spans are token spans
        evidence = tuple((len(head) + s, len(head) + e) for s, e in sample.metadata.get("evidence", []))
    stop_ids = tuple(i for i in (token_id_or_none(tok, t) for t in STOP_TOKENS) if i is not None)
    return PromptSpec(
        token_ids=ids,
        compress_after=compress_after,
        answer_ids=encode(tok, sample.answer),
        protocol=protocol,
        task=sample.task,
        answer=sample.answer,
        question_start=question_start,
        cue_start=cue_start,
        stop_ids=stop_ids,
        evidence=evidence,
    )


def _cut_text(text: str) -> str:
    end = len(text)
    for stop in STOP_STRINGS:
        at = text.find(stop)
        if at != -1:
            end = min(end, at)
    return text[:end]


def score(
    target: Sample | PromptSpec,
    generated: str | Sequence[int],
    tokenizer: TokenizerLike | None = None,
) -> bool:
    """Exact match of the generated answer: the words (or ids) up to the first stop must equal the answer.

    ``generated`` is the decoded continuation (text) or its token ids. Generation is cut at ``<eos>``,
    a newline, or a chat role marker; surrounding whitespace is ignored, nothing else is normalised.
    Ids against a :class:`PromptSpec` compare ids; ids against a :class:`Sample` are decoded with
    ``tokenizer`` (default: the suite's).
    """
    if isinstance(generated, str):
        return _cut_text(generated).split() == target.answer.split()
    ids = list(generated)
    if isinstance(target, PromptSpec):
        stops = set(target.stop_ids)
        cut = next((n for n, i in enumerate(ids) if i in stops), len(ids))
        return ids[:cut] == target.answer_ids
    tok = tokenizer if tokenizer is not None else default_tokenizer()
    text = tok.decode(ids, skip_special_tokens=False)
    return score(target, text if isinstance(text, str) else " ".join(text))


def aggregate(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
    """Exact-match accuracy per task from ``(task, correct)`` pairs.

    Adds ``"all"`` (over every result) and ``"macro"`` (mean of the per-task accuracies, so a task with
    more samples does not dominate). Empty input gives ``{}``.
    """
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for task, correct in results:
        hits[task][0] += int(bool(correct))
        hits[task][1] += 1
    if not hits:
        return {}
    out = {task: h / n for task, (h, n) in sorted(hits.items())}
    total = sum(n for _, n in hits.values())
    out["all"] = sum(h for h, _ in hits.values()) / total
    out["macro"] = sum(out[t] for t in hits) / len(hits)
    return out
