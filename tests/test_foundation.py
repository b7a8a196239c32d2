"""The package installs, its layout maps `kernels/` into the package, and the CLI answers."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import vllm_kvpress_ext
from vllm_kvpress_ext.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_and_help(capsys: object) -> None:
    out = subprocess.run([sys.executable, "-m", "vllm_kvpress_ext.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.strip() == f"kvpress {vllm_kvpress_ext.__version__}"
    helped = subprocess.run([sys.executable, "-m", "vllm_kvpress_ext.cli", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0
    for command in ("info", "demo", "bench"):
        assert command in helped.stdout


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvpress"
    assert script.exists(), "the `kvpress` console script is missing from the environment"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "kvpress" in out.stdout


def test_kernels_import_as_a_subpackage() -> None:
    import vllm_kvpress_ext.kernels as kernels

    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"


def test_every_subpackage_is_listed_in_pyproject() -> None:
    """The package list is explicit (because of the kernels mapping): a forgotten entry breaks wheels."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "vllm_kvpress_ext").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert found | {"vllm_kvpress_ext.kernels"} == listed


def test_info_and_bad_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    info = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines() if line.strip())
    assert info["vllm-kvpress-ext"] == vllm_kvpress_ext.__version__
    assert info["torch"] == torch.__version__
    assert main(["bench"]) == 2  # a bench group without a bench: its usage, listing every bench
    listing = capsys.readouterr()
    text = listing.out + listing.err
    assert "usage: kvpress bench" in text
    for bench in ("cache", "throughput", "policies", "accuracy", "serve", "kernels", "prefill-peak", "kvpress-parity"):
        assert f"\n    {bench} " in text or f"\n    {bench}\n" in text, bench


def test_demo_frees_pages(capsys) -> None:  # type: ignore[no-untyped-def]
    main(["demo", "--requests", "2", "--prompt-len", "64", "--keep-ratio", "0.25"])
    out = capsys.readouterr().out
    assert "does not fit" in out
    assert "more uncompressed 64-token requests" in out
    held = int(out.rsplit("now hold ", 1)[1].split()[0])
    # Exactly as many 64-token requests as the free pages hold: 8 layers x 4 heads x 4 pages of 16 tokens each
    # (the demo's cache), at most 3 per original request.
    free = int(out.rsplit("pages used, ", 1)[1].split()[0])
    assert held == min(free // (8 * 4 * 4), 3 * 2)
    assert held >= 1  # compression at ratio 0.25 freed room for at least one
