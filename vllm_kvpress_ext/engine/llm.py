"""`LLM`: offline batch generation on the embedded engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_kvpress_ext.engine.engine import LLMEngine, PolicySpec
from vllm_kvpress_ext.engine.inputs import Prompt, compress_points, is_single_prompt, prepare_prompt
from vllm_kvpress_ext.engine.request import RequestOutput
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.policies import load_policy


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class LLM:
    """`LLM(model_dir).generate(prompts, SamplingParams(...))`, in the style of vLLM's offline API."""

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(model, **engine_kwargs)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        compress_after: int | Sequence[int | None] | None = None,
        policy: PolicySpec | None = None,
        use_tqdm: bool = False,
        n: int = 1,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        `n` samples per prompt come back consecutively (prompt-major). The prompt is prefilled and
        compressed once; its samples fork the compressed cache (`LLMEngine.add_request(sample_of=...)`).
        With a seed, sample j is seeded `seed + j` (vLLM's numbering), so each is reproducible alone.

        A prompt is text, token ids, or a `ContextQuestion` (context compressed, then the question
        read from the compressed cache). `compress_after` (one value for all prompts, or one per
        prompt; None = after the whole prompt) is the same point for plain prompts, in prompt tokens.
        `policy` overrides the engine's default policy for these prompts (`"full"`: no compression).
        """
        batch: list[Prompt] = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item,arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        points = compress_points(compress_after, len(batch))
        resolved = load_policy(policy)  # once, not per prompt; an instance (even "full") overrides the default
        # Every prompt is checked before any is queued, so a bad one leaves the engine idle.
        prepared = [prepare_prompt(p, c, self.engine.encode) for p, c in zip(batch, points, strict=True)]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prepared, params, strict=True):
                first: str | None = None
                for j in range(n):
                    seeded = sp if sp.seed is None or j == 0 else dataclasses.replace(sp, seed=(sp.seed + j) % 2**64)
                    rid = self.engine.add_request(
                        prompt.token_ids, seeded, compress_after=prompt.compress_after, policy=resolved, sample_of=first
                    )
                    first = first or rid
                    ids.append(rid)
        except Exception:
            for rid in ids:  # a later prompt was rejected: the earlier ones must not run on their own
                self.engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        if out.finish_reason == "error":  # offline, a failed request is the caller's error
                            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat completion through the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer, so it has no chat template")
        return self.generate([chat_token_ids(self.tokenizer, messages)], sampling_params)[0]
