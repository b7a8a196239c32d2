"""KV policy specs as both servers take them: the operator's `--kv-policy` and each client's `kv_policy`.

The operator's flag (`kvpress serve --kv-policy`, `vllm serve --kv-policy`) takes a policy name, a JSON
object such as `{"name": "snapkv", "ratio": 0.25}`, or a YAML preset path (`parse_operator_policy`).

The per-request policy comes from the body's `kv_policy` or vLLM's `vllm_xargs`, validated up front.

Policies are resolved in the HTTP handler, before the request reaches the engine, so a bad name or
parameter is a 400 naming the valid choices (the registry's `PolicyConfigError` message) and never
costs the engine loop anything.

`vllm_xargs` is how vLLM clients pass extra arguments; its values are often strings, so there
`"snapkv"`, `'{"name": "snapkv", "ratio": 0.1}'` and `{"name": "snapkv", "ratio": "0.1"}` all work.
vLLM only forwards flat scalar values, so a policy's parameters may also come as `kv_<param>`
fields beside `kv_policy`: `{"kv_policy": "snapkv", "kv_ratio": 0.25}`. Both servers parse their
requests with these same functions, so they accept the same fields and give the same messages.
Presets by file path are refused over HTTP: a path would let any client make the server read
files of its choosing. Presets by name (`configs/NAME.yaml`) still apply. Fields that name a file
(XKV's `profile`, WG-KV's `gates`) take a name from the operator's allow-list (`policies/files.py`),
never a path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vllm_kvpress_ext.api import KV_PREFIX
from vllm_kvpress_ext.api.errors import APIError, bad_request
from vllm_kvpress_ext.policies import (
    KVPolicy,
    PolicyConfigError,
    PolicyFiles,
    allowed_files,
    load_client_policy,
    load_policy,
)

_XARGS_KEYS = ("kv_policy",)
#: `kv_*` fields that are not the policy's: a named context's boundary, and vLLM's own KV-transfer parameters.
NOT_POLICY_FIELDS = ("kv_prefix_tokens", "kv_transfer_params")


def policy_fields(fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `kv_*` entries of a request's fields (`vllm_xargs`) that name its policy (`kv_policy`) or set the
    policy's parameters (`kv_ratio` -> `ratio`)."""
    return {k: v for k, v in (fields or {}).items() if k.startswith(KV_PREFIX) and k not in NOT_POLICY_FIELDS}


def _policy_error(message: str, param: str) -> APIError:
    return bad_request(message, param=param)


