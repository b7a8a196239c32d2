"""The tokenizer (and chat template) of a model: from an HF directory's files or a GGUF file's metadata.

A GGUF file carries its vocabulary, merges, special tokens and chat template as `tokenizer.*`
fields; transformers turns those into a fast tokenizer. That conversion parses every token of the
file and takes seconds (13 s for SmolLM2's 49K tokens here), so its result is saved once under the
model cache (`tokenizers/`, keyed by the file's name, size and modification time) and read back
from there afterwards. Returns None when the model ships no tokenizer (token-id-only use).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.hub.catalog import cache_dir

from .gguf_file import is_gguf_path, open_gguf

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """A transformers tokenizer for an HF model directory or a `.gguf` file, or None if it has none."""
    path = Path(model_path).expanduser()
    from transformers import AutoTokenizer  # heavy import, paid only when a tokenizer is wanted

    if is_gguf_path(path):
        return _gguf_tokenizer(path)
    if not any((path / name).exists() for name in _HF_TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def gguf_tokenizer_cache(path: Path) -> Path:
    """Where the converted tokenizer of GGUF file `path` is kept; a changed file gets a new entry."""
    stat = path.stat()
    return cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache(path)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    metadata = open_gguf(path).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' conversion drops the file's own word on the special tokens around a prompt: Gemma's files
    # ask for <bos>, without which the model is far off its training distribution.
    for flag in ("add_bos_token", "add_eos_token"):
        if metadata.get(f"tokenizer.ggml.{flag}") is not None:
            setattr(tokenizer, flag, bool(metadata[f"tokenizer.ggml.{flag}"]))
    with contextlib.suppress(OSError):  # a read-only cache only costs the conversion next time
        tokenizer.save_pretrained(str(cached))
    return tokenizer
