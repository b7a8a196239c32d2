"""What `kvpress serve` is configured with, and the small parsers its flags need.

Only the standard library is imported here, so the CLI can use `parse_size` while building its
parser without paying for torch or fastapi.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.api import DEFAULT_CONTEXT_POLICY, PREFIX_MATCHING_MODES
from vllm_kvpress_ext.assets import DEFAULT_MODEL_DIR

#: The model `kvpress serve` serves when no MODEL_DIR is given (shipped inside the package).
BUNDLED_MODEL_DIR = DEFAULT_MODEL_DIR

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


class ModelDirError(ValueError):
    """No usable model directory: none given and no bundled model, or the given one does not exist."""


def parse_size(text: str) -> int:
    """Bytes from `2GiB`, `512MiB`, `1.5GB` or a plain integer.

    Binary (KiB/MiB/GiB) and decimal (KB/MB/GB) units are both accepted because people write
    both; the difference matters at pool sizes of many GiB.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 2GiB, 512MiB or 1073741824, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"size must be at least one byte, got {text!r}")
    return int(value)


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The model to serve: the directory or `.gguf` file given, else the bundled model if it exists.

    Fails loudly rather than inventing a model: serving random weights by accident would look
    like a working server that answers nonsense.
    """
    if model_dir is None:
        if (BUNDLED_MODEL_DIR / "config.json").is_file():
            return BUNDLED_MODEL_DIR
        raise ModelDirError(
            f"the bundled model is missing from this installation (looked in {BUNDLED_MODEL_DIR}); "
            "pass MODEL_DIR, an HF-format directory with config.json, safetensors weights and a tokenizer"
        )
    path = Path(model_dir).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelDirError(f"GGUF file not found: {path}")
        return path
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a model directory (no config.json) nor a .gguf file")
    return path


@dataclass(frozen=True)
class ServerConfig:
    """Everything `kvpress serve` needs: the engine's settings and the HTTP front's.

    `max_queue` bounds the requests accepted but not yet started by the engine (no pages yet);
    beyond it the server answers 429 so clients back off instead of piling up latency.
    `max_request_bytes` bounds a request body (413 beyond it, before any parsing). `shutdown_grace`
    is how long in-flight requests may run on after SIGTERM before they get the shutdown error.
    """

    model_dir: Path
    served_model_name: str | None = None
    kv_policy: str | dict[str, Any] | None = None  # a name or an object (`parse_operator_policy`)
    host: str = "127.0.0.1"
    port: int = 8000
    num_pages: int | None = None
    kv_memory: int | None = None
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_queue: int = 1024
    dtype: str = "auto"
    device: str = "cpu"
    log_level: str = "info"
    max_request_bytes: int = 2 << 20
    shutdown_grace: float = 30.0
    enable_prefix_caching: bool = True
    max_cached_prefixes: int = 16
    prefix_matching: str = "named"  # "auto": longest stored prefix and multi-turn attach (docs/prefix_reuse.md)
    # What compresses a chat's default context (the messages before the last user message): `api/context_policy.py`.
    context_policy: str | dict[str, Any] = DEFAULT_CONTEXT_POLICY

    def __post_init__(self) -> None:
        if self.num_pages is not None and self.kv_memory is not None:
            raise ValueError("give num_pages or kv_memory, not both")
        positive = {
            "max_queue": self.max_queue,
            "page_size": self.page_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_request_bytes": self.max_request_bytes,
            "num_pages": self.num_pages,
            "kv_memory": self.kv_memory,
            "max_model_len": self.max_model_len,
            "max_cached_prefixes": self.max_cached_prefixes,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prefix_matching not in PREFIX_MATCHING_MODES:
            modes = " or ".join(PREFIX_MATCHING_MODES)
            raise ValueError(f"prefix_matching must be {modes}, got {self.prefix_matching!r}")
        if isinstance(self.context_policy, str):  # parsed and checked once (a policy, `request` or `none`)
            from vllm_kvpress_ext.api.context_policy import parse_context_policy

            object.__setattr__(self, "context_policy", parse_context_policy(self.context_policy))
        if not 0 < self.port <= 65535:
            raise ValueError(f"port must lie in [1, 65535], got {self.port}")
        if not 0 <= self.shutdown_grace <= 3600:
            raise ValueError(f"shutdown_grace must lie in [0, 3600] seconds, got {self.shutdown_grace}")

    @property
    def model_name(self) -> str:
        """The id clients put in `model`: `--served-model-name`, else the directory's (or GGUF file's) name."""
        path = self.model_dir.resolve()
        return self.served_model_name or (path.stem if path.suffix.lower() == ".gguf" else path.name)
