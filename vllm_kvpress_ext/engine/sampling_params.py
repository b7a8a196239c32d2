"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Temperatures below this sample greedily (as vLLM does): dividing logits by a denormal such as
#: 5e-324 gives infinities, and the distribution is a point mass long before that anyway.
GREEDY_TEMPERATURE = 1e-5

#: The largest value a penalty may take: beyond it a penalty only turns logits into infinities.
MAX_PENALTY = 100.0

#: A logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range; vLLM's server clamps to it).
MAX_LOGIT_BIAS = 100.0

#: Most alternatives per token a request may ask for (`logprobs`, `prompt_logprobs`): vLLM's default cap.
MAX_LOGPROBS = 20


def _finite_in(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must lie in {bracket}{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature` below `GREEDY_TEMPERATURE` (0 included) is greedy. `top_k <= 0`, `top_p == 1` and
    `min_p == 0` disable those filters. The penalties follow vLLM: `repetition_penalty` (1 = off) divides
    positive logits and multiplies negative ones of every token in the prompt or output so far;
    `presence_penalty` and `frequency_penalty` (0 = off) subtract from the logits of output tokens, once
    and per occurrence. Penalties apply to greedy requests too. `min_tokens` suppresses EOS and
    `stop_token_ids` until that many tokens are out. `stop` strings end generation and are not included
    in the returned text; `stop_token_ids` and EOS (unless `ignore_eos`) end it with the token included
    in `output_token_ids` but not in the text. `skip_special_tokens` drops special tokens from the text.
    `logit_bias` pairs (token id, bias in [-100, 100]) add each bias to its token's logit before the
    penalties, as vLLM's logits processor does. `return_kept` asks for the positions every (layer, KV head)
    held when the request finished (`RequestOutput.kv.kept`) and right after its policy compressed
    (`kv.kept_at_compression`), as `KeptEntries`; each costs a pass over the request's tables.

    `logprobs` (None: off) returns, for every generated token, its log-probability and the `logprobs`
    most likely tokens' (0: the sampled token's only); `prompt_logprobs` does the same for every prompt
    token after the first (`RequestOutput.logprobs`, `.prompt_logprobs`). Both are log-softmaxes of the
    model's own logits, before penalties, temperature and filters (vLLM's default, `raw_logprobs`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    return_kept: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _finite_in("temperature", self.temperature, 0.0, 100.0)
        _finite_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        _finite_in("repetition_penalty", self.repetition_penalty, 0.0, MAX_PENALTY, low_open=True)
        _finite_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        object.__setattr__(self, "logit_bias", tuple((token, bias) for token, bias in self.logit_bias))
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias token ids must be non-negative integers, got {token!r}")
            _finite_in("a logit_bias value", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not isinstance(self.return_kept, bool):
            raise ValueError(f"return_kept must be True or False, got {self.return_kept!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that moves a logit first: the batch's one argmax serves it."""
        return self.greedy and not self.penalized and not self.logit_bias
