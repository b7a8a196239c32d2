"""`vllm_plugin/patches.py` holds every vLLM internal the plugin patches: the list matches the installed
vLLM (each target there, with the parameters recorded) and the code (every override and every patch site
is listed, and each listed patch is still made)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_kvpress_ext.vllm_plugin import patches
from vllm_kvpress_ext.vllm_plugin.patches import (
    OVERRIDDEN,
    PATCHES,
    PROXIED,
    REPLACED,
    WRAPPED,
    Patch,
    drift,
    parameters,
    wrap,
)

PLUGIN = Path(patches.__file__).parent
MACHINE = "cannot open shared object file"  # vLLM's CUDA module without a CUDA driver: this machine's
# Plugin modules whose classes subclass vLLM's (the CUDA platform needs a driver to import).
SUBCLASSING = ("scheduler", "worker", "platform", "native.worker", "native.runner", "native.attention", "native.moe")


def overrides() -> set[tuple[str, str]]:
    """(target, plugin module) of every method or attribute a plugin class redefines from a vLLM base."""
    found = set()
    for where in SUBCLASSING:
        module = importlib.import_module(f"vllm_kvpress_ext.vllm_plugin.{where}")
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            bases = [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "vllm"]
            for name in vars(cls):
                if (name.startswith("__") and name != "__init__") or name == "_abc_impl":
                    continue
                base = next((base for base in bases if name in vars(base)), None)
                if base is not None:
                    found.add((patches.target_of(base, name), where))
    return found


def test_every_listed_internal_is_in_the_installed_vllm_with_the_recorded_parameters() -> None:
    assert [line for line in drift() if MACHINE not in line] == []


def test_every_override_is_listed_and_every_listed_override_is_made() -> None:
    listed = {(p.target, p.where) for p in PATCHES if p.how == OVERRIDDEN and p.where != "cuda_platform"}
    assert overrides() == listed


def test_the_pool_gate_proxies_exactly_the_listed_kv_cache_manager_methods() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_kvpress_ext.vllm_plugin.scheduler import _PoolGate

    redefined = {
        patches.target_of(KVCacheManager, name)
        for name, value in vars(_PoolGate).items()
        if callable(value) and not name.startswith("__") and hasattr(KVCacheManager, name)
    }
    assert redefined == {p.target for p in PATCHES if p.how == PROXIED}


def _vllm_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.asname or alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"}
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_patch_site_bypasses_wrap() -> None:
    """Outside patches.py, nothing assigns an attribute of a vLLM class or module, or setattr()s one; a loop
    over vLLM objects counts as the objects."""
    offences = []
    for path in sorted(PLUGIN.rglob("*.py")):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        vllm_names = _vllm_names(tree)
        for node in ast.walk(tree):  # a loop over vLLM objects: its variables may be vLLM objects
            if (
                isinstance(node, ast.For)
                and {n.id for n in ast.walk(node.iter) if isinstance(n, ast.Name)} & vllm_names
            ):
                vllm_names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and _root_name(target) in vllm_names:
                    offences.append(f"{path.name}:{node.lineno}: {ast.unparse(target)} = ...")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and _root_name(node.args[0]) in vllm_names
            ):
                offences.append(f"{path.name}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
    assert not offences, "\n".join(offences)


def test_every_listed_wrap_is_made_by_its_module() -> None:
    for patch in PATCHES:
        if patch.how in (WRAPPED, REPLACED):
            source = (PLUGIN / (patch.where.replace(".", "/") + ".py")).read_text()
            name = patch.target.rsplit(".", 1)[-1].rsplit(":", 1)[-1]
            assert f'"{name}"' in source and "wrap(" in source, patch


def test_wrap_refuses_an_unlisted_target() -> None:
    class Unlisted:
        def method(self) -> None: ...

    with pytest.raises(RuntimeError, match=r"not listed in vllm_plugin/patches\.py"):
        wrap(Unlisted, "method", lambda original: original, "cli_args")


def test_wrap_names_a_listed_target_this_vllm_lacks() -> None:
    stand_in = type("EngineArgs", (), {"__module__": "vllm.engine.arg_utils"})  # no add_cli_args
    with pytest.raises(RuntimeError, match=r"this vLLM has no vllm\.engine\.arg_utils:EngineArgs\.add_cli_args"):
        wrap(stand_in, "add_cli_args", lambda original: original, "cli_args")


def test_drift_names_a_changed_parameter_list_and_a_missing_target() -> None:
    changed = Patch("vllm.engine.arg_utils:get_model_path", WRAPPED, "gguf_model", "model")
    missing = Patch("vllm.engine.arg_utils:no_such_function", WRAPPED, "gguf_model", "model")
    lines = drift((changed, missing))
    assert lines[0].endswith("parameters were (model), now (model, revision=)")
    assert "no_such_function" in lines[1] and ": missing (" in lines[1]


def test_drift_reads_vllms_own_definition_after_the_plugin_wrapped_it() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvpress_ext.vllm_plugin.cli_args import install_kv_policy_flag

    install_kv_policy_flag()
    assert parameters(inspect.getattr_static(EngineArgs, "create_engine_config")) == "self, *args, **kwargs"
    assert not [line for line in drift() if "create_engine_config" in line]


def test_parameters_marks_defaults_and_stars() -> None:
    def function(a: int, b: int = 1, *rest: int, c: int, d: int = 2, **extra: int) -> None: ...

    def keyword_only(a: int, *, b: int) -> None: ...

    assert parameters(function) == "a, b=, *rest, c, d=, **extra"
    assert parameters(keyword_only) == "a, *, b"
    assert parameters(staticmethod(keyword_only)) == "a, *, b"
    assert parameters(42) is None
