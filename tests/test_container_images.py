"""Both images built with podman and run as the Kubernetes manifests run them (tools/build_images.py).

The build-and-run test is slow, and runs only where podman and runc are installed (as root): the bases
are reused once built, so a run builds the two images on them and starts each container. Without podman
it is skipped with the reason; docs/deploy.md says how long a run takes and what it checks. The tool's
own choices (torch's source, the container settings, its refusal without podman) are checked fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from deploy_utils import REPO

TOOL = REPO / "tools" / "build_images.py"
#: Every check the tool makes; a run that skips one fails here.
EXPECTED_CHECKS = {
    "cpu entrypoint command",
    "cpu entrypoint refuses a bad variable",
    "cpu HEALTHCHECK",
    "cpu container runs restricted",
    "cpu chat through the openai SDK",
    "cpu KVPRESS_KV_MEMORY",
    "cpu graceful stop",
    "cpu image content",
    "vllm HEALTHCHECK",
    "vllm container runs restricted",
    "vllm command from KVPRESS_* variables",
    "vllm chat through the openai SDK",
    "vllm plugin metrics",
    "vllm image content",
}
#: Bounds on the images' sizes, from the sizes measured (docs/deploy.md) plus a margin: a build stage's
#: leftovers (a compiler, a pip cache, the torch wheel) would cross them.
MAX_CPU_IMAGE_BYTES = 1_400_000_000
MAX_VLLM_LAYERS_BYTES = 60_000_000  # what the vLLM image adds to its base


def _missing_prerequisite() -> str | None:
    for command in ("podman", "runc"):
        if shutil.which(command) is None:
            return f"{command} is not installed (apt-get install podman runc debootstrap; docs/deploy.md)"
    if os.geteuid() != 0:
        return "the image build runs rootful podman and debootstrap: run as root"
    return None


def _tool() -> ModuleType:
    """tools/build_images.py as a module (registered first: its dataclass looks its module up)."""
    if "build_images" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_images", TOOL)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["build_images"] = module
        spec.loader.exec_module(module)
    return sys.modules["build_images"]


def test_tool_stops_with_the_install_step_when_podman_is_missing(tmp_path: Path) -> None:
    # Only this interpreter's folder on PATH: no podman, no runc.
    env = {**os.environ, "PATH": str(tmp_path)}
    result = subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "podman is not installed: apt-get install podman runc debootstrap" in result.stderr


def test_tool_takes_torch_from_the_wheels_alone_or_from_the_cpu_index(tmp_path: Path) -> None:
    tool = _tool()
    wheels_only = tool.parse_args(["--torch-wheels", str(tmp_path)])
    assert (wheels_only.torch_wheels, wheels_only.torch_index_url) == (str(tmp_path), "")
    index_only = tool.parse_args(["--torch-wheels", ""])
    assert index_only.torch_index_url == "https://download.pytorch.org/whl/cpu"
    both = tool.parse_args(["--torch-wheels", str(tmp_path), "--torch-index-url", "https://example.invalid/simple"])
    assert both.torch_index_url == "https://example.invalid/simple"
    assert tool.parse_args(["--ca-bundle", ""]).ca_bundle == ""


def test_each_image_takes_its_own_torch_from_the_wheels_when_they_hold_it(tmp_path: Path) -> None:
    """The CPU image pins torch 2.13.0 and the vLLM base the torch its vLLM pins: a wheels folder holding only
    2.13.0's serves the first, and the second falls back to PyTorch's CPU index."""
    tool = _tool()
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    args = tool.parse_args(["--torch-wheels", str(tmp_path)])
    assert tool.torch_source(args, "Dockerfile.cpu") == {"TORCH_INDEX_URL": ""}
    assert tool.torch_source(args, "Dockerfile.vllm-base") == {"TORCH_INDEX_URL": tool.CPU_TORCH_INDEX}
    given = tool.parse_args(["--torch-wheels", str(tmp_path), "--torch-index-url", "https://example.invalid/simple"])
    assert tool.torch_source(given, "Dockerfile.vllm-base") == {"TORCH_INDEX_URL": "https://example.invalid/simple"}


def test_tool_runs_containers_without_cgroup_or_rlimit_settings() -> None:
    # runc on a cgroup-v1 machine without systemd: no ulimits, no pids limit, cgroupfs (docs/deploy.md).
    conf = _tool().CONTAINERS_CONF
    for setting in ("default_ulimits = []", "pids_limit = 0", 'cgroup_manager = "cgroupfs"'):
        assert setting in conf
    restricted = " ".join(_tool().RESTRICTED_RUN)
    assert "--read-only --read-only-tmpfs=false --tmpfs /tmp" in restricted and "--cap-drop all" in restricted


@pytest.mark.slow
@pytest.mark.heavy
def test_images_build_serve_and_stay_small(tmp_path: Path) -> None:
    reason = _missing_prerequisite()
    if reason is not None:
        pytest.skip(reason)
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, str(TOOL), "--report", str(report_path)],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(report_path.read_text())
    assert {check["check"] for check in report["checks"]} == EXPECTED_CHECKS
    sizes = {ref.split("/")[-1].split(":")[0]: info["size_bytes"] for ref, info in report["images"].items()}
    assert sizes["vllm-kvpress-ext-cpu"] < MAX_CPU_IMAGE_BYTES, sizes
    assert sizes["vllm-kvpress-ext-vllm"] - sizes["kvpress-vllm-base"] < MAX_VLLM_LAYERS_BYTES, sizes
    # The size table the tool prints is what docs/deploy.md reports.
    assert "| `localhost/vllm-kvpress-ext-cpu:" in result.stdout
