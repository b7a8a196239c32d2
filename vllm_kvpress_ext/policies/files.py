"""Files a policy reads (XKV profiles, WG-KV write gates): chosen by the operator, named by clients.

A policy field that names a file (a class's `file_fields`) holds a server path when the operator
writes it: on the command line, in a preset under `configs/`, in Python. A client must never choose
a server path -- the server would open files of the client's choosing, and its errors would tell
which paths exist. So over HTTP (and in the vLLM plugin) such a field holds a *name* that the
operator registered at start-up (`kvpress serve --policy-file xkv.profile:long=/srv/long.yaml`);
`PolicyFiles.resolve` turns the name into the operator's path and refuses anything else without
touching the file system or echoing the value back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from vllm_kvpress_ext.policies.base import PolicyConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class PolicyFiles:
    """The operator's allow-list: `(policy, field) -> {name: path}`."""

    def __init__(self) -> None:
        self._files: dict[tuple[str, str], dict[str, Path]] = {}

    @classmethod
    def parse(cls, entries: Iterable[str]) -> PolicyFiles:
        """From `POLICY.FIELD:NAME=PATH` strings (the `--policy-file` flag); raises ValueError on a bad one."""
        files = cls()
        for entry in entries:
            match = re.fullmatch(r"([a-z_]+)\.([a-z_]+):([^=]+)=(.+)", entry.strip())
            if match is None:
                raise ValueError(
                    f"expected POLICY.FIELD:NAME=PATH (e.g. xkv.profile:long=/srv/long.yaml), got {entry!r}"
                )
            files.add(match.group(1), match.group(2), match.group(3), Path(match.group(4)))
        return files

    def add(self, policy: str, field: str, name: str, path: Path) -> None:
        """Register `path` under `name`; the operator's own mistakes (a missing file) fail here, at start-up."""
        from vllm_kvpress_ext.policies.registry import policy_class

        cls = policy_class(policy)
        if field not in getattr(cls, "file_fields", ()):
            valid = ", ".join(f"{policy}.{f}" for f in getattr(cls, "file_fields", ())) or "none"
            raise ValueError(f"{policy}.{field} does not name a file; file fields of {policy}: {valid}")
        if _NAME.fullmatch(name) is None:
            raise ValueError(f"file name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not path.is_file():
            raise ValueError(f"{path} (for {policy}.{field} {name!r}) is not a file")
        self._files.setdefault((policy, field), {})[name] = path.resolve()

    def names(self, policy: str, field: str) -> list[str]:
        return sorted(self._files.get((policy, field), {}))

    def resolve(self, policy: str, field: str, value: object) -> str:
        """The operator's path for the name a client sent; never reads the file or repeats the value."""
        allowed = self._files.get((policy, field), {})
        if isinstance(value, str) and value in allowed:
            return str(allowed[value])
        if (policy, field) == ("wgkv", "gates") and isinstance(value, str):
            from vllm_kvpress_ext.models.write_gate import shipped_gates

            # Gates shipped inside the package are a fixed set of files, not a path of the client's choosing.
            shipped = shipped_gates().get(value)
            if shipped is not None:
                return str(shipped)
        choices = ", ".join(sorted(allowed)) or "none are configured on this server"
        raise PolicyConfigError(
            f"{policy}.{field} must be the name of a file the server's operator allowed ({choices}); "
            "paths are not accepted in requests"
        )


_PROCESS_FILES = PolicyFiles()


def allowed_files() -> PolicyFiles:
    """The process-wide allow-list `resolve_policy` uses unless given one (empty until configured)."""
    return _PROCESS_FILES


def set_allowed_files(files: PolicyFiles) -> None:
    """Install the operator's allow-list for this process (done once, at start-up)."""
    global _PROCESS_FILES
    _PROCESS_FILES = files
