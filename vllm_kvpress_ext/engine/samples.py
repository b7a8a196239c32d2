"""The samples of one prompt (`n > 1`) share its compressed cache instead of each prefilling it again.

A request added with `sample_of=R` waits, holding nothing, until request R (same prompt, policy and
protocol) reaches its first sampled token: its prompt is prefilled and compressed by then. The sample
then starts as a fork of R's cache row (`ModelRunner.start` with `ForkOf`: the same pages, copy-on-write), with a copy
of R's policy state, and draws its first token from R's logits of that step with its own
sampling parameters. From there on it is an ordinary running request writing its own tail. So n samples
cost one prefill, one compressed prompt and n tails.

Sharing is best effort: when R is gone or already sampled by the time the sample arrives, when R
ends (or fails) before its first token, or when no cache row or page is free for the fork, the sample
queues as a request of its own and prefills its prompt itself, with the same result.
"""

from __future__ import annotations

from vllm_kvpress_ext.engine.request import Request


def can_share(parent: Request | None, sample: Request) -> bool:
    """Whether `sample` can start from `parent`'s compressed prompt (checked when the sample is added)."""
    return (
        parent is not None
        and not parent.finished
        and not parent.output_token_ids
        and parent.prompt_token_ids == sample.prompt_token_ids
        and parent.compress_after == sample.compress_after
        and parent.policy == sample.policy
        # A write gate's ring is sized by the request's length limit: another ring is another cache.
        and getattr(parent.seat.admission, "window", None) == getattr(sample.seat.admission, "window", None)
        # What the parent recorded during its prefill must be what the sample would have recorded.
        and parent.params.prompt_logprobs == sample.params.prompt_logprobs
        and parent.params.return_kept == sample.params.return_kept
    )
