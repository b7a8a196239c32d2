"""Policies by name, by YAML preset, or by a `{"name": ..., **params}` dict.

`load_policy` is the one entry point the engine, the server and the CLI use, so every caller gets
the same validation and the same error messages (an unknown name lists the known ones; an unknown
parameter lists the policy's fields).

A name is the policy at its dataclass defaults, the paper's, the same in a checkout and in an
installed wheel. The repository's `configs/NAME.yaml` spell those defaults out (a test keeps them
equal) for operators to copy, edit and pass by path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from vllm_kvpress_ext.policies.base import KVPolicy, PolicyConfigError
from vllm_kvpress_ext.policies.files import PolicyFiles

_REGISTRY: dict[str, type[KVPolicy]] = {}


def register(cls: type[KVPolicy]) -> type[KVPolicy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[KVPolicy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyConfigError(f"unknown policy {name!r}; known policies: {', '.join(policy_names())}") from None


def _check_type(policy: str, field: dataclasses.Field[Any], value: Any, hints: dict[str, Any]) -> Any:
    """Coerce YAML/JSON scalars to the field's type, or raise a clear error."""
    hint = hints[field.name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise PolicyConfigError(f"{policy}.{field.name} cannot be null")
    for kind in allowed:
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise PolicyConfigError(f"{policy}.{field.name} must be {names}, got {value!r}")


def create_policy(name: str, **params: Any) -> KVPolicy:
    """Instantiate and validate a registered policy."""
    cls = policy_class(name)
    fields: dict[str, dataclasses.Field[Any]] = (
        {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    )
    unknown = sorted(set(params) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise PolicyConfigError(f"unknown parameter(s) {', '.join(unknown)} for policy {name!r}; valid: {valid}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: _check_type(name, fields[key], value, hints) for key, value in params.items()}
    # A token budget given alone replaces the default ratio budget (and vice versa).
    if "tokens" in kwargs and "ratio" in fields and "ratio" not in kwargs and kwargs["tokens"] is not None:
        kwargs["ratio"] = None
    if "ratio" in kwargs and "tokens" in fields and "tokens" not in kwargs and kwargs["ratio"] is not None:
        kwargs["tokens"] = None
    policy = cls(**kwargs)
    policy.validate()
    policy.check_limits()
    return policy


def load_policy(spec: str | Path | dict[str, Any] | KVPolicy | None) -> KVPolicy | None:
    """A policy from a name, a preset (`configs/NAME.yaml` or any YAML path), a dict, or an instance."""
    if spec is None or isinstance(spec, KVPolicy):
        if isinstance(spec, KVPolicy):
            spec.validate()
            spec.check_limits()
        return spec
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise PolicyConfigError("a policy object needs a string `name`")
        return create_policy(name, **params)
    text = str(spec)
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise PolicyConfigError(f"policy preset {text} does not exist")
        return load_policy(_read_preset(path))
    if text in _REGISTRY:
        return create_policy(text)
    raise PolicyConfigError(f"unknown policy {text!r}; known policies: {', '.join(policy_names())}")


def load_client_policy(spec: str | dict[str, Any] | None, files: PolicyFiles) -> KVPolicy | None:
    """A policy from a spec a client sent: never a path, and file fields only by allowed name.

    A name loads the policy at its defaults; a dict's file
    fields (`file_fields`) are names the operator allowed in `files`, replaced here by their paths.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in _REGISTRY:
            raise PolicyConfigError(f"unknown policy {spec!r}; known policies: {', '.join(policy_names())}")
        return load_policy(spec)
    if not isinstance(spec, dict):
        raise PolicyConfigError(f"a policy must be a name or an object with a `name`, got {type(spec).__name__}")
    params = dict(spec)
    name = params.get("name")
    if not isinstance(name, str):
        raise PolicyConfigError("a policy object needs a string `name`")
    for field in policy_class(name).file_fields:
        if params.get(field) is not None:
            params[field] = files.resolve(name, field, params[field])
    return load_policy(params)


def _read_preset(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise PolicyConfigError(f"{path} must hold a mapping with a `name` and the policy's parameters")
    return data
