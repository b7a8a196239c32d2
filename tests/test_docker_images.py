"""The Dockerfiles: hadolint-clean, pinned, non-root with a health check, and buildable from what
.dockerignore lets into the context. (tests/test_container_images.py builds and runs the images
themselves with podman, where it is installed; docs/deploy.md says what was and was not verified.)"""

from __future__ import annotations

import fnmatch
import re
from importlib.metadata import requires
from pathlib import Path

import pytest
import yaml
from deploy_utils import DOCKER, REPO, run_tool
from packaging.requirements import Requirement

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.vllm")
#: The serving images, plus the stand-in base with vLLM for where vLLM's own image cannot be pulled.
ALL_DOCKERFILES = (*DOCKERFILES, "Dockerfile.vllm-base")
HADOLINT_CONFIG = DOCKER / "hadolint.yaml"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def _final_stage(path: Path) -> list[tuple[str, str]]:
    instructions = _instructions(path)
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def _args(path: Path) -> dict[str, str]:
    return dict(arg.split("=", 1) for name, arg in _instructions(path) if name == "ARG" and "=" in arg)


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_hadolint_passes_with_no_ignored_rules(dockerfile: str) -> None:
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert not config.get("ignored") and config["failure-threshold"] == "info"
    assert not any(key in config for key in ("override", "trustedRegistries")), "rules must not be relaxed"
    assert "hadolint ignore" not in (DOCKER / dockerfile).read_text()  # no inline exceptions either
    result = run_tool("hadolint", "--config", str(HADOLINT_CONFIG), str(DOCKER / dockerfile))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_config_requires_the_labels(tmp_path: Path) -> None:
    # Drop the licence label from a copy: the shared config must turn that into a failure.
    text = (DOCKER / "Dockerfile.cpu").read_text()
    stripped = re.sub(r'\s*org\.opencontainers\.image\.licenses="[^"]*" \\', "", text)
    assert stripped != text
    broken = tmp_path / "Dockerfile"
    broken.write_text(stripped)
    result = run_tool("hadolint", "--config", str(HADOLINT_CONFIG), str(broken))
    assert result.returncode != 0 and "org.opencontainers.image.licenses" in result.stdout


