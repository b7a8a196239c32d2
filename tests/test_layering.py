"""Layering: the policies depend on the cache, attention and models only, never on the engine that drives them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(statement: str) -> set[str]:
    """`vllm_kvpress_ext` modules in `sys.modules` after `statement` runs in a fresh interpreter."""
    listing = "sorted(m for m in sys.modules if m.startswith('vllm_kvpress_ext'))"
    code = f"import json, sys\n{statement}\nprint(json.dumps({listing}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_policies_does_not_import_the_engine() -> None:
    loaded = loaded_after("import vllm_kvpress_ext.policies")
    assert "vllm_kvpress_ext.policies.xkv" in loaded  # the check sees what it is meant to see
    assert not any(m.startswith("vllm_kvpress_ext.engine") for m in loaded)
    # `hub` comes with the models (their GGUF tokenizer cache lives in the hub's cache directory).
    allowed = ("policies", "cache", "attention", "models", "kernels", "utils", "hub")
    outside = {m for m in loaded if m != "vllm_kvpress_ext" and m.split(".")[1] not in allowed}
    assert not outside, f"the policies import {sorted(outside)}"


def imported_modules(package: str) -> dict[str, list[str]]:
    """Every `vllm_kvpress_ext` module a package's source imports (lazily too), with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "vllm_kvpress_ext" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against the file's package
                parts = list(path.relative_to(ROOT).with_suffix("").parts)[: -node.level]
                names = [".".join(parts + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("vllm_kvpress_ext."):
                    found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    imports = imported_modules(package)
    assert imports, f"no imports found under {package}: the check would see nothing"
    return [f"{m} at {where}" for m, where in imports.items() if m.split(".")[1] in forbidden]


def test_the_servers_share_the_api_package_not_each_other() -> None:
    """The plugin reaches the embedded server's rules through `api/`, never through `server/`."""
    assert not _offenders("vllm_plugin", ("server",))
    assert not _offenders("api", ("server", "vllm_plugin", "engine", "cli"))


def test_the_task_suite_imports_no_bench_training_or_cli() -> None:
    assert not _offenders("tasks", ("bench", "train", "cli", "server", "vllm_plugin"))


def test_no_policy_module_imports_the_engine_even_lazily() -> None:
    """A function-level import escapes the `sys.modules` check until it runs; the source tells at once."""
    assert not _offenders("policies", ("engine",))
