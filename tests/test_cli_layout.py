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
    found = commands(cli.build_parser())
    parser = dict(found)[path]
    names = {" ".join(p) for p, sub in found if sub is parser}  # an alias (`env` for `info`) shares its parser
    assert parser.prog.removeprefix("kvpress ") in names and " ".join(path) in names
    assert parser.format_help().startswith("usage: kvpress")
    assert callable(parser.get_default("handler"))
