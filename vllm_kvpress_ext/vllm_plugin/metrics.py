"""`kvpress_*` series on vLLM's own `/metrics`.

The pool lives in vLLM's engine-core process; `/metrics` is served by its API process from that
process's default Prometheus registry. The scheduler (`EngineMetrics`) therefore keeps the figures
and writes a small JSON snapshot (atomically, at most a few times a second and at every finish) to
the file named by `KVPRESS_METRICS_FILE`, which the API process sets before it starts the engine;
`SnapshotCollector`, registered in the API process, turns the latest snapshot into metric families
at each scrape. Each top-level process picks its own path, so a `vllm serve` started from a script
that itself used `vllm.LLM` does not share the script's file. Under data parallelism each engine core (a
replica with its own scheduler and pool) writes its own file beside it (`replica_metrics_file`), and every
series carries vLLM's own `engine` label (the replica's index, as on vLLM's `vllm:*` series).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.api.metrics import PLUGIN, SERIES, Series
from vllm_kvpress_ext.vllm_plugin.report import PoolReport

ENV = "KVPRESS_METRICS_FILE"
_CHOSEN_BY = "KVPRESS_METRICS_FILE_PID"
RETENTION = SERIES["kvpress_kv_retention_ratio"]
COMPRESSION = SERIES["kvpress_compression_seconds"]
_WRITE_INTERVAL_S = 0.25


def choose_metrics_file() -> Path:
    """A fresh snapshot path for this top-level process, inherited by the engine processes it starts."""
    chosen = os.environ.get(ENV)
    if chosen and os.environ.get(_CHOSEN_BY) == str(os.getpid()):
        return Path(chosen)  # (one this process chose and nobody has unset since)
    path = Path(tempfile.gettempdir()) / f"kvpress-vllm-metrics-{os.getpid()}.json"
    os.environ[ENV] = str(path)
    os.environ[_CHOSEN_BY] = str(os.getpid())
    atexit.register(_remove, path)  # the process that chose the name cleans it up, its replicas' too
    return path


def metrics_file() -> Path:
    """The snapshot path this process writes or reads."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else choose_metrics_file()


def replica_metrics_file(vllm_config: Any) -> Path:
    """The snapshot path of this engine core: the process's for the first (or only) one; under data parallelism,
    the others' beside it, by their replica index. (vLLM runs a dense model's replicas as independent engines
    with `data_parallel_size` 1, each keeping its index in `data_parallel_index`.)"""
    path = metrics_file()
    index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    return path if index == 0 else path.with_name(f"{path.name}.replica{index}")


def _remove(path: Path) -> None:
    for written in [path, *path.parent.glob(f"{path.name}.replica*")]:
        with contextlib.suppress(OSError):
            written.unlink()


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": self.counts, "count": self.total, "sum": self.sum}


class EngineMetrics:
    """Engine-core side: pool gauges, pool-caused preemptions, per-policy retention and compression time."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else metrics_file()
        self.gauges: dict[str, float] = {}
        self.preemptions = 0
        self.running_peak = 0
        self.finished: dict[str, int] = {}
        self.retention: dict[str, _Histogram] = {}
        self.compression: dict[str, _Histogram] = {}
        self.prefix_counters = {"hits": 0, "tokens_reused": 0}  # the worker's store, cumulative
        self.last_write = 0.0

    def scheduled(self, num_requests: int) -> None:
        """Requests in one step's schedule (prefilling or decoding): what the pool let run at once."""
        self.running_peak = max(self.running_peak, num_requests)

    def preempted_by_pool(self) -> None:
        self.preemptions += 1

    def request_finished(self, figures: dict[str, Any]) -> None:
        policy = str(figures.get("policy", "full"))
        self.finished[policy] = self.finished.get(policy, 0) + 1
        self.retention.setdefault(policy, _Histogram(RETENTION.buckets)).observe(float(figures["kv_retention"]))
        if policy != "full":
            self.compression.setdefault(policy, _Histogram(COMPRESSION.buckets)).observe(
                float(figures["compression_seconds"])
            )
        self.write(force=True)

    def pool(self, report: PoolReport, running: int, waiting: int) -> None:
        self.gauges.update(
            {
                "kvpress_kv_pages_total": report.pages_total,
                "kvpress_kv_pages_free": report.pages_free,
                "kvpress_kv_pages_used": report.pages_total - report.pages_free,
                "kvpress_kv_page_bytes": report.page_bytes,
            }
        )
        store = report.prefix_stats
        if store is not None:
            self.gauges["kvpress_prefix_cache_pages"] = store.pages
            self.gauges["kvpress_prefix_cache_entries"] = store.entries
            self.prefix_counters = {"hits": store.hits, "tokens_reused": store.tokens_reused}
        self.requests(running, waiting)

    def requests(self, running: int, waiting: int) -> None:
        """The request gauges; written at once when they change, so the last value of a burst is never
        lost to the write interval (an idle engine runs no further step that would write it)."""
        before = (self.gauges.get("kvpress_requests_running"), self.gauges.get("kvpress_requests_waiting"))
        changed = before != (running, waiting)
        self.gauges.update(
            {
                "kvpress_requests_running": running,
                "kvpress_requests_waiting": waiting,
                "kvpress_requests_running_peak": self.running_peak,
            }
        )
        self.write(force=changed)

    def snapshot(self) -> dict[str, Any]:
        return {
            "gauges": self.gauges,
            "preemptions": self.preemptions,
            "prefix": self.prefix_counters,
            "finished": self.finished,
            "retention": {p: h.as_dict() for p, h in self.retention.items()},
            "compression": {p: h.as_dict() for p, h in self.compression.items()},
        }

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_write < _WRITE_INTERVAL_S:
            return
        self.last_write = now
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)
        except OSError:  # metrics must never break serving
            pass


