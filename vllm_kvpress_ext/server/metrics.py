"""Prometheus metrics of `kvpress serve`, in a registry owned by one server.

Every series is defined once in `api/metrics.py` (shared with the vLLM plugin). A registry per server
(not the process-global default) lets tests and the bench run several servers in one process without
"duplicated timeseries" errors. Everything is updated by the engine loop thread, except the 4xx/429
rejection counts which the HTTP handlers record; prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_kvpress_ext.api.metrics import EMBEDDED, REQUEST_STATUSES, SERIES

_KINDS: dict[str, Any] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class ServerMetrics:
    """The server's metrics; see docs/server.md for what each one means."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = self._build("kvpress_requests")  # exported as kvpress_requests_total
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)  # export zeros so dashboards see every series
        self.finished = self._build("kvpress_requests_finished")
        self.prompt_tokens = self._build("kvpress_prompt_tokens")
        self.generation_tokens = self._build("kvpress_generation_tokens")
        self.pages_used = self._build("kvpress_kv_pages_used")
        self.pages_free = self._build("kvpress_kv_pages_free")
        self.pages_total = self._build("kvpress_kv_pages_total")
        self.page_bytes = self._build("kvpress_kv_page_bytes")
        self.running = self._build("kvpress_requests_running")
        self.waiting = self._build("kvpress_requests_waiting")
        self.running_peak = self._build("kvpress_requests_running_peak")
        self.retention = self._build("kvpress_kv_retention_ratio")
        self.ttft = self._build("kvpress_time_to_first_token_seconds")
        self.itl = self._build("kvpress_inter_token_latency_seconds")
        self.compression = self._build("kvpress_compression_seconds")
        # Compressed prefix reuse (`kv_prefix_tokens`, docs/prefix_reuse.md).
        self.prefix_hits = self._build("kvpress_prefix_cache_hits")
        self.prefix_tokens = self._build("kvpress_prefix_cache_tokens_reused")
        self.prefix_pages = self._build("kvpress_prefix_cache_pages")
        self.prefix_entries = self._build("kvpress_prefix_cache_entries")

    def _build(self, name: str) -> Any:
        series = SERIES[name]
        assert EMBEDDED in series.servers, f"{name} is not a series of {EMBEDDED}"
        extra: dict[str, Any] = {"buckets": series.buckets} if series.kind == "histogram" else {}
        return _KINDS[series.kind](series.name, series.help, list(series.labels), registry=self.registry, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)
