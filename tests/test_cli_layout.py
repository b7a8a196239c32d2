"""The command line's layout: every bench module is wired in, every command has a handler and a help page."""

from __future__ import annotations

import argparse
import pkgutil
from typing import Any

import pytest

from vllm_kvpress_ext import cli
from vllm_kvpress_ext.cli import bench


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append(((*path, name), sub))
                found += commands(sub, (*path, name))
    return found


def test_every_bench_module_is_registered() -> None:
    modules = {info.name for info in pkgutil.iter_modules(bench.__path__)}
    registered = {module.__name__.rsplit(".", 1)[-1] for module in bench.BENCHES}
    assert modules == registered, "add the new module to BENCHES in vllm_kvpress_ext/cli/bench/__init__.py"


@pytest.mark.parametrize("path", [p for p, _ in commands(cli.build_parser())], ids=" ".join)
def test_every_command_has_a_handler_and_a_help_page(path: tuple[str, ...]) -> None:
    parser = dict(commands(cli.build_parser()))[path]
    assert parser.prog == "kvpress " + " ".join(path)
    assert parser.format_help().startswith("usage: kvpress")
    assert callable(parser.get_default("handler"))


def _serve_environment(preset: str | None) -> tuple[str, bool]:
    """OMP_WAIT_POLICY as `kvpress serve` leaves it, and whether torch had been imported before it set it."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from vllm_kvpress_ext.cli import main\n"
        "seen = []\n"
        "original = os.environ.setdefault\n"
        "def spy(key, value):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    return original(key, value)\n"
        "os.environ.setdefault = spy\n"
        "main(['serve', '/nonexistent/model'])\n"
        "print(os.environ['OMP_WAIT_POLICY'], seen[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    policy, torch_loaded = result.stdout.split()
    return policy, torch_loaded == "True"


def test_serve_sets_a_passive_openmp_wait_policy_before_torch_loads() -> None:
    assert _serve_environment(None) == ("PASSIVE", False)
    assert _serve_environment("ACTIVE")[0] == "ACTIVE"  # the operator's own setting wins
