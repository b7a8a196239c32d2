"""Shared helpers for the deployment tests: the repository's paths, the dev tools, rendered manifests.

The tools (hadolint, shellcheck, kubectl) come from the `dev` extra as wheels, so they sit beside the
test interpreter; a missing one is a failure naming the install step, never a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
OVERLAYS = ("cpu", "gpu")
AUTOSCALING_COMPONENT = K8S / "components" / "kv-autoscaling"
#: The Kubernetes version every rendered object is validated against (docs/deploy.md states it).
KUBERNETES_VERSION = "1.33.0"


def tool(name: str) -> str:
    """The dev extra's copy of a command-line tool (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: run `make install` (the dev extra ships it as a wheel)")
    return found


def run_tool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool(args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`, parsed: one dict per rendered object."""
    result = run_tool("kubectl", "kustomize", str(directory))
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_with_autoscaling(overlay: str, scratch: Path) -> list[dict[str, Any]]:
    """An overlay plus the opt-in autoscaling component, as a user's own kustomization would add it.

    kustomize takes only relative paths to other kustomizations, so the scratch one points back
    into the repository with `..` segments.
    """
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, scratch)],
        "components": [os.path.relpath(AUTOSCALING_COMPONENT, scratch)],
    }
    (scratch / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(scratch)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    by_name = {c["name"]: c for c in containers}
    assert "server" in by_name, f"no container named server in {sorted(by_name)}"
    container: dict[str, Any] = by_name["server"]
    return container


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env (every value in these manifests is a literal)."""
    env = {}
    for item in container.get("env", []):
        assert "value" in item, f"env {item['name']} is not a literal value"
        env[item["name"]] = item["value"]
    return env


def printed_command(script: Path, *args: str, env: dict[str, str]) -> list[str]:
    """The command line an image's entrypoint `script` builds in the environment `env`, one argument each
    (`KVPRESS_PRINT_COMMAND=1` prints it instead of running it)."""
    result = subprocess.run(
        [str(script), *args],
        env={**env, "KVPRESS_PRINT_COMMAND": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()
