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
    allowed = ("policies", "cache", "attention", "models", "kernels", "utils", "hub", "version")
    outside = {m for m in loaded if m != "vllm_kvpress_ext" and m.split(".")[1] not in allowed}
    assert not outside, f"the policies import {sorted(outside)}"


def _file_imports(path: Path) -> dict[str, list[str]]:
    """Every `vllm_kvpress_ext` module one source file imports (lazily too), with its line."""
    found: dict[str, list[str]] = {}
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
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}"
                found.setdefault(name, []).append(where)
    return found


def source_dir(package: str) -> Path:
    """Where a package's source lives: under `vllm_kvpress_ext/`, but for the Triton kernels (`kernels/`, which
    setuptools maps into the package)."""
    return ROOT / package if package == "kernels" else ROOT / "vllm_kvpress_ext" / package


def imported_modules(package: str) -> dict[str, list[str]]:
    """Every `vllm_kvpress_ext` module a package's source imports (lazily too), with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(source_dir(package).rglob("*.py")):
        for module, where in _file_imports(path).items():
            found.setdefault(module, []).extend(where)
    return found


# The project's layers, lowest first: a package imports only from packages in earlier layers (docs/architecture.md,
# "Package layout"). "" is the package root, whose `LLM` is the embedded engine's.
LAYERS: list[set[str]] = [
    {"utils", "version", "assets", "hub", "tasks", "kernels"},
    {"attention"},
    {"cache", "models"},
    {"policies"},
    {"api"},
    {"engine", "train"},
    {""},
    {"server", "vllm_plugin"},
    {"bench"},
    {"cli"},
]
LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def _package_of(module: str) -> str:
    """The top-level package (or module) of `vllm_kvpress_ext` that `module` is in: "" for the root itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(package: str) -> list[str]:
    """Imports in `package` ("" for the root's own `__init__.py`) of a package not in an earlier layer."""
    if not package:
        imports = _file_imports(ROOT / "vllm_kvpress_ext" / "__init__.py")
    elif source_dir(package).is_dir():
        imports = imported_modules(package)
    else:  # a module of its own, as `version.py`
        imports = _file_imports(ROOT / "vllm_kvpress_ext" / f"{package}.py")
    own = LAYER_OF[package]
    return [
        f"{package or '(root)'} -> {module} at {', '.join(where)}"
        for module, where in imports.items()
        if _package_of(module) != package and LAYER_OF.get(_package_of(module), len(LAYERS)) >= own
    ]


def test_every_package_is_in_a_layer() -> None:
    found = {p.name for p in (ROOT / "vllm_kvpress_ext").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in (ROOT / "vllm_kvpress_ext").glob("*.py") if p.stem != "__init__"}
    assert found | {"kernels"} == set(LAYER_OF) - {""}
    assert (source_dir("kernels") / "__init__.py").exists()


def test_imports_point_down_the_layers() -> None:
    """Every import of one package by another, lazy ones too, goes to an earlier layer: no exemption."""
    offenders = [line for package in LAYER_OF for line in upward_imports(package)]
    assert not offenders, "\n".join(offenders)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from vllm_kvpress_ext.engine import LLM\n")
    assert list(_file_imports(planted)) == ["vllm_kvpress_ext.engine"]
    assert LAYER_OF["engine"] > LAYER_OF["policies"]  # so a policy importing it is an upward import
    assert upward_imports("cli") == [] and upward_imports("api") == []


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


# What only the engine may reach: its runner, cache, pool, scheduler, prefix store and step plans. Its
# drivers outside engine/ read `LLMEngine.stats()` and use the runner's lifecycle methods instead.
ENGINE_INTERNALS = frozenset({"cache", "pool", "scheduler", "runner", "prefix_store", "last_plan", "_plan"})
# The engine modules the server may import: the package's public names and plain data types.
SERVER_MAY_IMPORT = frozenset(
    {"engine", "engine.request", "engine.stats", "engine.sampling_params", "engine.sampler", "engine.llm"}
)


def internal_attribute_reads(source: str, where: str, internals: frozenset[str]) -> list[str]:
    """Every `x.name` with `name` in `internals` in `source` (reads and writes alike)."""
    tree = ast.parse(source)
    return [
        f"{where}:{node.lineno} .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in internals
    ]


def _package_reads(package: str, internals: frozenset[str], skip: str | None = None) -> list[str]:
    root = ROOT / "vllm_kvpress_ext" / package
    paths = [p for p in sorted(root.rglob("*.py")) if skip is None or not p.is_relative_to(root / skip)]
    assert paths
    found: list[str] = []
    for path in paths:
        found += internal_attribute_reads(path.read_text(), str(path.relative_to(ROOT)), internals)
    return found


