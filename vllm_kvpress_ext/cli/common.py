"""What every command module shares: the parser class, the sub-parsers type and argparse value types.

Value types turn a bad option into a one-line usage error at parse time instead of a traceback later.
Only the standard library is imported at module level (the heavy imports sit inside the types that
need them), so `kvpress --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeAlias

Handler: TypeAlias = Callable[[argparse.Namespace], int]
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class KvpressParser(argparse.ArgumentParser):
    """Usage errors as one line (`kvpress serve: error: ...`) and exit status 2, never a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def usage_error(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def show_usage_when_bare(group: argparse.ArgumentParser) -> None:
    """A command group run without its sub-command prints its help to stderr and exits with status 2."""
    group.set_defaults(handler=lambda _args: usage_error(group))


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def size(text: str) -> int:
    from vllm_kvpress_ext.server.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (a usage error otherwise, not a traceback later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port lies in [1, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must lie in [0, 3600] seconds, got {text}")
    return value


def policy_list(text: str) -> tuple[str, ...]:
    from vllm_kvpress_ext.policies import policy_names

    names = tuple(p for p in text.split(",") if p)
    unknown = [n for n in names if n not in policy_names()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none given)'}; known: {', '.join(policy_names())}"
        )
    return names


def task_weights(text: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, _, weight = item.partition(":")
        try:
            weights[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected name:weight, got {item!r}") from None
    return weights


def task_params_arg(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """`TASK.PARAM=VALUE` items (values parsed as YAML scalars) -> {task: {param: value}}."""
    import yaml

    params: dict[str, dict[str, Any]] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        task, dot, key = name.partition(".")
        if not (sep and dot and task and key):
            raise ValueError(f"--task-param wants TASK.PARAM=VALUE, got {item!r}")
        params.setdefault(task, {})[key] = yaml.safe_load(value)
    return params


def add_model_or_shape(parser: argparse.ArgumentParser) -> None:
    """`--model`, or a random-weight model of `--shape` (`bench.models.SHAPES`) written for the run."""
    parser.add_argument("--model", default=None, help="HF-format model directory (default: random model of --shape)")
    parser.add_argument(
        "--shape", default="bench", choices=("bench", "llama3-8b"), help="random model shape (default: bench)"
    )
