"""Read a `.gguf` file: its metadata fields and its tensors, dequantised to float32 in torch's layout.

The `gguf` package (llama.cpp's own Python reader) memory-maps the file and dequantises every
GGML type it knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x, the K-quants Q2_K..Q8_K, IQ types).
Two things it leaves to the caller and that are done here:

- shapes: GGUF lists dimensions innermost first (ggml's `ne`), so a [rows, cols] torch weight is
  stored as shape [cols, rows]; `tensor()` returns the torch order.
- names of what went wrong: an absent file, a file that is not GGUF, or a tensor type this
  `gguf` release cannot dequantise each raise a `ModelLoadError` naming the file and tensor.
"""

from __future__ import annotations

import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ModelFileNotFoundError, ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A `GGUFFile`, reused while the file is unchanged: parsing the fields of a 49K-token
    vocabulary takes seconds, and the config, the weights and the tokenizer all read them."""
    resolved = Path(path).expanduser().resolve()
    stamp = resolved.stat().st_mtime_ns if resolved.is_file() else -1
    return _open_cached(str(resolved), stamp)


@lru_cache(maxsize=2)
def _open_cached(path: str, stamp: int) -> GGUFFile:
    del stamp  # part of the cache key only
    return GGUFFile(path)


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """True when `path` names a GGUF file (by suffix; the magic is checked when it is opened)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX


class GGUFFile:
    """One opened GGUF file: `metadata` (key -> Python value) and `tensor(name)` (float32 numpy)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelFileNotFoundError(f"GGUF file not found: {self.path}")
        with self.path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise ModelLoadError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic)")
        try:
            from gguf import GGUFReader
        except ImportError as e:  # pragma: no cover - gguf is a declared dependency
            raise ModelLoadError("reading .gguf files needs the 'gguf' package: pip install gguf") from e
        try:
            self._reader: GGUFReader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._tensors: dict[str, ReaderTensor] = {t.name: t for t in self._reader.tensors}

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key/value field (the `GGUF.*` header pseudo-fields left out) as plain Python values."""
        return {name: field.contents() for name, field in self._reader.fields.items() if not name.startswith("GGUF.")}

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of a tensor ("F32", "Q8_0", "Q4_K", ...)."""
        return str(self._tensor(name).tensor_type.name)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (outermost first)."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to a float32 array in torch order."""
        from gguf import dequantize

        raw = self._tensor(name)
        try:
            values = dequantize(raw.data, raw.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has GGML type {raw.tensor_type.name}, which the installed 'gguf' "
                "package cannot dequantise"
            ) from e
        values = np.ascontiguousarray(values.reshape(self.tensor_shape(name)), dtype=np.float32)
        # F32 tensors come back as read-only views of the memory map; torch wants writable memory.
        return values if values.flags.writeable else values.copy()

    def _tensor(self, name: str) -> ReaderTensor:
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path} has no tensor named {name}")
        return self._tensors[name]