def test_the_check_for_engine_internals_sees_them() -> None:
    planted = "stats = engine.cache.pool.num_free\nwaiting = engine.scheduler.waiting\nplan = engine.last_plan"
    assert len(internal_attribute_reads(planted, "planted", ENGINE_INTERNALS)) == 4
    assert not internal_attribute_reads("stats = engine.stats()\nn = stats.pages_free", "clean", ENGINE_INTERNALS)


def test_the_http_server_reads_the_engine_only_through_its_api() -> None:
    """server/ drives `LLMEngine` by its step API and reads it by `stats()`; never its pool, queues or plans."""
    assert not _package_reads("server", ENGINE_INTERNALS)
    imports = imported_modules("server")
    engine_modules = {m.removeprefix("vllm_kvpress_ext.") for m in imports if m.split(".")[1] in ("engine", "cache")}
    assert engine_modules, "the server imports the engine somewhere: the check would see nothing"
    assert engine_modules <= SERVER_MAY_IMPORT, sorted(engine_modules - SERVER_MAY_IMPORT)


def test_the_vllm_worker_uses_the_runner_not_its_cache() -> None:
    """The plugin reaches pages and rows through `ModelRunner`'s lifecycle and pool methods."""
    # `runner` is the worker's own; `scheduler` and `pool` name vLLM's scheduler and a metrics method there. The
    # stored prefixes the plugin's scheduler mirrors are read and leased through the runner's methods.
    # native/ hosts the pool itself, as the engine does (vLLM's runner drives it): its own cache is not the engine's.
    allowed = {"runner", "scheduler", "pool"}
    assert not _package_reads("vllm_plugin", ENGINE_INTERNALS - allowed, skip="native")


def test_the_pool_under_vllms_runner_shares_the_engines_policy_steps_not_its_runner() -> None:
    """native/ compresses through `engine/compression.py` (what the engine's runner calls too), and imports
    neither the engine's runner nor its scheduler."""
    imports = imported_modules("vllm_plugin/native")
    engine_modules = {m.removeprefix("vllm_kvpress_ext.") for m in imports if m.split(".")[1] == "engine"}
    assert "engine.compression" in engine_modules
    assert not engine_modules & {"engine.model_runner", "engine.engine", "engine.scheduler", "engine.attention_context"}


# A request's cache state (`Request.seat`): its row and progress, its policy's state and captures, its write gate,
# its hold on a stored prefix, its KV figures. One runner owns it: the embedded engine's `ModelRunner`, or
# `NativePool` (its own seats) under vLLM's runner.
SEAT_FIELDS = frozenset(
    {
        "seat",
        "row",
        "num_processed",
        "compressed_at",
        "cached_tokens",
        "policy_state",
        "capture",
        "admission",
        "prompt_admission",
        "prefix_lease",
    }
)
SEAT_OWNERS = {"vllm_kvpress_ext/engine/model_runner.py", "vllm_kvpress_ext/vllm_plugin/native/pool.py"}


def _written(target: ast.expr) -> list[ast.Attribute]:
    """The attributes an assignment target writes: itself, or each element of a tuple target."""
    if isinstance(target, ast.Tuple | ast.List):
        return [written for element in target.elts for written in _written(element)]
    return [target] if isinstance(target, ast.Attribute) else []


def _chain(attribute: ast.expr) -> list[str]:
    """`a.seat.row` -> ["row", "seat"]: the attribute names from the written one inwards."""
    names = []
    while isinstance(attribute, ast.Attribute):
        names.append(attribute.attr)
        attribute = attribute.value
    return names


def seat_writes(source: str, where: str) -> list[str]:
    """Every assignment to a seat, or to a field of one, of another object than `self` (`x.seat.row = ...`,
    `x.row += ...`, `x.seat = ...`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            for attribute in _written(target):
                own = isinstance(attribute.value, ast.Name) and attribute.value.id == "self"
                if not own and SEAT_FIELDS.intersection(_chain(attribute)):
                    found.append(f"{where}:{node.lineno} .{attribute.attr}")
    return found


def test_only_the_runners_write_a_requests_cache_state() -> None:
    """The prefix store, the samples and the drivers read a request's seat; its runner alone writes it."""
    planted = "request.seat.row, request.seat.num_processed = 3, 0\nreq.seat.capture += 1\nself.row = 2\nr.seat = 1"
    assert seat_writes(planted, "planted") == [
        "planted:1 .row",
        "planted:1 .num_processed",
        "planted:2 .capture",
        "planted:4 .seat",
    ]
    found: list[str] = []
    for path in sorted((ROOT / "vllm_kvpress_ext").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where not in SEAT_OWNERS:
            found += seat_writes(path.read_text(), where)
    assert not found, found
