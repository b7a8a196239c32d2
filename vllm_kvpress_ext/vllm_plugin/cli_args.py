"""`--kv-policy` on vLLM's command line, folded into `additional_config["kv_policy"]`, and an explicit
`--enable-prefix-caching` recorded as `additional_config["kv_prefix_caching"]` (config.py).

vLLM builds the `vllm serve` parser in `AsyncEngineArgs.add_cli_args`, which loads general plugins
first, so wrapping `EngineArgs.add_cli_args` here adds the flag in time; `EngineArgs.from_cli_args`
then moves it into `additional_config`, which `VllmConfig` carries to the engine core and workers.
The policy is validated here, in the first process, so a typo fails `vllm serve` at once with the
registry's message instead of in a worker minutes later.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_kvpress_ext.api import OPERATOR_POLICY_HELP
from vllm_kvpress_ext.api.policy_spec import check_policy_spec, parse_operator_policy
from vllm_kvpress_ext.policies import PolicyConfigError

HELP = (
    f"KV-cache compression policy (vllm-kvpress-ext): {OPERATOR_POLICY_HELP}. Same as --additional-config "
    "'{\"kv_policy\": ...}'. Requests may override it with vllm_xargs.kv_policy."
)


def fold_into_additional_config(policy_arg: str | None, additional_config: dict[str, Any]) -> dict[str, Any]:
    """`additional_config` with the flag's policy in it; both given and different is an error."""
    config = dict(additional_config or {})
    if policy_arg is not None:
        spec = parse_operator_policy(policy_arg)
        if "kv_policy" in config and config["kv_policy"] != spec:
            raise PolicyConfigError("--kv-policy and --additional-config kv_policy disagree; give one")
        config["kv_policy"] = spec
    elif "kv_policy" in config:
        check_policy_spec(config["kv_policy"])
    return config


def install_kv_policy_flag() -> None:
    """Wrap `EngineArgs.add_cli_args`, `from_cli_args` and `create_engine_config` once per process."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvpress_ext.vllm_plugin.patches import wrap

    def wrap_create(original: Any) -> Any:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm_kvpress_ext.vllm_plugin.activation import plugin_active
            from vllm_kvpress_ext.vllm_plugin.config import record_explicit_prefix_caching

            if plugin_active():  # before vLLM replaces an unset enable_prefix_caching by its default
                record_explicit_prefix_caching(self)
            return original(self, *args, **kwargs)

        return create_engine_config

    def wrap_add(original: Any) -> Any:
        def add_cli_args(parser: Any) -> Any:
            parser = original.__func__(parser)
            group = parser.add_argument_group("vllm-kvpress-ext")
            group.add_argument("--kv-policy", dest="kv_policy", default=None, help=HELP)
            return parser

        return staticmethod(add_cli_args)

    def wrap_from(original: Any) -> Any:
        def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
            from vllm_kvpress_ext.vllm_plugin.activation import ENV, plugin_active

            engine_args = original.__func__(cls, args)
            policy = getattr(args, "kv_policy", None)
            if policy is not None and not plugin_active():
                # Never serve uncompressed while the user believes a policy is on.
                raise PolicyConfigError(f"--kv-policy needs the vllm-kvpress-ext platform, which {ENV}=off turns off")
            engine_args.additional_config = fold_into_additional_config(policy, engine_args.additional_config)
            return engine_args

        return classmethod(from_cli_args)

    wrap(EngineArgs, "add_cli_args", wrap_add, "cli_args")
    wrap(EngineArgs, "from_cli_args", wrap_from, "cli_args")
    wrap(EngineArgs, "create_engine_config", wrap_create, "cli_args")
