"""Build both container images with podman and check that they serve, with no Docker and no registry.

Every base comes from what a machine without registry access reaches: Debian's archive and the
package index (docs/deploy.md, "Build and run with podman"). In order, each step reusing what exists:

1. The Python base: Debian bookworm's python3 and venv from `debootstrap --variant=minbase`, trimmed
   (no apt lists, package cache, docs or locales) and imported as BASE_IMAGE.
2. The vLLM base: docker/Dockerfile.vllm-base on it (vLLM 0.33.0 from the package index), VLLM_BASE_IMAGE.
3. The CPU image and the vLLM image from docker/Dockerfile.cpu and docker/Dockerfile.vllm on those
   bases, torch from a folder of wheels (--torch-wheels) or an index (--torch-index-url), pip's CA
   bundle given as a build secret, never stored in a layer.
4. Checks, each container run as its Kubernetes manifest runs it: its own non-root user, a read-only
   root filesystem with /tmp the one writable mount, every capability dropped. The CPU image: the
   entrypoint's command line and its refusal of a bad variable; the server started from KVPRESS_*
   variables passes the image's HEALTHCHECK, answers a chat request through the openai SDK with the
   configured policy, served name and pool size, and stops cleanly on SIGTERM; nothing of a build
   (compiler, pip cache, wheels, source tree) is in it. The vLLM image: `vllm serve --kv-policy` from
   KVPRESS_* variables, the bundled model mounted read-only, passes the HEALTHCHECK and answers a chat
   request with the policy and the plugin's `kvpress_*` metrics.
5. The images' sizes, printed as a Markdown table (and with every check in --report FILE, as JSON).

podman must run as root (debootstrap and the base import need it) with runc: containers run through
a generated containers.conf without cgroup, pids or rlimit settings, which this kind of machine
(cgroup v1, no systemd) cannot apply.

Usage: python tools/build_images.py [--report FILE] [--skip-vllm] [--rebuild-bases] [options]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "localhost/kvpress-base-python:3.11-bookworm"
VLLM_BASE_IMAGE = "localhost/kvpress-vllm-base:0.33.0"
#: Debian packages of the Python base; everything else there is debootstrap's minbase.
BASE_PACKAGES = ("python3", "python3-venv")
#: Removed from the debootstrapped tree before import: nothing in the images reads them.
BASE_TRIM = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*", "usr/share/doc/*",
             "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*")  # fmt: skip
# No cgroup, pids or rlimit settings: runc applies none then, which a cgroup-v1 machine without
# systemd needs (crun, podman's default, fails on setrlimit and on hybrid cgroups there). With
# CONTAINERS_CONF set podman reads no other containers.conf, so logs and events go to files here
# (the built-in default is journald, which such a machine does not run).
CONTAINERS_CONF = """[containers]
default_ulimits = []
pids_limit = 0
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# How the Kubernetes manifests run the server container (docker/k8s/base/deployment.yaml): the image's
# own non-root user, a read-only root with /tmp the one writable mount, no capability, no escalation.
RESTRICTED_RUN = ("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777,size=1g",
                  "--cap-drop", "all", "--security-opt", "no-new-privileges")  # fmt: skip
IMAGE_USER_ID = "10001"
CPU_POOL_BYTES = 64 * 2**20


class CheckFailed(RuntimeError):
    """A build or a check did not give what it must."""


