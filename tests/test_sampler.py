"""The sampler's filters, through the public `sample`: which tokens can be drawn, and how often.

Each case draws many tokens from fixed logits with a seeded generator and compares the draws with
the distribution the parameters define, computed here by hand: the support must be exact (a token
outside top-k / top-p is never drawn, every token inside is), and the frequencies must match the
renormalised probabilities within a few standard errors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from vllm_kvpress_ext.engine.sampler import sample
from vllm_kvpress_ext.engine.sampling_params import SamplingParams

DRAWS = 3000
# Probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02 (temperature 1), in a shuffled vocabulary order.
PROBS = [0.05, 0.4, 0.02, 0.15, 0.25, 0.03, 0.1]
LOGITS = torch.tensor(PROBS).log()


@dataclass
class Row:
    """What the sampler reads of a request: its parameters, generator and tokens so far (none here)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    batch = logits.expand(DRAWS, -1)
    return sample(batch, [Row(params, generator)] * DRAWS)


def check_distribution(tokens: list[int], expected: dict[int, float]) -> None:
    """Support exactly `expected`'s keys, each frequency within 4 standard errors of its probability."""
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == set(expected)
    for token, p in expected.items():
        sigma = math.sqrt(p * (1 - p) / len(tokens))
        assert abs(counts[token] / len(tokens) - p) <= 4 * sigma + 1e-9, (token, counts[token], p)


def renormalised(tokens: list[int], probs: list[float] = PROBS) -> dict[int, float]:
    total = sum(probs[t] for t in tokens)
    return {t: probs[t] / total for t in tokens}


def test_no_filter_draws_the_softmax() -> None:
    check_distribution(draw(SamplingParams(temperature=1.0)), {t: p for t, p in enumerate(PROBS)})


@pytest.mark.parametrize("k, support", [(1, [1]), (2, [1, 4]), (3, [1, 4, 3]), (6, [1, 4, 3, 6, 0, 5])])
def test_top_k_keeps_exactly_the_k_most_likely(k: int, support: list[int]) -> None:
    check_distribution(draw(SamplingParams(temperature=1.0, top_k=k)), renormalised(support))


def test_top_k_at_or_above_the_vocabulary_is_no_filter() -> None:
    unfiltered = draw(SamplingParams(temperature=1.0))
    assert draw(SamplingParams(temperature=1.0, top_k=len(PROBS))) == unfiltered
    assert draw(SamplingParams(temperature=1.0, top_k=100)) == unfiltered


@pytest.mark.parametrize(
    "p, support",
    [
        (0.3, [1]),  # the most likely token alone already reaches 0.3
        (0.6, [1, 4]),  # 0.4 < 0.6 <= 0.65
        (0.7, [1, 4, 3]),  # 0.65 < 0.7 <= 0.8
        (0.85, [1, 4, 3, 6]),  # 0.8 < 0.85 <= 0.9
        (0.999, [1, 4, 3, 6, 0, 5, 2]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(p: float, support: list[int]) -> None:
    check_distribution(draw(SamplingParams(temperature=1.0, top_p=p)), renormalised(support))


def test_top_k_then_top_p_on_the_renormalised_rest() -> None:
    # top-k 3 leaves 0.4, 0.25, 0.15 (renormalised 0.5, 0.3125, 0.1875): top-p 0.75 keeps the first two.
    # Applied to the full distribution instead, top-p 0.75 would keep three tokens (0.4 + 0.25 < 0.75).
    check_distribution(draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.75)), renormalised([1, 4]))


def test_temperature_sharpens_before_the_filters() -> None:
    # At temperature 0.5 the probabilities are proportional to p ** 2: 0.16, 0.0625, 0.0225, ...
    squared = [p * p for p in PROBS]
    total = sum(squared)
    sharpened = [s / total for s in squared]
    check_distribution(draw(SamplingParams(temperature=0.5)), {t: p for t, p in enumerate(sharpened)})
    # top_p 0.85 over the sharpened distribution: 0.618 + 0.2415 already reaches it.
    tokens = draw(SamplingParams(temperature=0.5, top_p=0.85))
    check_distribution(tokens, renormalised([1, 4], sharpened))


def test_greedy_rows_ignore_the_filters_and_the_generator() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0.0, top_k=1, top_p=0.1)
    assert sample(logits, [Row(greedy), Row(greedy)]) == [1, 0]


def test_a_logit_bias_moves_greedy_and_sampled_rows_alike() -> None:
    """A bias is added to its token's logit: +log(4) on token 2 (p 0.02 -> weight 0.08) in a sampled row, and
    in greedy rows +100 picks a token however unlikely, -100 on the argmax picks the runner-up."""
    biased = SamplingParams(temperature=1.0, logit_bias=((2, math.log(4.0)),))
    weights = [p * (4.0 if t == 2 else 1.0) for t, p in enumerate(PROBS)]
    check_distribution(draw(biased), {t: w / sum(weights) for t, w in enumerate(weights)})
    rows = [
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=0.0, logit_bias=((2, 100.0),))),
        Row(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))),
        Row(SamplingParams(temperature=0.0, logit_bias=((99, 100.0),))),  # beyond this vocabulary: nothing moves
    ]
    assert sample(LOGITS.expand(len(rows), -1).clone(), rows) == [1, 2, 4, 1]


def test_the_bias_comes_before_the_penalties() -> None:
    """vLLM's order: a bias that makes token 0 the argmax, then a repetition penalty on token 0 (already in the
    output) that divides its now positive logit, leaving token 1 the argmax again."""
    logits = torch.tensor([1.0, 2.0, 0.0])
    params = SamplingParams(temperature=0.0, logit_bias=((0, 2.0),), repetition_penalty=4.0)
    assert sample(logits.view(1, -1), [Row(params, output_token_ids=[0])]) == [1]  # (1 + 2) / 4 < 2
    assert sample(logits.view(1, -1), [Row(dataclasses.replace(params, repetition_penalty=1.0))]) == [0]


@pytest.mark.parametrize("bias", [((-1, 1.0),), ((True, 1.0),), ((3, 100.5),), ((3, float("nan")),), ((3, -101.0),)])
def test_a_bad_logit_bias_is_refused(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
