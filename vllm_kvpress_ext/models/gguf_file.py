"""Read a `.gguf` file: its metadata fields and its tensors, dequantised to float32 in torch's layout.

The header (fields and tensor list) is read here, from a memory map of the file; the `gguf` package
(llama.cpp's own Python code) dequantises every GGML type it knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_x, the K-quants Q2_K..Q8_K, IQ types). Two more things are done here:

- shapes: GGUF lists dimensions innermost first (ggml's `ne`), so a [rows, cols] torch weight is
  stored as shape [cols, rows]; `tensor()` returns the torch order.
- names of what went wrong: an absent file, a file that is not GGUF, or a tensor type this
  `gguf` release cannot dequantise each raise a `ModelLoadError` naming the file and tensor.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import ModelFileNotFoundError, ModelLoadError

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


class _Tensor(NamedTuple):
    """Where one tensor lies: GGML type, dimensions innermost first (ggml's `ne`), absolute byte offset."""

    type: int
    dims: tuple[int, ...]
    offset: int


# GGUF value types: struct format and size of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY: dict[int, str] = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_DEFAULT_ALIGNMENT = 32
_COPY_CHUNK = 64 << 20


class _Header:
    """A GGUF header (little-endian, versions 2 and 3) read from a memory map.

    The `gguf` package's reader builds a numpy view per value, which takes 16 s for the 262K-token
    vocabulary of Gemma 3; here the strings of an array are read in one pass and numeric arrays in
    one `frombuffer`, so the same header takes well under a second.
    """

    def __init__(self, data: np.ndarray, source: Path) -> None:
        self.buffer = memoryview(data)  # type: ignore[arg-type]
        self.source = source
        self.at = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ModelLoadError(f"{source}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, field_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        self.field_spans: dict[str, tuple[int, int]] = {}  # each field's bytes, key and type included
        for _ in range(field_count):
            start = self.at
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
            self.field_spans[key] = (start, self.at)
        self.tensor_count = tensor_count
        self.infos_start = self.at
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._scalar("Q") for _ in range(self._scalar("I")))
            infos.append((name, self._scalar("I"), dims, self._scalar("Q")))
        self.infos_end = self.at
        self.alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        self.data_start = -(-self.at // self.alignment) * self.alignment
        self.tensors: dict[str, _Tensor] = {}
        for name, kind, dims, offset in infos:
            if name in self.tensors:
                raise ModelLoadError(f"{source} lists tensor {name} twice")
            self.tensors[name] = _Tensor(kind, dims, self.data_start + offset)

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buffer):
            raise ModelLoadError(f"{self.source} is truncated: its header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += size
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        if self.at + length > len(self.buffer):
            raise ModelLoadError(f"{self.source} is truncated: its header runs past the end of the file")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ModelLoadError(f"{self.source}: unknown GGUF value type {kind}")
        item, count = self._scalar("I"), self._scalar("Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            end = self.at + count * dtype.itemsize
            if end > len(self.buffer):
                raise ModelLoadError(f"{self.source} is truncated: its header runs past the end of the file")
            values = np.frombuffer(self.buffer[self.at : end], dtype=dtype).tolist()
            self.at = end
            return values
        return [self._value(item) for _ in range(count)]


class GGUFFile:
    """One opened GGUF file: `metadata` (key -> Python value) and `tensor(name)` (float32 numpy)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelFileNotFoundError(f"GGUF file not found: {self.path}")
        with self.path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise ModelLoadError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic)")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._header = _Header(self._data, self.path)
        self.metadata: dict[str, Any] = self._header.fields
        self._tensors = self._header.tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of a tensor ("F32", "Q8_0", "Q4_K", ...)."""
        return self._quant_type(name).name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (outermost first)."""
        return tuple(int(n) for n in reversed(self._tensor(name).dims))

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to a float32 array in torch order."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

        info, kind = self._tensor(name), self._quant_type(name)
        shape = self.tensor_shape(name)
        block, type_size = GGML_QUANT_SIZES[kind]
        floats = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.F64: "<f8"}
        if shape[-1] % block:
            raise ModelLoadError(f"{self.path}: tensor {name}'s rows ({shape[-1]}) are not whole {kind.name} blocks")
        row_bytes = shape[-1] // block * type_size
        count = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        if info.offset + count > self._data.shape[0]:
            raise ModelLoadError(f"{self.path} is truncated: tensor {name} runs past the end of the file")
        raw = self._data[info.offset : info.offset + count]
        if kind in floats:
            raw = raw.view(np.dtype(floats[kind]))
        raw = raw.reshape(*shape[:-1], -1)
        try:
            values = dequantize(raw, kind)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has GGML type {kind.name}, which the installed 'gguf' "
                "package cannot dequantise"
            ) from e
        values = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
        # F32 tensors come back as read-only views of the memory map; torch wants writable memory.
        return values if values.flags.writeable else values.copy()

    def write_without_fields(self, destination: str | os.PathLike[str], drop: Collection[str]) -> Path:
        """Copy the file to `destination` less the metadata fields named in `drop`; tensors are copied byte
        for byte (their offsets count from the data section, which keeps its alignment).

        Why: transformers parses a GGUF header with the `gguf` package, a numpy view per array element,
        about 40 s for Gemma 3's 262K-token vocabulary each time it reads the file (its config, then its
        weights); a copy without the vocabulary's arrays reads in well under a second."""
        header, data = self._header, self._data
        kept = [span for key, span in header.field_spans.items() if key not in drop]
        destination = Path(destination)
        with destination.open("wb") as out:
            out.write(_MAGIC + bytes(data[4:8]))  # the version, as read
            out.write(struct.pack("<QQ", header.tensor_count, len(kept)))
            for start, end in kept:
                out.write(data[start:end].tobytes())
            out.write(data[header.infos_start : header.infos_end].tobytes())
            out.write(b"\0" * (-out.tell() % header.alignment))
            for start in range(header.data_start, data.shape[0], _COPY_CHUNK):
                out.write(data[start : min(start + _COPY_CHUNK, data.shape[0])].tobytes())
        return destination

    def _quant_type(self, name: str) -> Any:
        from gguf import GGMLQuantizationType

        kind = self._tensor(name).type
        try:
            return GGMLQuantizationType(kind)
        except ValueError:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has GGML type {kind}, unknown to the 'gguf' package"
            ) from None

    def _tensor(self, name: str) -> _Tensor:
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path} has no tensor named {name}")
        return self._tensors[name]
