"""Errors raised while reading a model directory.

They are `ValueError`s (and, for absent files, also `FileNotFoundError`s) so callers that already
catch the builtin kinds keep working, while the engine and the CLI can catch `ModelLoadError` alone
and show its message, which always names the file, key or tensor at fault.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory cannot be turned into a model; the message says exactly what is wrong."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """The directory, `config.json`, the weights or one of their shards is absent."""


class ModelConfigError(ModelLoadError):
    """`config.json` is present but describes something this code cannot run faithfully."""


class UnsupportedModelError(ModelConfigError):
    """`config.json` names an architecture outside the Llama family this package implements."""
