"""The `kvpress_*` series on `/metrics`: one name, help text and bucket list for each, whichever server.

`kvpress serve` registers them in its own Prometheus registry (`server/metrics.py`); with the vLLM
plugin the engine-core process snapshots them and vLLM's API process exports them
(`vllm_plugin/metrics.py`). Both build every series they share from `SERIES`, so a dashboard written
for one server reads the other. Series only one server has say so in `servers`: vLLM exports its own
token counters and latency histograms (`vllm:*`), so the plugin does not repeat them, and only the
plugin's scheduler reports pool preemptions separately from vLLM's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EMBEDDED = "kvpress serve"
PLUGIN = "vllm serve"
BOTH = (EMBEDDED, PLUGIN)

RETENTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
COMPRESSION_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Series:
    """One metric. `name` is as registered: Prometheus appends `_total` to a counter's exported name."""

    name: str
    help: str
    kind: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    servers: tuple[str, ...] = BOTH


SERIES: dict[str, Series] = {
    s.name: s
    for s in (
        Series(
            "kvpress_kv_pages_total",
            "KV pool size in pages (a page: page_size tokens of one layer and KV head)",
            "gauge",
        ),
        Series("kvpress_kv_pages_free", "KV pool pages free", "gauge"),
        Series("kvpress_kv_pages_used", "KV pool pages held by requests", "gauge"),
        Series("kvpress_kv_page_bytes", "Bytes of K and V in one page", "gauge"),
        Series("kvpress_requests_running", "Requests holding KV pages (started)", "gauge"),
        Series("kvpress_requests_waiting", "Requests waiting to start", "gauge"),
        Series("kvpress_requests_running_peak", "Most requests holding KV pages at once since start", "gauge"),
        Series(
            "kvpress_kv_retention_ratio",
            "KV entries kept / entries an uncompressed cache would hold, per finished request",
            "histogram",
            labels=("policy",),
            buckets=RETENTION_BUCKETS,
        ),
        Series(
            "kvpress_compression_seconds",
            "Time a request spent in its policy's hooks (prefill compression and decode eviction)",
            "histogram",
            labels=("policy",),
            buckets=COMPRESSION_BUCKETS,
        ),
        Series("kvpress_requests_finished", "Finished requests by KV policy", "counter", labels=("policy",)),
        Series("kvpress_requests", "Requests by final status", "counter", labels=("status",), servers=(EMBEDDED,)),
        Series("kvpress_prompt_tokens", "Prompt tokens of accepted requests", "counter", servers=(EMBEDDED,)),
        Series("kvpress_generation_tokens", "Tokens generated", "counter", servers=(EMBEDDED,)),
        Series(
            "kvpress_time_to_first_token_seconds",
            "Arrival at the server to first generated token",
            "histogram",
            buckets=TTFT_BUCKETS,
            servers=(EMBEDDED,),
        ),
        Series(
            "kvpress_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            "histogram",
            buckets=ITL_BUCKETS,
            servers=(EMBEDDED,),
        ),
        Series(
            "kvpress_prefix_cache_hits",
            "Requests that attached to a cached compressed prefix",
            "counter",
            servers=BOTH,
        ),
        Series(
            "kvpress_prefix_cache_tokens_reused",
            "Prompt tokens read from cached compressed prefixes",
            "counter",
            servers=BOTH,
        ),
        Series(
            "kvpress_prefix_cache_pages",
            "KV pages referenced by cached compressed prefixes",
            "gauge",
            servers=BOTH,
        ),
        Series("kvpress_prefix_cache_entries", "Cached compressed prefixes", "gauge", servers=BOTH),
        Series(
            "kvpress_pool_preemptions",
            "Requests preempted (recomputed later) because the KV pool was full",
            "counter",
            servers=(PLUGIN,),
        ),
    )
}

#: `kvpress_requests_total{status=...}` values.
REQUEST_STATUSES = ("stop", "length", "aborted", "error", "rejected", "queue_full")
