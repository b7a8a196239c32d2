"""Both images built with podman and run as the Kubernetes manifests run them (tools/build_images.py).

Slow, and only where podman and runc are installed (as root): the bases are reused once built, so a
run builds the two images on them and starts each container. Without podman the test is skipped with
the reason; docs/deploy.md says how long a run takes and what it checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_utils import REPO

pytestmark = pytest.mark.slow

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
