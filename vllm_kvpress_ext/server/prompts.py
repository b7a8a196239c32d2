"""Prompt text checks that come before tokenization: valid Unicode, not empty, not obviously too long."""

from __future__ import annotations

from typing import Any

from vllm_kvpress_ext.api.errors import bad_request

#: Characters tokenized up front to tell an over-long prompt early: a prompt whose first
#: `max_model_len * PROBE_CHARS_PER_TOKEN` characters already reach the limit is refused without
#: tokenizing the rest.
PROBE_CHARS_PER_TOKEN = 8


def check_text(text: str, param: str, *, allow_empty: bool = False) -> None:
    """400 for text a tokenizer cannot take: lone UTF-16 surrogates (`"\\ud800"` in JSON), or nothing at all."""
    if not text and not allow_empty:
        raise bad_request(f"{param} is empty", param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        message = f"{param} is not valid Unicode: a lone surrogate at character {exc.start}"
        raise bad_request(message, param=param) from None


def encode_bounded(tokenizer: Any, text: str, max_model_len: int) -> list[int]:
    """Token ids of `text`, refusing a prompt that cannot fit `max_model_len` before tokenizing all of it."""
    probe = max(4096, max_model_len * PROBE_CHARS_PER_TOKEN)
    if len(text) > probe:
        head = len(tokenizer.encode(text[:probe]))
        if head >= max_model_len:
            raise bad_request(
                f"prompt has more than {head} tokens; the model's limit is {max_model_len} (prompt + output)",
                param="prompt",
            )
    return [int(t) for t in tokenizer.encode(text)]
