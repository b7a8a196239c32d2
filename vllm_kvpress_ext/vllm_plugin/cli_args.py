"""`--kv-policy` on vLLM's command line, folded into `additional_config["kv_policy"]`.

vLLM builds the `vllm serve` parser in `AsyncEngineArgs.add_cli_args`, which loads general plugins
first, so wrapping `EngineArgs.add_cli_args` here adds the flag in time; `EngineArgs.from_cli_args`
then moves it into `additional_config`, which `VllmConfig` carries to the engine core and workers.
The policy is validated here, in the first process, so a typo fails `vllm serve` at once with the
registry's message instead of in a worker minutes later.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from vllm_kvpress_ext.policies import PolicyConfigError, load_policy

HELP = (
    "KV-cache compression policy (vllm-kvpress-ext): a policy name (snapkv, gvote, full, ...), a YAML preset "
    'path, or JSON such as \'{"name": "snapkv", "ratio": 0.25}\'. Same as --additional-config '
    "'{\"kv_policy\": ...}'. Requests may override it with vllm_xargs.kv_policy."
)


def parse_policy_arg(text: str) -> str | dict[str, Any]:
    """A JSON-serialisable policy spec from the flag's text; raises `PolicyConfigError` if it is not valid."""
    stripped = text.strip()
    spec: str | dict[str, Any]
    if stripped.startswith("{"):
        try:
            spec = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise PolicyConfigError(f"--kv-policy is not valid JSON: {exc}") from None
    elif stripped.endswith((".yaml", ".yml")):
        path = Path(stripped)
        if not path.is_file():
            raise PolicyConfigError(f"policy preset {stripped} does not exist")
        spec = yaml.safe_load(path.read_text())  # sent as a dict: workers need not see the file
    else:
        spec = stripped
    check_policy_spec(spec)
    return spec


def check_policy_spec(spec: Any) -> None:
    if not isinstance(spec, str | dict):
        raise PolicyConfigError(f"kv_policy must be a policy name or an object with a `name`, got {spec!r}")
    try:
        load_policy(spec)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"invalid kv_policy: {exc}") from None


def fold_into_additional_config(policy_arg: str | None, additional_config: dict[str, Any]) -> dict[str, Any]:
    """`additional_config` with the flag's policy in it; both given and different is an error."""
    config = dict(additional_config or {})
    if policy_arg is not None:
        spec = parse_policy_arg(policy_arg)
        if "kv_policy" in config and config["kv_policy"] != spec:
            raise PolicyConfigError("--kv-policy and --additional-config kv_policy disagree; give one")
        config["kv_policy"] = spec
    elif "kv_policy" in config:
        check_policy_spec(config["kv_policy"])
    return config


def install_kv_policy_flag() -> None:
    """Wrap `EngineArgs.add_cli_args` / `from_cli_args` once per process."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_kvpress_flag_installed", False):
        return
    original_add = EngineArgs.__dict__["add_cli_args"].__func__
    original_from = EngineArgs.__dict__["from_cli_args"].__func__

    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        group = parser.add_argument_group("vllm-kvpress-ext")
        group.add_argument("--kv-policy", dest="kv_policy", default=None, help=HELP)
        return parser

    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        from vllm_kvpress_ext.vllm_plugin.activation import ENV, plugin_active

        engine_args = original_from(cls, args)
        policy = getattr(args, "kv_policy", None)
        if policy is not None and not plugin_active():
            # Never serve uncompressed while the user believes a policy is on.
            raise PolicyConfigError(f"--kv-policy needs the vllm-kvpress-ext platform, which {ENV}=off turns off")
        engine_args.additional_config = fold_into_additional_config(policy, engine_args.additional_config)
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)  # type: ignore[method-assign]
    EngineArgs.from_cli_args = classmethod(from_cli_args)  # type: ignore[method-assign, assignment]
    EngineArgs._kvpress_flag_installed = True  # type: ignore[attr-defined]
