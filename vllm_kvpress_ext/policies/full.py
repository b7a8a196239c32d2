"""`full`: no compression. The baseline every accuracy and memory figure is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvpress_ext.policies.base import KVPolicy


@dataclass
class FullPolicy(KVPolicy):
    """Keeps every entry of every (layer, KV head); the engine skips all policy hooks for it."""

    name = "full"
    summary = "no compression: every token is kept"

    @property
    def compresses(self) -> bool:
        return False