def test_entrypoint_scripts_pass_shellcheck() -> None:
    scripts = sorted(str(p) for p in DOCKER.glob("entrypoint-*.sh"))
    assert len(scripts) == 2
    result = run_tool("shellcheck", *scripts)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_final_stage_is_non_root_with_healthcheck_and_entrypoint(dockerfile: str) -> None:
    final = _final_stage(DOCKER / dockerfile)
    names = [name for name, _ in final]
    users = [arg for name, arg in final if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    (healthcheck,) = [arg for name, arg in final if name == "HEALTHCHECK"]
    assert '"kvpress-healthcheck"' in healthcheck
    assert [arg for name, arg in final if name == "ENTRYPOINT"] == ['["kvpress-entrypoint"]']
    labels = " ".join(arg for name, arg in final if name == "LABEL")
    for key in ("title", "version", "licenses", "description"):
        assert f"org.opencontainers.image.{key}=" in labels
    # Port agreement: the entrypoint binds KVPRESS_PORT, the image exposes it, the manifests use it.
    env = " ".join(arg for name, arg in final if name == "ENV")
    (exposed,) = [arg for name, arg in final if name == "EXPOSE"]
    assert f"KVPRESS_PORT={exposed}" in env and exposed == "8000"
    # No compiler or package manager install in the final stage: everything is built earlier.
    runs = " ".join(arg for name, arg in final if name == "RUN")
    assert not re.search(r"apt-get|apt |gcc|build-essential|pip wheel", runs), runs
    assert names.count("FROM") == 1


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_base_images_are_pinned(dockerfile: str) -> None:
    args = _args(DOCKER / dockerfile)
    for name, arg in _instructions(DOCKER / dockerfile):
        if name != "FROM" or arg.split()[0] == "scratch":  # scratch: the empty torch-wheels default
            continue
        image = arg.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest", f"{dockerfile}: {image} is not pinned to a version"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{dockerfile}: {image} tag is not a full version"


def _requirements() -> list[Requirement]:
    """The installed package's declared requirements (pyproject's dependencies and extras)."""
    return [Requirement(text) for text in requires("vllm-kvpress-ext") or []]


def test_vllm_image_matches_the_pinned_extra() -> None:
    (pin,) = [r for r in _requirements() if r.marker is not None and r.marker.evaluate({"extra": "vllm"})]
    assert pin.name == "vllm"
    (spec,) = list(pin.specifier)
    assert spec.operator == "=="
    text = (DOCKER / "Dockerfile.vllm").read_text()
    assert _args(DOCKER / "Dockerfile.vllm")["VLLM_IMAGE"] == f"vllm/vllm-openai:v{spec.version}"
    assert f'echo "vllm=={spec.version}"' in text  # the constraint that keeps pip from replacing vLLM


def test_cpu_constraints_pin_every_runtime_dependency() -> None:
    pins = {}
    for line in (DOCKER / "constraints-cpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints-cpu.txt: {line!r} is not an exact pin"
            pins[name.lower().replace("_", "-")] = version
    runtime = [r for r in _requirements() if r.marker is None]
    assert runtime
    for requirement in runtime:
        key = requirement.name.lower().replace("_", "-")
        assert key in pins, f"{requirement.name} has no pin in docker/constraints-cpu.txt"
        assert requirement.specifier.contains(pins[key]), f"{key}=={pins[key]} violates {requirement}"
    args = _args(DOCKER / "Dockerfile.cpu")
    assert pins["torch"] == args["TORCH_VERSION"]
    build_requires = re.search(r'requires = \["setuptools([^"]*)"', (REPO / "pyproject.toml").read_text())
    assert build_requires is not None
    assert Requirement(f"setuptools{build_requires.group(1)}").specifier.contains(pins["setuptools"])
    assert "wheel" in pins


def _dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path (or one of its parent folders) decides."""
    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, glob[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, glob) for prefix in prefixes)
        if hit:
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile: str) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = 0
    for name, arg in _instructions(DOCKER / dockerfile):
        if name != "COPY" or "--from=" in arg:
            continue
        sources = [word for word in arg.split() if not word.startswith("--")][:-1]
        for source in sources:
            matches = [p for p in REPO.glob(source) if "__pycache__" not in p.parts]
            assert matches, f"{dockerfile}: COPY source {source} does not exist"
            for match in matches:
                files = [match] if match.is_file() else [f for f in match.rglob("*") if f.is_file()]
                for file in files:
                    relative = file.relative_to(REPO).as_posix()
                    if "__pycache__" in relative or relative.endswith(".pyc"):
                        continue
                    assert _dockerignore_allows(relative, patterns), f"{relative} is excluded by .dockerignore"
                    copied += 1
    assert copied > 0
    # And the context stays small: the tests, the docs and any virtual environment stay out.
    for outside in ("tests/test_server.py", "docs/server.md", ".venv/bin/python", ".git/HEAD"):
        assert not _dockerignore_allows(outside, patterns), outside


def test_cpu_image_serves_the_bundled_model_by_default() -> None:
    # The build stage links the installed package's bundled model at a fixed path; the final stage's
    # KVPRESS_MODEL_DIR names that path, so the default does not follow `kvpress serve`'s own.
    instructions = _instructions(DOCKER / "Dockerfile.cpu")
    runs = " ".join(arg for name, arg in instructions if name == "RUN")
    link = re.search(r"ln -s \"\$\(python -P -c '([^']*)'\)\"\s+(\S+)", runs)
    assert link is not None, "the build stage should link the bundled model"
    assert "default_model_dir()" in link.group(1)
    env = " ".join(arg for name, arg in _final_stage(DOCKER / "Dockerfile.cpu") if name == "ENV")
    assert f"KVPRESS_MODEL_DIR={link.group(2)}" in env
    assert link.group(2).startswith("/opt/kvpress/")  # inside the environment the final stage copies


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_pip_steps_take_the_ca_bundle_as_a_secret_only(dockerfile: str) -> None:
    # A proxy's CA bundle reaches pip as the build secret `pip-ca`, mounted for the step that runs pip
    # and never stored: no ENV, ARG or COPY carries it into a layer or the image's history.
    instructions = _instructions(DOCKER / dockerfile)
    pip_runs = [arg for name, arg in instructions if name == "RUN" and re.search(r"pip (install|wheel)", arg)]
    assert pip_runs
    for run in pip_runs:
        assert "--mount=type=secret,id=pip-ca,required=false" in run, run
        assert "export PIP_CERT=/run/secrets/pip-ca" in run, run
    for name, arg in instructions:
        if name in ("ENV", "ARG", "COPY", "ADD"):
            assert "PIP_CERT" not in arg and ".crt" not in arg and "pip-ca" not in arg, f"{name} {arg}"


@pytest.mark.parametrize("dockerfile", ("Dockerfile.cpu", "Dockerfile.vllm-base"))
def test_torch_comes_from_build_arguments_never_from_a_layer(dockerfile: str) -> None:
    # Torch's source is TORCH_INDEX_URL or the `torch-wheels` build context, an empty stage unless
    # given; the wheels are bind-mounted for the step that installs torch, never copied.
    instructions = _instructions(DOCKER / dockerfile)
    stages = [arg.split() for name, arg in instructions if name == "FROM"]
    assert ["scratch", "AS", "torch-wheels"] in stages
    assert "TORCH_INDEX_URL" in _args(DOCKER / dockerfile)
    assert not any("torch-wheels" in arg for name, arg in instructions if name in ("COPY", "ADD"))
    (torch_run,) = [arg for name, arg in instructions if name == "RUN" and "torch==${TORCH_VERSION}" in arg]
    assert "--mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels" in torch_run
    assert "--find-links /tmp/torch-wheels" in torch_run
    # An empty TORCH_INDEX_URL means the wheels alone: pip must not reach for an index then.
    assert 'export PIP_INDEX_URL="${TORCH_INDEX_URL}"; else export PIP_NO_INDEX=1' in torch_run
