"""`EngineStats`: what a caller may read of a running engine, as one frozen snapshot.

The HTTP server's loop publishes gauges, answers `/debug/kv` and files step timings from it; it never
reads the pool, the scheduler's queues or a step's plan itself, so the engine can change how it keeps
them without the server noticing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StepKind = Literal["prefill", "decode", "idle"]


@dataclass(frozen=True)
class PrefixStoreStats:
    """The cached compressed prefixes (`engine/prefix_store.py`): cumulative hits and reused tokens, and
    what the store holds now."""

    hits: int
    tokens_reused: int
    pages: int
    entries: int


@dataclass(frozen=True)
class EngineStats:
    """The pool, the queues and the last step, read between steps.

    `pages_used` counts every page referenced at least once (a page several rows share counts once).
    `running` are the started requests (prefilling or decoding), `waiting` those queued to start.
    `last_step` says what the last `step()` ran; `prefixes` is None when prefix caching is off.
    """

    pages_total: int
    pages_used: int
    pages_free: int
    page_bytes: int
    page_size: int
    running: int
    waiting: int
    last_step: StepKind
    prefixes: PrefixStoreStats | None = None
