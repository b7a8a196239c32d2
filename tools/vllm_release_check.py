"""Check the plugin against a vLLM release from the package index, in a scratch environment.

    python tools/vllm_release_check.py                 # the newest release
    python tools/vllm_release_check.py --vllm 0.33.0   # a given one
    python tools/vllm_release_check.py --tests tests/test_vllm_native_runner.py -- -x

It creates a virtual environment (`build/vllm-<version>`, kept for the next run), installs that vLLM
with the torch it pins, this checkout (editable, with its own dependencies) and the test tools, then:

1. **Interfaces.** Every name the plugin imports from vLLM (`from vllm.x import Y` anywhere under
   `vllm_kvpress_ext/`, found by parsing the source) is imported in the new environment; the ones that
   moved or vanished are listed with where the plugin uses them. This is the list to read first: a
   release that renames one of them breaks the plugin at that line.
2. **Patches.** Every vLLM internal the plugin overrides, wraps or replaces (`vllm_plugin/patches.py`,
   with the parameters the pinned vLLM gives each) is looked up there; the ones that are gone or take
   other parameters are listed.
3. **Tests.** The plugin's tests (`tests/test_vllm_*.py` by default) run there; each failure is listed
   with its error and the last vLLM frame of its traceback, i.e. where the plugin met vLLM.

The exit status is 0 when every name imports and every patched internal is unchanged (a missing driver
library, e.g. CUDA's on a CPU machine, is the machine's and does not count) and every test passes.
Nothing in the project's own environment changes.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_kvpress_ext"
DEFAULT_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_vllm_*.py"))
# An error that is this machine's (a driver library missing, e.g. CUDA's on a CPU machine), not the release's.
MACHINE = "cannot open shared object file"
TEST_TOOLS = ["pytest>=8.0", "hypothesis>=6.100", "openai>=1.30", "httpx>=0.27", "accelerate>=1.0", "pyyaml", "tqdm"]


def newest_release() -> str:
    """The newest vLLM version on PyPI (its JSON API; pip's own index settings are not consulted)."""
    with urllib.request.urlopen("https://pypi.org/pypi/vllm/json", timeout=30) as response:
        return str(json.load(response)["info"]["version"])


def vllm_imports() -> list[tuple[str, str, str]]:
    """(module, name, "file:line") of every `from vllm... import name` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    found.append((node.module, alias.name, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(command).splitlines()[0][:200], flush=True)
    return subprocess.run(command, text=True, check=False, **kwargs)  # type: ignore[call-overload]


def prepare(venv: Path, version: str) -> Path:
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.is_file() and stamp.read_text().strip() == version:
        return python
    if not python.exists():
        run([sys.executable, "-m", "venv", str(venv)]).check_returncode()
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    # One resolution: this checkout's own dependencies (gguf, ...) beside that vLLM and the torch it pins.
    run([*pip, f"vllm=={version}", "-e", str(ROOT), *TEST_TOOLS]).check_returncode()
    # As in the Makefile: vLLM brings these built for another torch, and transformers then fails to import.
    run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    stamp.write_text(version + "\n")
    return python


def check_imports(python: Path) -> list[str]:
    """The plugin's vLLM imports that fail in the new environment, each with its error and uses."""
    wanted: dict[tuple[str, str], list[str]] = {}
    for module, name, where in vllm_imports():
        wanted.setdefault((module, name), []).append(where)
    probe = (
        "import importlib, json, sys\n"
        "failed = {}\n"
        "for module, name in json.loads(sys.stdin.read()):\n"
        "    try:\n"
        "        parent = importlib.import_module(module)\n"
        "        if not hasattr(parent, name):\n"
        "            importlib.import_module(module + '.' + name)  # a submodule, imported by name\n"
        "    except Exception as exc:\n"
        "        failed[module + ':' + name] = f'{type(exc).__name__}: {exc}'[:200]\n"
        "print(json.dumps(failed))\n"
    )
    done = run([str(python), "-c", probe], input=json.dumps(list(wanted)), capture_output=True)
    if done.returncode != 0:
        return [f"the import probe itself failed:\n{done.stderr[-2000:]}"]
    failed: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    lines = []
    for key, error in sorted(failed.items()):
        module, name = key.split(":")
        # A missing driver library is this machine (no CUDA here), not the release.
        machine = "  [the machine: no such library here]" if MACHINE in error else ""
        lines.append(f"{key}  ({error}){machine}\n      used at {', '.join(wanted[(module, name)])}")
    return lines


def check_patches(python: Path) -> list[str]:
    """`vllm_plugin/patches.py`'s list against the new environment: every vLLM internal the plugin overrides,
    wraps or replaces that is gone or takes other parameters there."""
    probe = "import json\nfrom vllm_kvpress_ext.vllm_plugin.patches import drift\nprint(json.dumps(drift()))\n"
    done = run([str(python), "-c", probe], capture_output=True)
    if done.returncode != 0:
        return [f"the patch probe itself failed:\n{done.stderr[-2000:]}"]
    lines: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return [line + ("  [the machine: no such library here]" if MACHINE in line else "") for line in lines]


def failures(report: str) -> dict[str, str]:
    """Per failed test in pytest's output, its error and the last vLLM frame of its traceback (where the plugin
    met vLLM last)."""
    found: dict[str, str] = {}
    parts = re.split(r"\n_{5,} (.+?) _{5,}\n", report)  # [head, name, body, name, body, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=False):
        error = next((line[1:].strip() for line in body.splitlines() if line.startswith("E ")), "(no error line)")
        frames = re.findall(r"site-packages/(vllm/[^\s:]+:\d+)", body)
        found[name] = f"{error[:160]}  [last vLLM frame: {frames[-1] if frames else 'none'}]"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default=None, help="the release to check (default: the newest on PyPI)")
    parser.add_argument("--venv", default=None, help="scratch environment (default: build/vllm-<version>)")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="test files (default: tests/test_vllm_*)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    version = args.vllm or newest_release()
    venv = Path(args.venv) if args.venv else ROOT / "build" / f"vllm-{version}"
    python = prepare(venv, version)

    broken = check_imports(python)
    print(f"\n== vLLM {version}: {len(broken)} of the plugin's vLLM imports fail")
    for line in broken:
        print("  " + line)
    drifted = check_patches(python)
    unchecked = sum("[the machine:" in line for line in drifted)
    print(
        f"\n== vLLM {version}: {len(drifted) - unchecked} of the internals the plugin patches (vllm_plugin/patches.py)"
        f" changed, {unchecked} not checked on this machine"
    )
    for line in drifted:
        print("  " + line)
    tests = run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda", *args.tests, *args.pytest_args],
        cwd=ROOT,
        capture_output=True,
    )
    report = tests.stdout + tests.stderr
    print(f"\n== vLLM {version}: the plugin's tests")
    print(report.strip().splitlines()[-1] if report.strip() else "(no output)")
    for name, failure in failures(report).items():
        print(f"  {name}: {failure}")
    (venv / "last-report.txt").write_text(report)
    print(f"(the whole pytest output: {venv / 'last-report.txt'})")
    moved = [line for line in (*broken, *drifted) if "[the machine:" not in line]
    return 0 if not moved and tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