#: The gauges the snapshot carries, by series name.
_GAUGES = tuple(name for name, series in SERIES.items() if series.kind == "gauge" and PLUGIN in series.servers)


Snapshot = tuple[list[str], dict[str, Any]]  # (the `engine` label's value, or none; the snapshot)


def _histogram_families(series: Series, snapshots: list[Snapshot], key: str, engine: list[str]) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(series.name, series.help, labels=[*series.labels, *engine])
    for label, data in snapshots:
        for policy, h in sorted(data.get(key, {}).items()):
            cumulative = [(str(b), float(c)) for b, c in zip(h["buckets"], h["counts"], strict=True)]
            cumulative.append(("+Inf", float(h["count"])))
            family.add_metric([policy, *label], cumulative, sum_value=float(h["sum"]))
    return family


class SnapshotCollector:
    """API-process side: a Prometheus collector reading the engine's latest snapshot at each scrape (each
    replica's, labelled, under data parallelism)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _snapshots(self) -> tuple[list[Snapshot], list[str]]:
        """Every snapshot with its `engine` label value, and the label's name (none with one engine core)."""
        replicas = {0: self.path}
        for path in self.path.parent.glob(f"{self.path.name}.replica*"):
            index = path.name.rsplit(".replica", 1)[1]
            if index.isdigit():  # not a snapshot being written (`.replicaN.PID.tmp`)
                replicas[int(index)] = path
        if len(replicas) == 1:
            return [([], self._read(self.path))], []
        return [([str(index)], self._read(replicas[index])) for index in sorted(replicas)], ["engine"]

    def describe(self) -> list[Any]:
        return []  # metric names depend on the snapshot; skip registration-time collection

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots, engine = self._snapshots()
        for name in _GAUGES:
            gauge = GaugeMetricFamily(name, SERIES[name].help, labels=engine)
            for label, data in snapshots:
                gauge.add_metric(label, float(data.get("gauges", {}).get(name, 0)))
            yield gauge
        preemptions = SERIES["kvpress_pool_preemptions"]
        preempt = CounterMetricFamily(preemptions.name, preemptions.help, labels=engine)
        for label, data in snapshots:
            preempt.add_metric(label, float(data.get("preemptions", 0)))
        yield preempt
        for name, field_name in (
            ("kvpress_prefix_cache_hits", "hits"),
            ("kvpress_prefix_cache_tokens_reused", "tokens_reused"),
        ):
            counter = CounterMetricFamily(name, SERIES[name].help, labels=engine)
            for label, data in snapshots:
                counter.add_metric(label, float(data.get("prefix", {}).get(field_name, 0)))
            yield counter
        finished_series = SERIES["kvpress_requests_finished"]
        finished = CounterMetricFamily(
            finished_series.name, finished_series.help, labels=[*finished_series.labels, *engine]
        )
        for label, data in snapshots:
            for policy, count in sorted(data.get("finished", {}).items()):
                finished.add_metric([policy, *label], float(count))
        yield finished
        yield _histogram_families(RETENTION, snapshots, "retention", engine)
        yield _histogram_families(COMPRESSION, snapshots, "compression", engine)


_registered = False


def register_collector() -> None:
    """Add the `kvpress_*` collector to the API process's default registry (once)."""
    global _registered
    if _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(SnapshotCollector(metrics_file()))
    _registered = True


def multiprocess_exposition() -> bytes | None:
    """`/metrics` as served where vLLM runs several API server processes (data parallelism raises their count):
    Prometheus's multiprocess mode, in which vLLM's handler collects only what the processes wrote to its
    directory, each scrape. This is that collection with the `kvpress_*` series added; None in the usual
    single-process mode, where the collector is in the default registry (`register_collector`)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return None
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(SnapshotCollector(metrics_file()))
    return bytes(generate_latest(registry))
