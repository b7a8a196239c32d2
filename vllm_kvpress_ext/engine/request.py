"""A request's life in the engine and what it returns."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvpress_ext.engine.kept import KeptEntries
from vllm_kvpress_ext.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine.admission import PromptAdmission
    from vllm_kvpress_ext.engine.prefix_store import PrefixLease
    from vllm_kvpress_ext.engine.sampler import TokenLogprob
    from vllm_kvpress_ext.policies import KVPolicy
    from vllm_kvpress_ext.policies.base import Admission
    from vllm_kvpress_ext.policies.capture import PrefillCapture


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    PREFILLING = "prefilling"  # has a cache row; prompt chunks still to run
    RUNNING = "running"  # decoding (forced prompt tokens first, then sampled ones)
    FINISHED = "finished"


class RequestRejectedError(ValueError):
    """The request can never run on this engine (bad tokens, too long for the model or for the whole pool)."""


@dataclass
class KVStats:
    """What the request held in the cache, from the pool's own accounting."""

    prompt_tokens: int = 0
    tokens_kept: int = 0  # entries held over all (layer, KV head), ring included
    tokens_full: int = 0  # what an uncompressed cache would hold for the same tokens
    kv_bytes: int = 0  # share of the pool: private pages x page bytes + shared pages / their holders
    kv_bytes_peak: int = 0  # most pages referenced at once (shared ones whole) x page bytes
    compression_seconds: float = 0.0
    # Per layer, the entries its KV heads keep on average (floored); `kept.per_layer` sums them instead.
    mean_kept_per_layer: list[int] = field(default_factory=list)
    kept_per_head: list[list[int]] = field(default_factory=list)  # [layer][KV head] entries, ring included
    counters: dict[str, int] = field(default_factory=dict)  # policy event counts, e.g. eviction triggers
    # With `SamplingParams(return_kept=True)`: the positions held when the request finished, and those held
    # right after its policy compressed (the end of prefill, or `compress_after`; None without a policy).
    kept: KeptEntries | None = None
    kept_at_compression: KeptEntries | None = None

    @property
    def retention(self) -> float:
        return self.tokens_kept / self.tokens_full if self.tokens_full else 1.0

    @property
    def kept_per_layer(self) -> list[int]:
        """`mean_kept_per_layer` under the name the offline API has always given it."""
        return self.mean_kept_per_layer


class IncrementalText:
    """A request's output text kept up to date token by token, in time linear in the output.

    `tokenizer.decode(ids)` of the whole output after every token is quadratic in its length. Here each
    new token decodes only a short window: the tokens since the last point where the text was complete
    (`prefix`) through the newest, minus that window's start (`prefix..read`), as vLLM's incremental
    detokeniser does. Decoding the same first token in both keeps a leading-space rule (SentencePiece)
    consistent, and a window whose text ends in U+FFFD is half of a multi-byte character: nothing is
    added until a later token completes it. The optional clean-up of spaces before punctuation is local
    and is applied to the whole raw text afterwards, as `decode` itself does it last.

    `text` equals `decode(ids)` once the characters are complete; while the newest bytes are an
    unfinished character it equals `decode(ids)` without that trailing U+FFFD tail.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.raw = ""
        self.text = ""
        self.prefix = 0  # window start: the first token of the last complete piece
        self.read = 0  # tokens whose text is in `raw`

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return text

    def update(self, ids: list[int]) -> str:
        """The text of `ids`, a list that only ever grew since the last call."""
        if len(ids) > self.read:
            done = self._decode(ids[self.prefix : self.read])
            window = self._decode(ids[self.prefix :])
            if len(window) > len(done) and not window.endswith("\ufffd"):
                self.raw += window[len(done) :]
                self.prefix, self.read = self.read, len(ids)
                self.text = self.tokenizer.clean_up_tokenization(self.raw) if self.cleanup else self.raw
        return self.text


@dataclass
class Seat:
    """A request's cache state on the runner that serves it: its row, its progress, its policy's state and captures,
    its write gate, its hold on a stored prefix and its KV figures.

    `ModelRunner` alone writes it (`ModelRunner.start` seats a request, `release` / `preempt` take the row back;
    `tests/test_layering.py` finds any other writer); the drivers, the prefix store and the samples read it. It
    outlives the row, so that a finished request's figures and policy state stay readable.
    """

    row: int | None = None  # None: the request holds no pages
    num_processed: int = 0  # tokens of `all_token_ids` whose K/V went through the model
    cached_tokens: int = 0  # prompt tokens read from a cached compressed prefix instead of prefilled
    compressed_at: int | None = None  # tokens prefilled when the prefill completed (the policy's boundary)
    policy_state: Any = None  # whatever the policy keeps between its steps (`KVPolicy.init_state`)
    capture: PrefillCapture | None = None  # while a compressing policy's prefill runs
    admission: Admission | None = None  # the policy's write gate (WG-KV) bound to the model, if any
    prompt_admission: PromptAdmission | None = None  # what the gates said of the prompt, while it is prefilled
    prefix_lease: PrefixLease | None = None  # its hold on the stored prefix its row was forked from
    kv: KVStats = field(default_factory=KVStats)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    compress_after: int | None = None
    policy: KVPolicy | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    reserved_pages: int = 0  # what the embedded scheduler set aside for this prefill when it started
    seat: Seat = field(init=False)  # its cache state, written by its runner alone
    first_token_time: float | None = None
    error: str | None = None  # why the runner failed this request alone (finish_reason "error")
    # `compress_after` is only a default: a stored prefix found by automatic matching takes precedence.
    context_is_fallback: bool = False
    # SamplingParams.logprobs / prompt_logprobs: one entry per output token; one per prompt token
    # (None for the first, which nothing predicts), filled as the prefill reaches each position.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    detokenizer: IncrementalText | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        self.seat = Seat(kv=KVStats(prompt_tokens=len(self.prompt_token_ids)))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """`all_token_ids[index]` without building the whole list (a decode step reads one token)."""
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt else self.output_token_ids[index - prompt]

    def output_text(self, tokenizer: Any) -> str:
        """The output so far as text, kept incrementally (`IncrementalText`)."""
        if self.detokenizer is None:
            self.detokenizer = IncrementalText(tokenizer, self.params.skip_special_tokens)
        return self.detokenizer.update(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens run as prefill before the policy compresses; the rest go one per decode step."""
        if self.policy is None or self.compress_after is None:
            return self.num_tokens
        return min(self.compress_after, self.num_tokens)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of a request: tokens so far, text, and (when finished) why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    kv: KVStats
    num_preemptions: int = 0
    error: str | None = None  # set with finish_reason "error": the step failed for this request alone
    #: `TokenLogprob` per output token (SamplingParams.logprobs), else None.
    logprobs: list[Any] | None = None
    #: `TokenLogprob` per prompt token, None for the first (SamplingParams.prompt_logprobs), else None.
    prompt_logprobs: list[Any] | None = None
    #: Prompt tokens read from a cached compressed prefix instead of prefilled
    #: (`usage.prompt_tokens_details.cached_tokens`); a sample forked from another sample of its prompt
    #: reports 0, so that a prompt's tokens count once, as in `prompt_tokens`.
    cached_tokens: int = 0
