"""What both servers share (`vllm_kvpress_ext.api`): the operator's policy flag, the usage figures and the
metrics schema are the same objects on `kvpress serve` and on `vllm serve` with the plugin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_kvpress_ext.api.metrics import BOTH, EMBEDDED, PLUGIN, SERIES
from vllm_kvpress_ext.api.usage import combine_figures, kv_figures, usage_fields
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine.request import KVStats
from vllm_kvpress_ext.server.metrics import ServerMetrics


def _embedded_families() -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(ServerMetrics().render().decode())}


def _plugin_families(tmp_path: Path) -> dict[str, Any]:
    from vllm_kvpress_ext.vllm_plugin.metrics import EngineMetrics, SnapshotCollector
    from vllm_kvpress_ext.vllm_plugin.report import PoolReport

    metrics = EngineMetrics(tmp_path / "snapshot.json")
    metrics.pool(PoolReport(10, 4, 16, 8, 4096), running=1, waiting=0)
    metrics.request_finished({"policy": "snapkv", "kv_retention": 0.5, "compression_seconds": 0.01})
    return {f.name: f for f in SnapshotCollector(tmp_path / "snapshot.json").collect()}


def test_every_series_is_exported_by_the_servers_the_schema_names(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    exported = {EMBEDDED: _embedded_families(), PLUGIN: _plugin_families(tmp_path)}
    for series in SERIES.values():
        for server, families in exported.items():
            family = families.get(series.name)
            if server not in series.servers:
                assert family is None, f"{series.name} is exported by {server}, which the schema does not list"
                continue
            assert family is not None, f"{server} does not export {series.name}"
            assert (family.type, family.documentation) == (series.kind, series.help)
    both = [s for s in SERIES.values() if s.servers == BOTH]
    assert {s.name for s in both} >= {
        "kvpress_kv_pages_used",
        "kvpress_kv_retention_ratio",
        "kvpress_requests_finished",
    }


def test_histograms_use_the_schemas_buckets(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    retention = SERIES["kvpress_kv_retention_ratio"]
    plugin = _plugin_families(tmp_path)[retention.name]
    bounds = [s.labels["le"] for s in plugin.samples if s.name.endswith("_bucket")]
    assert bounds == [str(b) for b in retention.buckets] + ["+Inf"]
    embedded = ServerMetrics()
    embedded.retention.labels(policy="snapkv").observe(0.5)
    family = {f.name: f for f in text_string_to_metric_families(embedded.render().decode())}[retention.name]
    assert [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")][:-1] == list(retention.buckets)


def test_usage_figures_add_up_the_same_way_for_both_servers() -> None:
    one = kv_figures("snapkv", KVStats(tokens_kept=30, tokens_full=100, kv_bytes=4096, kv_bytes_peak=8192))
    two = kv_figures("snapkv", KVStats(tokens_kept=10, tokens_full=100, kv_bytes=1024, kv_bytes_peak=2048))
    assert usage_fields(one) == {
        "kv_policy": "snapkv",
        "kv_bytes": 4096,
        "kv_bytes_peak": 8192,
        "kv_retention": 0.3,
        "kv_tokens_kept": 30,
        "kv_tokens_full": 100,
    }
    summed = usage_fields(combine_figures([one, two]))
    assert (summed["kv_bytes"], summed["kv_tokens_kept"], summed["kv_retention"]) == (5120, 40, 0.2)


def test_kvpress_serve_takes_a_json_policy_like_vllm_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_kvpress_ext.server.launch as launch

    served: list[Any] = []
    monkeypatch.setattr(launch, "serve", served.append)
    assert main(["serve", "--kv-policy", '{"name": "snapkv", "ratio": 0.25}', "--port", "8999"]) == 0
    assert served[0].kv_policy == {"name": "snapkv", "ratio": 0.25}


@pytest.mark.parametrize(
    "text, message",
    [('{"name": "snapkv", "ratio": 3}', "ratio"), ("{broken", "not valid JSON"), ("nope", "known policies")],
)
def test_kvpress_serve_refuses_a_bad_policy_flag_before_loading(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--kv-policy", text]) == 2
    assert message in capsys.readouterr().err