@dataclass
class Report:
    images: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[dict[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def passed(self, name: str, detail: str) -> None:
        self.checks.append({"check": name, "detail": detail})
        log(f"ok: {name}: {detail}")


def log(message: str) -> None:
    print(f"[build_images] {message}", file=sys.stderr, flush=True)


class Podman:
    """podman, always with runc and the generated containers.conf."""

    def __init__(self, conf: Path) -> None:
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["podman", "--runtime", "runc", *args], env=self.env, capture_output=True, text=True, check=False
        )
        if check and result.returncode != 0:
            raise CheckFailed(f"podman {' '.join(args[:3])} ... failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result

    def stream(self, *args: str) -> None:
        """A long command (a build) with its output passed through, so progress shows."""
        status = subprocess.run(["podman", "--runtime", "runc", *args], env=self.env, check=False).returncode
        if status != 0:
            raise CheckFailed(f"podman {' '.join(args)} failed ({status})")

    def image_exists(self, image: str) -> bool:
        return self.run("image", "exists", image, check=False).returncode == 0

    def image_size(self, image: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_source(args: argparse.Namespace, dockerfile: str) -> dict[str, str]:
    """TORCH_INDEX_URL for one Dockerfile: the one given, unless the wheels folder was meant to supply torch but
    holds no wheel of the version that Dockerfile pins (the CPU image keeps torch 2.13.0, whose wheel lies here;
    the vLLM base takes the torch its vLLM pins): then PyTorch's CPU index."""
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)", (args.context / "docker" / dockerfile).read_text(), re.M)
    wheels = Path(args.torch_wheels) if args.torch_wheels else None
    if pinned and wheels and not args.torch_index_url and not any(wheels.glob(f"torch-{pinned.group(1)}[+-]*.whl")):
        log(f"{dockerfile}: no torch {pinned.group(1)} wheel in {wheels}; torch comes from {CPU_TORCH_INDEX}")
        return {"TORCH_INDEX_URL": CPU_TORCH_INDEX}
    return {"TORCH_INDEX_URL": args.torch_index_url}


def package_version() -> str:
    """The package's version (vllm_kvpress_ext.__version__, pyproject's dynamic version), read as text."""
    match = re.search(r'^__version__ = "([^"]+)"', (REPO / "vllm_kvpress_ext" / "__init__.py").read_text(), re.M)
    if match is None:
        raise CheckFailed("no __version__ in vllm_kvpress_ext/__init__.py")
    return match.group(1)


def make_base(podman: Podman, mirror: str) -> None:
    """Debian bookworm's python3 from the archive, imported as BASE_IMAGE."""
    if shutil.which("debootstrap") is None:
        raise CheckFailed("debootstrap is not installed (apt-get install debootstrap), and BASE_IMAGE is absent")
    with tempfile.TemporaryDirectory(prefix="kvpress-rootfs-", dir="/var/tmp") as scratch:
        rootfs = Path(scratch) / "rootfs"
        include = ",".join(BASE_PACKAGES)
        log(f"debootstrap --variant=minbase --include={include} bookworm {rootfs} {mirror}")
        status = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={include}", "bookworm", str(rootfs), mirror],
            stdout=subprocess.DEVNULL,
            check=False,
        ).returncode
        if status != 0:
            raise CheckFailed(f"debootstrap failed ({status})")
        for pattern in BASE_TRIM:
            for path in rootfs.glob(pattern):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        imported = subprocess.run(
            ["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_IMAGE],
            stdin=tar.stdout,
            env=podman.env,
            capture_output=True,
            text=True,
            check=False,
        )
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise CheckFailed(f"importing the base failed: {imported.stderr[-2000:]}")


def build(
    podman: Podman, args: argparse.Namespace, dockerfile: str, image: str, build_args: dict[str, str], *, no_cache: bool
) -> None:
    """podman build; the image the tag named before, if this build replaced it, is removed (when unused)."""
    previous = podman.run("image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()
    # --format docker: the OCI format has no HEALTHCHECK, and podman would drop it.
    command = ["build", "--isolation=chroot", "--format", "docker", "--pull=never"]
    command += ["-f", str(args.context / "docker" / dockerfile)]
    if no_cache:
        command.append("--no-cache")
    for name, value in build_args.items():
        command += ["--build-arg", f"{name}={value}"]
    if args.torch_wheels:
        command += ["--build-context", f"torch-wheels={args.torch_wheels}"]
    if args.ca_bundle:
        command += ["--secret", f"id=pip-ca,src={args.ca_bundle}"]
    command += ["-t", image, str(args.context)]
    log(f"podman {' '.join(command)}")
    podman.stream(*command)
    current = podman.run("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    if previous and previous != current:
        podman.run("rmi", previous, check=False)  # refused while a container or another tag uses it


@contextmanager
def container(podman: Podman, name: str, *run_args: str) -> Iterator[str]:
    """A detached container, removed on the way out (its log printed when something failed)."""
    podman.run("rm", "--force", "--ignore", name, check=False)
    podman.run("run", "--detach", "--name", name, *run_args)
    try:
        yield name
    except BaseException:
        logs = podman.run("logs", "--tail", "60", name, check=False)
        log(f"last lines of {name}'s log:\n{logs.stdout}{logs.stderr}")
        raise
    finally:
        podman.run("rm", "--force", "--time", "5", name, check=False)


def wait_healthy(podman: Podman, name: str, timeout: float) -> float:
    """Run the image's own HEALTHCHECK until it passes; the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        state = podman.run("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        if state != "true":
            raise CheckFailed(f"{name} stopped before it was healthy")
        if podman.run("healthcheck", "run", name, check=False).returncode == 0:
            return time.monotonic() - start
        time.sleep(2)
    raise CheckFailed(f"{name} was not healthy after {timeout:.0f} s")


def check_restricted(podman: Podman, report: Report, name: str, label: str) -> None:
    uid = podman.run("exec", name, "id", "-u").stdout.strip()
    if uid != IMAGE_USER_ID:
        raise CheckFailed(f"{name} runs as uid {uid}, not {IMAGE_USER_ID}")
    if podman.run("exec", name, "touch", "/opt/probe", check=False).returncode == 0:
        raise CheckFailed(f"{name}: the root filesystem is writable")
    podman.run("exec", name, "touch", "/tmp/probe")
    report.passed(f"{label} runs restricted", f"uid {uid}, root filesystem read-only, /tmp writable")


def chat(port: int, model: str) -> tuple[str, dict[str, Any]]:
    """One greedy chat request through the openai SDK: the answer and the usage's extra fields."""
    import openai  # the dev extra's client; imported here so --help works without it

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "key trout is 65 . what is key trout ?"}],
        max_tokens=8,
        temperature=0.0,
    )
    if response.model != model:
        raise CheckFailed(f"the response names model {response.model!r}, not {model!r}")
    answer = response.choices[0].message.content or ""
    if response.usage is None or response.usage.completion_tokens < 1:
        raise CheckFailed(f"no tokens generated: {response}")
    return answer, dict(response.usage.model_extra or {})


def metrics(port: int) -> dict[str, float]:
    """The unlabelled `kvpress_*` samples of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(kvpress_\w+) ([-+.\deE]+|NaN)", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def check_cpu_image(podman: Podman, report: Report, image: str) -> None:
    printed = podman.run(
        "run", "--rm", *RESTRICTED_RUN, "-e", "KVPRESS_PRINT_COMMAND=1", "-e", "KVPRESS_KV_POLICY=gvote", image
    ).stdout.splitlines()
    expected = ["kvpress", "serve", "/opt/kvpress/default-model", "--kv-policy", "/etc/kvpress/presets/gvote.yaml",
                "--host", "0.0.0.0", "--port", "8000"]  # fmt: skip
    if printed != expected:
        raise CheckFailed(f"the CPU entrypoint built {printed}, expected {expected}")
    report.passed("cpu entrypoint command", " ".join(printed))
    refused = podman.run("run", "--rm", "-e", "KVPRESS_PORT=eighty", image, check=False)
    if refused.returncode != 2 or "KVPRESS_PORT must be an integer" not in refused.stderr:
        raise CheckFailed(f"a bad KVPRESS_PORT was not refused: {refused.returncode} {refused.stderr!r}")
    message = [line for line in refused.stderr.splitlines() if line.startswith("kvpress-entrypoint:")]
    report.passed("cpu entrypoint refuses a bad variable", f"exit status 2, {' '.join(message)}")

    port = free_port()
    served = "kvpress-cpu"
    config = {"KVPRESS_HOST": "127.0.0.1", "KVPRESS_PORT": str(port), "KVPRESS_KV_POLICY": "gvote",
              "KVPRESS_KV_MEMORY": "64MiB", "KVPRESS_MAX_NUM_SEQS": "8", "KVPRESS_SERVED_MODEL_NAME": served,
              "OMP_NUM_THREADS": "2"}  # fmt: skip
    env_args = [word for key, value in config.items() for word in ("-e", f"{key}={value}")]
    name = f"kvpress-cpu-check-{os.getpid()}"
    with container(podman, name, "--network", "host", *RESTRICTED_RUN, *env_args, image):
        healthy_after = wait_healthy(podman, name, timeout=300)
        report.seconds["cpu_healthy"] = round(healthy_after, 1)
        report.passed("cpu HEALTHCHECK", f"passed {healthy_after:.0f} s after start")
        check_restricted(podman, report, name, "cpu container")
        answer, usage = chat(port, served)
        if usage.get("kv_policy") != "gvote":
            raise CheckFailed(f"the chat request ran with {usage.get('kv_policy')!r}, not KVPRESS_KV_POLICY=gvote")
        report.passed("cpu chat through the openai SDK", f"model {served}, kv_policy gvote, answer {answer!r}")
        samples = metrics(port)
        pool = samples.get("kvpress_kv_pages_total", 0) * samples.get("kvpress_kv_page_bytes", 0)
        if pool != CPU_POOL_BYTES:
            raise CheckFailed(f"the pool holds {pool:.0f} B, not KVPRESS_KV_MEMORY=64MiB")
        report.passed("cpu KVPRESS_KV_MEMORY", f"{samples['kvpress_kv_pages_total']:.0f} pages = 64 MiB")
        podman.run("stop", "--time", "30", name)
        status = podman.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        if status != "0":
            raise CheckFailed(f"the CPU server exited with status {status} on SIGTERM")
        report.passed("cpu graceful stop", "SIGTERM: exit status 0")

    # Nothing of the build stage reaches the final one: no compiler, no wheel, no pip cache, no source
    # tree, no tests. (The environment's own pip stays: it is how a user extends the image. So do the
    # base's pip and setuptools wheels in /usr/share/python-wheels, Debian's python3-venv: they are
    # what `python3 -m venv` installs.)
    leftovers = podman.run(
        "run", "--rm", "--entrypoint", "/bin/sh", image, "-c",
        "command -v gcc cc c++ g++ make; find / -xdev -path /usr/share/python-wheels -prune -o \\( -name '*.whl'"
        " -o -path '*/.cache/pip'"
        " -o -path /src -o -path /wheels -o -path '*/site-packages/tests' \\) -print 2>/dev/null",
        check=False,
    ).stdout.split()  # fmt: skip
    if leftovers:
        raise CheckFailed(f"the CPU image holds build leftovers: {leftovers}")
    report.passed("cpu image content", "no compiler, wheel, pip cache or source tree")


def check_vllm_image(podman: Podman, report: Report, image: str) -> None:
    port = free_port()
    served = "kvpress-vllm"
    model = REPO / "vllm_kvpress_ext" / "assets" / "default_model"
    config = {"KVPRESS_MODEL_DIR": "/models/model", "KVPRESS_HOST": "127.0.0.1", "KVPRESS_PORT": str(port),
              "KVPRESS_KV_POLICY": "snapkv", "KVPRESS_MAX_NUM_SEQS": "4", "KVPRESS_MAX_MODEL_LEN": "1024",
              "KVPRESS_SERVED_MODEL_NAME": served}  # fmt: skip
    env_args = [word for key, value in config.items() for word in ("-e", f"{key}={value}")]
    # Arguments after the image go to `vllm serve` unchanged: a float32 model and a small pool.
    serve_args = ["--dtype", "float32", "--additional-config", json.dumps({"kv_num_pages": 2000})]
    name = f"kvpress-vllm-check-{os.getpid()}"
    volume = f"{model}:/models/model:ro"
    with container(podman, name, "--network", "host", *RESTRICTED_RUN, "-v", volume, *env_args, image, *serve_args):
        healthy_after = wait_healthy(podman, name, timeout=900)
        report.seconds["vllm_healthy"] = round(healthy_after, 1)
        report.passed("vllm HEALTHCHECK", f"passed {healthy_after:.0f} s after start")
        check_restricted(podman, report, name, "vllm container")
        process = podman.run("exec", name, "cat", "/proc/1/cmdline").stdout.replace("\0", " ").strip()
        if "vllm serve /models/model --kv-policy /etc/kvpress/presets/snapkv.yaml" not in process:
            raise CheckFailed(f"PID 1 is not the expected vllm serve: {process}")
        report.passed("vllm command from KVPRESS_* variables", process)
        answer, usage = chat(port, served)
        if usage.get("kv_policy") != "snapkv":
            raise CheckFailed(f"the chat request ran with {usage.get('kv_policy')!r}, not KVPRESS_KV_POLICY=snapkv")
        report.passed("vllm chat through the openai SDK", f"model {served}, kv_policy snapkv, answer {answer!r}")
        samples = metrics(port)
        if samples.get("kvpress_kv_pages_total") != 2000:
            raise CheckFailed(f"the plugin's pool is not the 2000 pages asked for: {samples}")
        report.passed("vllm plugin metrics", "kvpress_kv_pages_total 2000 on vLLM's /metrics")

    # What this image adds to its base leaves nothing of the build behind: no pip cache, no wheel of
    # the package, no source tree (the base is vLLM's and keeps what it ships).
    leftovers = podman.run(
        "run", "--rm", "--entrypoint", "/bin/sh", image, "-c",
        "find / -xdev \\( -path '*/.cache/pip' -o -name 'vllm_kvpress_ext-*.whl' -o -path /tmp/wheels"
        " -o -path /src \\) -print 2>/dev/null",
        check=False,
    ).stdout.split()  # fmt: skip
    if leftovers:
        raise CheckFailed(f"the vLLM image holds build leftovers: {leftovers}")
    report.passed("vllm image content", "no pip cache, package wheel or source tree")


def size_table(report: Report) -> str:
    lines = ["| image | size (podman) |", "| --- | --- |"]
    for ref, info in report.images.items():
        lines.append(f"| `{ref}` | {info['size_bytes'] / 1e6:,.0f} MB |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    default_ca = next((p for p in (os.environ.get("PIP_CERT"), "/etc/ssl/certs/ca-certificates.crt") if p), "")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=Path, default=REPO, help="build context (default: this checkout)")
    parser.add_argument(
        "--torch-wheels",
        default="/opt/wheels" if Path("/opt/wheels").is_dir() else "",
        help="folder holding the torch wheel, the `torch-wheels` build context (default /opt/wheels if present)",
    )
    parser.add_argument(
        "--torch-index-url",
        default=None,
        help="index for torch (default: none when --torch-wheels is given, else PyTorch's CPU index)",
    )
    parser.add_argument(
        "--ca-bundle",
        default=default_ca if Path(default_ca).is_file() else "",
        help="CA bundle pip needs to reach the index, given as the build secret pip-ca ('' for none; "
        "default $PIP_CERT or /etc/ssl/certs/ca-certificates.crt)",
    )
    parser.add_argument("--debian-mirror", default="http://deb.debian.org/debian", help="Debian archive for the base")
    parser.add_argument(
        "--rebuild-bases", action="store_true", help="rebuild both bases even if they exist (no layer cache)"
    )
    parser.add_argument("--no-cache", action="store_true", help="build the two images without podman's layer cache")
    parser.add_argument("--skip-vllm", action="store_true", help="the CPU image only")
    parser.add_argument("--report", type=Path, help="write the checks, timings and sizes here as JSON")
    args = parser.parse_args(argv)
    if args.torch_index_url is None:
        args.torch_index_url = "" if args.torch_wheels else CPU_TORCH_INDEX
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for command in ("podman", "runc"):
        if shutil.which(command) is None:
            log(f"{command} is not installed: apt-get install podman runc debootstrap")
            return 2
    report = Report()
    version = package_version()
    cpu_image = f"localhost/vllm-kvpress-ext-cpu:{version}"
    vllm_image = f"localhost/vllm-kvpress-ext-vllm:{version}"
    with tempfile.TemporaryDirectory(prefix="kvpress-podman-") as scratch:
        conf = Path(scratch) / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        podman = Podman(conf)
        try:
            started = time.monotonic()
            if args.rebuild_bases or not podman.image_exists(BASE_IMAGE):
                make_base(podman, args.debian_mirror)
            report.seconds["base"] = round(time.monotonic() - started, 1)
            started = time.monotonic()
            cpu_args = {"PYTHON_IMAGE": BASE_IMAGE, "VERSION": version, **torch_source(args, "Dockerfile.cpu")}
            build(podman, args, "Dockerfile.cpu", cpu_image, cpu_args, no_cache=args.no_cache)
            report.seconds["cpu_build"] = round(time.monotonic() - started, 1)
            images = [BASE_IMAGE, cpu_image]
            if not args.skip_vllm:
                started = time.monotonic()
                if args.rebuild_bases or not podman.image_exists(VLLM_BASE_IMAGE):
                    base_args = {"PYTHON_IMAGE": BASE_IMAGE, **torch_source(args, "Dockerfile.vllm-base")}
                    build(podman, args, "Dockerfile.vllm-base", VLLM_BASE_IMAGE, base_args, no_cache=True)
                report.seconds["vllm_base"] = round(time.monotonic() - started, 1)
                started = time.monotonic()
                vllm_args = {"PYTHON_IMAGE": BASE_IMAGE, "VLLM_IMAGE": VLLM_BASE_IMAGE, "VERSION": version}
                build(podman, args, "Dockerfile.vllm", vllm_image, vllm_args, no_cache=args.no_cache)
                report.seconds["vllm_build"] = round(time.monotonic() - started, 1)
                images += [VLLM_BASE_IMAGE, vllm_image]
            for image in images:
                report.images[image] = {"size_bytes": podman.image_size(image)}
            started = time.monotonic()
            check_cpu_image(podman, report, cpu_image)
            report.seconds["cpu_checks"] = round(time.monotonic() - started, 1)
            if not args.skip_vllm:
                started = time.monotonic()
                check_vllm_image(podman, report, vllm_image)
                report.seconds["vllm_checks"] = round(time.monotonic() - started, 1)
        except CheckFailed as exc:
            log(f"FAILED: {exc}")
            if args.report:
                args.report.write_text(json.dumps({**asdict(report), "failure": str(exc)}, indent=2))
            return 1
    if args.report:
        args.report.write_text(json.dumps(asdict(report), indent=2))
    print(size_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
