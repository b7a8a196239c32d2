"""The KV figures a response's `usage` carries, the same on both servers.

A finished engine request reports `kv_figures`: its policy's label and what the page pool says it
held. A response may be several engine requests (n samples, batched prompts, a stream's prompts);
`combine_figures` adds their figures up and `usage_fields` turns them into `usage` entries:
`kv_policy`, `kv_bytes`, `kv_bytes_peak`, `kv_retention`, `kv_tokens_kept`, `kv_tokens_full`.
"""

from __future__ import annotations

from typing import Any, Protocol


class KVHeld(Protocol):
    """What a request held, as the engine's `KVStats` (and the server's copy of it) report it."""

    @property
    def tokens_kept(self) -> int: ...
    @property
    def tokens_full(self) -> int: ...
    @property
    def kv_bytes(self) -> int: ...
    @property
    def kv_bytes_peak(self) -> int: ...
    @property
    def retention(self) -> float: ...
    @property
    def compression_seconds(self) -> float: ...


def kv_figures(policy: str, kv: KVHeld, preemptions: int = 0) -> dict[str, Any]:
    """One finished engine request's figures (JSON-serialisable: the plugin ships them between processes)."""
    return {
        "policy": policy,
        "kv_bytes": kv.kv_bytes,
        "kv_bytes_peak": kv.kv_bytes_peak,
        "kv_tokens_kept": kv.tokens_kept,
        "kv_tokens_full": kv.tokens_full,
        "kv_retention": round(kv.retention, 6),
        "compression_seconds": round(kv.compression_seconds, 6),
        "preemptions": preemptions,
    }


#: Figures added to `usage`, besides `kv_policy`.
USAGE_FIELDS = ("kv_bytes", "kv_bytes_peak", "kv_retention", "kv_tokens_kept", "kv_tokens_full")
_SUMMED = ("kv_bytes", "kv_bytes_peak", "kv_tokens_kept", "kv_tokens_full", "compression_seconds", "preemptions")


def combine_figures(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's worth of KV figures for several engine requests answered together.

    Bytes, tokens and times add up; `kv_bytes_peak` is the sum of the peaks (the requests of one answer
    run side by side, so this bounds what they held at once); retention is kept over full tokens.
    """
    if len(figures) == 1:
        return dict(figures[0])
    combined: dict[str, Any] = {}
    policies = sorted({str(f.get("policy", "full")) for f in figures})
    combined["policy"] = policies[0] if len(policies) == 1 else ",".join(policies)
    for name in _SUMMED:
        values = [f[name] for f in figures if name in f]
        if values:
            combined[name] = round(sum(values), 6) if isinstance(values[0], float) else sum(values)
    full = combined.get("kv_tokens_full", 0)
    if full:
        combined["kv_retention"] = round(combined.get("kv_tokens_kept", 0) / full, 6)
    return combined


def usage_fields(figures: dict[str, Any]) -> dict[str, Any]:
    """The `usage` entries for one answer's figures (the same names `kvpress serve` uses)."""
    fields: dict[str, Any] = {"kv_policy": figures.get("policy", "full")}
    fields.update({k: figures[k] for k in USAGE_FIELDS if k in figures})
    return fields