def _from_string(text: str, param: str) -> str | dict[str, Any]:
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise _policy_error(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise _policy_error(f"{param} must be a policy name or an object with a `name`", param)
        return value
    if stripped.endswith((".yaml", ".yml")) or "/" in stripped or "\\" in stripped:
        raise _policy_error(
            f"policy presets by path are not accepted over HTTP ({stripped!r}); "
            'send a policy name or an object such as {"name": "snapkv", "ratio": 0.25}',
            param,
        )
    return stripped


def _coerce_scalar(value: Any) -> Any:
    """`"0.1"` -> 0.1, `"true"` -> True, `"null"` -> None; other strings stay strings."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _normalize(value: Any, param: str, *, from_xargs: bool) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = _from_string(value, param)
        if isinstance(value, str):
            return value
    if isinstance(value, dict):
        spec = dict(value)
        if from_xargs:
            spec = {k: (v if k == "name" else _coerce_scalar(v)) for k, v in spec.items()}
        return spec
    raise _policy_error(f"{param} must be a policy name or an object with a `name`, got {type(value).__name__}", param)


def _with_flat_params(spec: str | dict[str, Any] | None, vllm_xargs: dict[str, Any]) -> str | dict[str, Any] | None:
    """Fold `kv_<param>` fields into the policy named by `kv_policy`."""
    params = {
        key[len(KV_PREFIX) :]: _coerce_scalar(value)
        for key, value in vllm_xargs.items()
        if key not in _XARGS_KEYS and key.startswith(KV_PREFIX)
    }
    if not params:
        return spec
    fields = ", ".join(f"{KV_PREFIX}{name}" for name in sorted(params))
    if spec is None:
        raise _policy_error(f"vllm_xargs.{fields} need vllm_xargs.kv_policy to name the policy", "vllm_xargs")
    merged = {"name": spec} if isinstance(spec, str) else dict(spec)
    clash = sorted(set(params) & set(merged))
    if clash:
        raise _policy_error(f"vllm_xargs gives {', '.join(clash)} twice (in kv_policy and as kv_ fields)", "vllm_xargs")
    merged.update(params)
    return merged


def policy_spec(kv_policy: Any, vllm_xargs: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The request's policy spec, or None for the server's default.

    Both places may carry it; if both do they must agree, since silently preferring one would hide
    a client bug.
    """
    body = _normalize(kv_policy, "kv_policy", from_xargs=False)
    xargs: str | dict[str, Any] | None = None
    if vllm_xargs:
        unknown = sorted(k for k in vllm_xargs if k not in _XARGS_KEYS and not k.startswith(KV_PREFIX))
        if unknown:
            raise bad_request(
                f"unsupported vllm_xargs key(s): {', '.join(unknown)}; supported: {', '.join(_XARGS_KEYS)} "
                f"and {KV_PREFIX}<policy parameter>",
                param="vllm_xargs",
            )
        xargs = _normalize(vllm_xargs.get("kv_policy"), "vllm_xargs.kv_policy", from_xargs=True)
        xargs = _with_flat_params(xargs, vllm_xargs)
    if body is not None and xargs is not None and body != xargs:
        raise _policy_error("kv_policy and vllm_xargs.kv_policy disagree; send one", "kv_policy")
    return body if body is not None else xargs


def resolve_policy(spec: str | dict[str, Any] | None, files: PolicyFiles | None = None) -> KVPolicy | None:
    """A validated policy instance (None: the server's default), or a 400 with the registry's message.

    `files` is the operator's allow-list for file fields (default: the process-wide one, `allowed_files()`).
    """
    if spec is None:
        return None
    try:
        policy = load_client_policy(spec, files if files is not None else allowed_files())
    except PolicyConfigError as exc:
        raise _policy_error(str(exc), "kv_policy") from None
    except (TypeError, ValueError) as exc:  # a policy's own constructor checks
        raise _policy_error(f"invalid kv_policy: {exc}", "kv_policy") from None
    return policy


def policy_label(policy: KVPolicy | None) -> str:
    """The name reported in `usage.kv_policy` and on metrics; `full` when nothing compresses."""
    if policy is None or not policy.compresses:
        return "full"
    return policy.name


def parse_operator_policy(text: str, flag: str = "--kv-policy") -> str | dict[str, Any]:
    """The operator's policy as a JSON-serialisable spec (a name or an object), validated.

    A YAML preset is read here and passed on as its mapping, so processes started later (vLLM's engine
    core and workers) need not see the file. Raises `PolicyConfigError` naming `flag`.
    """
    stripped = text.strip()
    spec: Any
    if stripped.startswith("{"):
        try:
            spec = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise PolicyConfigError(f"{flag} is not valid JSON: {exc}") from None
    elif stripped.endswith((".yaml", ".yml")):
        path = Path(stripped)
        if not path.is_file():
            raise PolicyConfigError(f"policy preset {stripped} does not exist")
        spec = yaml.safe_load(path.read_text())
    else:
        spec = stripped
    check_policy_spec(spec)
    return spec


def check_policy_spec(spec: Any) -> None:
    """Raise `PolicyConfigError` unless `spec` (a name or an object with a `name`) builds a valid policy."""
    if not isinstance(spec, str | dict):
        raise PolicyConfigError(f"kv_policy must be a policy name or an object with a `name`, got {spec!r}")
    try:
        load_policy(spec)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"invalid kv_policy: {exc}") from None
