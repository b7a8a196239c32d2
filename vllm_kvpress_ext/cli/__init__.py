"""The `kvpress` command line: one module per command group, wired together here.

Each command module has a `register(sub)` that adds its parser (options and help beside the handler
they feed) and sets `handler` to a function `args -> exit status`; `bench` is a package with one
module per bench. Modules import their heavy dependencies inside the handlers, so `kvpress --help`
stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllm_kvpress_ext.cli import bench, info, models, profile, serve, train
from vllm_kvpress_ext.cli.common import Handler, KvpressParser
from vllm_kvpress_ext.version import __version__

__all__ = ["build_parser", "main"]

# The order of `kvpress --help`.
COMMAND_GROUPS = (info, serve, models, train, bench, profile)


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = KvpressParser(
        prog="kvpress",
        description="KV-cache compression for LLM serving: per-head policies over a paged pool that frees "
        "what it drops.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except (ValueError, OSError) as exc:  # a bad value only found past parsing (a file, a combination)
        command = " ".join(str(getattr(args, k)) for k in ("command", "bench_command") if getattr(args, k, None))
        print(f"kvpress {command}: error: {exc}", file=sys.stderr)
        return 2
