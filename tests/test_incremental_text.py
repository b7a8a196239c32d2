"""The engine's incremental detokeniser gives the text a whole-output decode gives, token by token."""

from __future__ import annotations

import random
from typing import Any

import pytest

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.engine.request import IncrementalText
from vllm_kvpress_ext.hub.catalog import cached_path, lookup
from vllm_kvpress_ext.models import load_tokenizer

_CATALOG = lookup("smollm2-135m")
SMOLLM2 = cached_path(_CATALOG) if _CATALOG is not None and cached_path(_CATALOG).is_file() else None
MULTIBYTE = "naïve café — 東京 🙂👍🏽 ok. it 's done , isn't it ? ü"


def _tokenizers() -> list[Any]:
    found = [load_tokenizer(default_model_dir())]
    if SMOLLM2 is not None:
        found.append(load_tokenizer(SMOLLM2))
    return found


def _check_every_prefix(tokenizer: Any, ids: list[int], skip: bool) -> None:
    """At every length: the text is the full decode, or that decode less an unfinished (U+FFFD) tail."""
    incremental = IncrementalText(tokenizer, skip)
    for n in range(1, len(ids) + 1):
        text = incremental.update(ids[:n])
        full = tokenizer.decode(ids[:n], skip_special_tokens=skip)
        assert full.startswith(text), (n, text, full)
        pending = full[len(text) :]
        assert pending == "" or pending.endswith("\ufffd"), (n, text, full)
    final = tokenizer.decode(ids, skip_special_tokens=skip)
    if not final.endswith("\ufffd"):
        assert incremental.text == final


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_the_full_decode_on_multibyte_text(skip: bool) -> None:
    for tokenizer in _tokenizers():
        ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
        special = list(tokenizer.all_special_ids)[:1]
        _check_every_prefix(tokenizer, special + ids + special + ids, skip)


def test_incremental_text_equals_the_full_decode_on_random_tokens() -> None:
    """Random ids split characters anywhere (byte tokens, pieces of emoji) and leave some never completed."""
    rng = random.Random(0)
    for tokenizer in _tokenizers():
        vocab = len(tokenizer)
        for _ in range(20):
            _check_every_prefix(tokenizer, [rng.randrange(vocab) for _ in range(40)], True)


def test_incremental_text_applies_the_clean_up_of_spaces_like_decode() -> None:
    tokenizer = load_tokenizer(default_model_dir())
    ids = tokenizer.encode("a , b . c ? d ! it 's", add_special_tokens=False)
    incremental = IncrementalText(tokenizer, True)
    incremental.cleanup = True
    for n in range(1, len(ids) + 1):
        incremental.update(ids[:n])
    assert incremental.text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
