"""Training view of a sample: one token sequence with the answer spans marked for the loss.

Every turn of a sample (one for most families, one per record for associative recall) becomes a
question followed by its answer and ``<eos>``; only answer tokens and ``<eos>`` are targets, so the
model is trained to answer, not to predict random filler. Training on ``<eos>`` teaches it to stop,
which exact-match scoring needs.

Chat form (default), identical to ``apply_chat_template`` on the turns as user/assistant messages::

    <bos> <|user|> CONTEXT Q1 <|assistant|> A1 <eos> <|user|> Q2 <|assistant|> A2 <eos> ...

Raw form (``chat=False``): ``<bos> CONTEXT Q1 A1 <eos> Q2 A2 <eos> ...``. The first turn of either form
is exactly the evaluation prompt of :func:`~vllm_kvpress_ext.tasks.synthetic.prompt.build_prompt` followed by
the answer, so what is trained is what is scored.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tokenizer import ASSISTANT, BOS, EOS, USER, default_tokenizer
from .base import Sample
from .prompt import TokenizerLike, encode, token_id


@dataclass(frozen=True)
class TrainingExample:
    """Token ids and the ``[start, end)`` positions whose tokens are targets (answer + ``<eos>``)."""

    token_ids: list[int]
    answer_spans: list[tuple[int, int]]

    @property
    def loss_mask(self) -> list[bool]:
        """True at target positions (position t is predicted from the tokens before it)."""
        mask = [False] * len(self.token_ids)
        for start, end in self.answer_spans:
            mask[start:end] = [True] * (end - start)
        return mask

    def labels(self, ignore_index: int = -100) -> list[int]:
        """HF-style labels: the token id at target positions, ``ignore_index`` elsewhere (unshifted)."""
        return [t if m else ignore_index for t, m in zip(self.token_ids, self.loss_mask, strict=True)]


def training_example(
    sample: Sample,
    tokenizer: TokenizerLike | None = None,
    *,
    chat: bool = True,
    all_turns: bool = True,
) -> TrainingExample:
    """Render ``sample`` (all its turns, or only the first) as a training sequence."""
    tok = tokenizer if tokenizer is not None else default_tokenizer()
    eos = token_id(tok, EOS)
    user, assistant = (token_id(tok, USER), token_id(tok, ASSISTANT)) if chat else (None, None)
    ids = [token_id(tok, BOS)]
    spans: list[tuple[int, int]] = []
    turns = sample.turns if all_turns else sample.turns[:1]
    for n, (question, answer) in enumerate(turns):
        if user is not None:
            ids.append(user)
        if n == 0:
            ids += encode(tok, sample.context)
        ids += encode(tok, question)
        if assistant is not None:
            ids.append(assistant)
        start = len(ids)
        ids += [*encode(tok, answer), eos]
        spans.append((start, len(ids)))
    return TrainingExample(token_ids=ids, answer_spans=spans)


def chat_conversation(sample: Sample, *, all_turns: bool = True) -> list[dict[str, str]]:
    """The turns as chat messages (context in the first user message), answers included."""
    turns = sample.turns if all_turns else sample.turns[:1]
    messages = []
    for n, (question, answer) in enumerate(turns):
        content = f"{sample.context} {question}" if n == 0 else question
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return messages
