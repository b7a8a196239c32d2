"""The tokenizer (and chat template) of a model: from an HF directory's files or a GGUF file's metadata.

A GGUF file carries its vocabulary, merges, special tokens and chat template as `tokenizer.*`
fields; transformers turns those into a fast tokenizer. Returns None when the model ships no
tokenizer (token-id-only use, as in the tests' random models).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .gguf_file import GGUFFile, is_gguf_path

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """A transformers tokenizer for an HF model directory or a `.gguf` file, or None if it has none."""
    path = Path(model_path).expanduser()
    from transformers import AutoTokenizer  # heavy import, paid only when a tokenizer is wanted

    if is_gguf_path(path):
        if "tokenizer.ggml.tokens" not in GGUFFile(path).metadata:
            return None
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not any((path / name).exists() for name in _HF_TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))
