"""Prometheus metrics, all prefixed `kvpress_`, in a registry owned by one server.

A registry per server (not the process-global default) lets tests and the bench run several
servers in one process without "duplicated timeseries" errors. Everything is updated by the engine
loop thread, except the 4xx/429 rejection counts which the HTTP handlers record;
prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: `kvpress_requests_total{status=...}` values.
REQUEST_STATUSES = ("stop", "length", "aborted", "error", "rejected", "queue_full")

_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_COMPRESSION_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The server's metrics; see docs/server.md for what each one means."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpress_requests", "Requests by final status", ["status"], registry=r
        )  # exported as kvpress_requests_total
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)  # export zeros so dashboards see every series
        self.prompt_tokens = Counter("kvpress_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("kvpress_generation_tokens", "Tokens generated", registry=r)
        self.pages_used = Gauge("kvpress_kv_pages_used", "KV pool pages held by requests", registry=r)
        self.pages_free = Gauge("kvpress_kv_pages_free", "KV pool pages free", registry=r)
        self.pages_total = Gauge("kvpress_kv_pages_total", "KV pool size in pages", registry=r)
        self.page_bytes = Gauge("kvpress_kv_page_bytes", "Bytes of K and V in one page", registry=r)
        self.running = Gauge("kvpress_requests_running", "Requests holding KV pages (admitted)", registry=r)
        self.waiting = Gauge("kvpress_requests_waiting", "Requests queued for admission", registry=r)
        self.running_peak = Gauge(
            "kvpress_requests_running_peak", "Most requests holding KV pages at once since start", registry=r
        )
        # Compressed prefix reuse (`kv_prefix_tokens`, docs/prefix_reuse.md).
        self.prefix_hits = Counter(
            "kvpress_prefix_cache_hits", "Requests that attached to a cached compressed prefix", registry=r
        )
        self.prefix_tokens = Counter(
            "kvpress_prefix_cache_tokens_reused", "Prompt tokens read from cached compressed prefixes", registry=r
        )
        self.prefix_pages = Gauge(
            "kvpress_prefix_cache_pages", "KV pages referenced by cached compressed prefixes", registry=r
        )
        self.prefix_entries = Gauge("kvpress_prefix_cache_entries", "Cached compressed prefixes", registry=r)
        self.retention = Histogram(
            "kvpress_kv_retention_ratio",
            "KV entries kept / entries an uncompressed cache would hold, per finished request",
            ["policy"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvpress_time_to_first_token_seconds",
            "Arrival at the server to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvpress_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.compression = Histogram(
            "kvpress_compression_seconds",
            "Time a request spent in its policy's hooks (prefill compression and decode eviction)",
            ["policy"],
            buckets=_COMPRESSION_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
