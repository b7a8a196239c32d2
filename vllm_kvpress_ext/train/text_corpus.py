"""Natural text already on the machine, as token windows for `kvpress train-gate --data text`.

Write gates are trained by self-distillation, so they need no labels, only text of the kind the
model reads. Three sources ship with an ordinary installation and need no download:

- `python`: the docstrings of the standard library's modules, classes and functions (read with
  `ast` from the source files, nothing is imported);
- `pip`: the long descriptions in the installed distributions' `METADATA` files (their READMEs);
- `debian`: READMEs, Markdown, reStructuredText and plain-text files under `/usr/share/doc`.

The Python language reference (`pydoc_data.topics`) is left out on purpose: it is the haystack of
the natural-language accuracy suite (`tasks/natural/`), and gates are evaluated there.

Documents are split into training and held-out sets by a hash of their name (one in ten held out),
so the split does not depend on which other files a machine has. Each set is tokenised, documents
joined by the tokenizer's end-of-text token, and cut into windows of the training length.
"""

from __future__ import annotations

import ast
import hashlib
import site
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_SOURCES = ("python", "pip", "debian")
DEBIAN_DOC_ROOT = Path("/usr/share/doc")
_DEBIAN_SUFFIXES = (".md", ".rst", ".txt", ".markdown")
MIN_CHARS = 400  # shorter documents are mostly licence stubs and one-line notes
MAX_CHARS = 200_000  # a single huge file (a full changelog) would otherwise dominate
HELD_OUT_SHARE = 10  # one document in this many is held out


@dataclass(frozen=True)
class Document:
    name: str  # "source:path" (path relative to its root)
    text: str

    @property
    def held_out(self) -> bool:
        return int(hashlib.sha1(self.name.encode()).hexdigest()[:8], 16) % HELD_OUT_SHARE == 0


def _python_docstrings() -> Iterator[Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if relative.parts[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3") or any(
            part.startswith("test") for part in relative.parts
        ):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef))]
        parts = [doc for node in nodes if (doc := ast.get_docstring(node))]
        if parts:
            yield Document(f"python:{relative}", "\n\n".join(parts))


def _site_packages() -> list[Path]:
    roots = [Path(p) for p in [*site.getsitepackages(), site.getusersitepackages(), *sys.path] if p]
    seen: list[Path] = []
    for root in roots:
        if root.is_dir() and root.resolve() not in seen and any(root.glob("*.dist-info")):
            seen.append(root.resolve())
    return seen


def _pip_descriptions() -> Iterator[Document]:
    for root in _site_packages():
        for metadata in sorted(root.glob("*.dist-info/METADATA")):
            try:
                text = metadata.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            _, _, body = text.partition("\n\n")  # headers, then the long description
            yield Document(f"pip:{metadata.parent.name}", body)


def _debian_docs(root: Path | None = None) -> Iterator[Document]:
    root = DEBIAN_DOC_ROOT if root is None else root
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*")):
        name = path.name
        if not (name.lower().endswith(_DEBIAN_SUFFIXES) or name.startswith("README")) or name.endswith(".gz"):
            continue
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield Document(f"debian:{path.relative_to(root)}", text)


def local_documents(sources: tuple[str, ...] = TEXT_SOURCES) -> list[Document]:
    """The machine's documents from `sources`, in a fixed order, trimmed to [MIN_CHARS, MAX_CHARS] characters."""
    unknown = sorted(set(sources) - set(TEXT_SOURCES))
    if unknown or not sources:
        raise ValueError(f"unknown text source(s) {', '.join(unknown)}; known: {', '.join(TEXT_SOURCES)}")
    readers = {"python": _python_docstrings, "pip": _pip_descriptions, "debian": _debian_docs}
    documents: list[Document] = []
    seen: set[str] = set()
    for source in sources:
        for doc in readers[source]():
            text = doc.text.strip()
            digest = hashlib.sha1(text.encode()).hexdigest()
            if len(text) < MIN_CHARS or digest in seen:  # the same README installed twice counts once
                continue
            seen.add(digest)
            documents.append(Document(doc.name, text[:MAX_CHARS]))
    return documents


@dataclass
class TextWindows:
    """Token windows `[N, T]` of the training and held-out documents, and where they came from."""

    train: Any  # torch.Tensor [N_train, T]
    held_out: Any  # torch.Tensor [N_held_out, T]
    facts: dict[str, Any]


def text_windows(
    tokenizer: Any, length: int, sources: tuple[str, ...] = TEXT_SOURCES, max_train_tokens: int = 1_000_000
) -> TextWindows:
    """Tokenise the machine's documents into windows of `length` tokens (training set capped at `max_train_tokens`)."""
    import torch

    # In hash order, so that the cap on training tokens samples every source rather than the first one.
    documents = sorted(local_documents(sources), key=lambda d: hashlib.sha1(d.name.encode()).hexdigest())
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the model's tokenizer has no end-of-text token to join documents with")
    streams: dict[bool, list[int]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    for doc in documents:
        stream = streams[doc.held_out]
        if not doc.held_out and len(stream) >= max_train_tokens:
            continue
        stream += tokenizer(doc.text, add_special_tokens=False)["input_ids"] + [eos]
        counts[doc.held_out] += 1

    def cut(stream: list[int]) -> torch.Tensor:
        usable = len(stream) // length * length
        return torch.tensor(stream[:usable], dtype=torch.long).view(-1, length)

    train, held_out = cut(streams[False]), cut(streams[True])
    if len(train) == 0 or len(held_out) == 0:
        raise ValueError(
            f"not enough local text for windows of {length} tokens from sources {', '.join(sources)} "
            f"({len(streams[False])} training and {len(streams[True])} held-out tokens)"
        )
    facts = {
        "sources": list(sources),
        "train_documents": counts[False],
        "held_out_documents": counts[True],
        "train_tokens": len(streams[False]),
        "held_out_tokens": len(streams[True]),
        "train_windows": len(train),
        "held_out_windows": len(held_out),
    }
    return TextWindows(train, held_out, facts)


__all__ = ["TEXT_SOURCES", "Document", "TextWindows", "local_documents", "text_windows"]
