"""The vLLM plugin's parts that need no running engine: activation, `--kv-policy`, request parsing,
refused features, the HTTP rewrites and the metrics collector."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_utils import MODEL_DIR

from vllm_kvpress_ext.api.errors import APIError
from vllm_kvpress_ext.api.policy_spec import parse_operator_policy, policy_fields
from vllm_kvpress_ext.policies import PolicyConfigError
from vllm_kvpress_ext.vllm_plugin import activation
from vllm_kvpress_ext.vllm_plugin.cli_args import fold_into_additional_config, install_kv_policy_flag
from vllm_kvpress_ext.vllm_plugin.config import UnsupportedConfigError, chosen_runner, settle_runner
from vllm_kvpress_ext.vllm_plugin.metrics import EngineMetrics, SnapshotCollector
from vllm_kvpress_ext.vllm_plugin.middleware import KVPressMiddleware, rewrite_request, rewrite_response
from vllm_kvpress_ext.vllm_plugin.platform import validate_kvpress_request
from vllm_kvpress_ext.vllm_plugin.report import PoolReport
from vllm_kvpress_ext.vllm_plugin.request_policy import request_policy
from vllm_kvpress_ext.vllm_plugin.usage import add_figures_to_usage_chunk, combine_figures
from vllm_kvpress_ext.vllm_plugin.worker import runner_sampling_params


@pytest.mark.parametrize(
    "argv, asked",
    [
        (["vllm", "serve", "m", "--kv-policy", "gvote"], True),
        (["vllm", "serve", "m", "--kv-policy=gvote"], True),
        (["vllm", "serve", "m", "--additional-config", '{"kv_policy": "snapkv"}'], True),
        (["vllm", "serve", "m", '--additional-config={"kv_policy": "snapkv"}'], True),
        (["vllm", "serve", "m", "--additional-config", '{"other": 1}'], False),
        (["vllm", "serve", "m"], False),
    ],
)
def test_compression_is_asked_for_only_by_the_flag_or_additional_config(argv: list[str], asked: bool) -> None:
    assert activation.compression_requested(argv) is asked


@pytest.mark.parametrize(
    "env, cuda, builtin_cpu, argv, expected",
    [
        ("auto", True, False, ["vllm", "serve", "m"], None),  # stock vLLM on a GPU is left alone
        ("auto", True, False, ["vllm", "serve", "m", "--kv-policy", "snapkv"], activation.CUDA_PLATFORM),
        ("auto", False, True, ["vllm", "serve", "m"], None),  # vLLM's own CPU build works: left alone
        ("auto", False, False, ["vllm", "serve", "m"], activation.CPU_PLATFORM),  # nothing else could serve
        ("off", False, False, ["vllm", "serve", "m", "--kv-policy", "snapkv"], None),
        ("on", True, False, ["python", "offline.py"], activation.CUDA_PLATFORM),
    ],
)
def test_platform_activation_is_deliberate(
    monkeypatch: pytest.MonkeyPatch, env: str, cuda: bool, builtin_cpu: bool, argv: list[str], expected: str | None
) -> None:
    monkeypatch.setenv(activation.ENV, env)
    monkeypatch.setattr(activation, "_cuda_present", lambda: cuda)
    monkeypatch.setattr(activation, "_builtin_cpu_platform_works", lambda: builtin_cpu)
    monkeypatch.setattr(activation.sys, "argv", argv)
    assert activation.platform_to_activate() == expected
    if expected is not None:  # vLLM's child processes must resolve the same platform
        assert activation.mode() == "on"


def test_a_bad_activation_setting_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(activation.ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, on or off"):
        activation.platform_to_activate()
    assert activation.plugin_active() is False


def test_kv_policy_flag_accepts_names_presets_and_json(tmp_path: Path) -> None:
    assert parse_operator_policy("gvote") == "gvote"
    assert parse_operator_policy('{"name": "snapkv", "ratio": 0.25}') == {"name": "snapkv", "ratio": 0.25}
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: h2o\nratio: 0.3\n")
    assert parse_operator_policy(str(preset)) == {"name": "h2o", "ratio": 0.3}
    assert fold_into_additional_config("snapkv", {"kv_num_pages": 9}) == {"kv_num_pages": 9, "kv_policy": "snapkv"}


@pytest.mark.parametrize(
    "flag, config, message",
    [
        ("nonexistent", {}, "known policies"),
        ('{"name": "snapkv", "ratio": 3}', {}, "ratio"),
        ("{broken", {}, "not valid JSON"),
        ("missing.yaml", {}, "does not exist"),
        ("snapkv", {"kv_policy": "h2o"}, "disagree"),
        (None, {"kv_policy": "nope"}, "known policies"),
    ],
)
def test_a_bad_kv_policy_flag_fails_at_once(flag: str | None, config: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        fold_into_additional_config(flag, config)


def test_request_policies_from_vllm_xargs() -> None:
    snapkv = request_policy({"kv_policy": "snapkv", "kv_ratio": 0.25}, None)
    assert snapkv is not None and snapkv.name == "snapkv" and snapkv.ratio == 0.25  # type: ignore[attr-defined]
    as_json = request_policy({"kv_policy": '{"name": "snapkv", "ratio": "0.1"}'}, None)
    assert as_json is not None and as_json.ratio == 0.1  # type: ignore[attr-defined]
    default = request_policy(None, snapkv)
    assert default is snapkv
    assert request_policy({"kv_policy": "full"}, snapkv) is None  # "full" turns compression off
    # vLLM's own disaggregated-prefill field is not a policy field.
    assert request_policy({"kv_transfer_params": {"x": 1}}, snapkv) is snapkv


@pytest.mark.parametrize(
    "extra_args, param",
    [
        ({"kv_policy": "nonexistent"}, "kv_policy"),
        ({"kv_policy": "snapkv", "kv_ratio": 2.0}, "kv_policy"),
        ({"kv_policy": "snapkv", "kv_nonsense": 1}, "kv_policy"),
        ({"kv_ratio": 0.5}, "vllm_xargs"),
        ({"kv_policy": "configs/snapkv.yaml"}, "vllm_xargs.kv_policy"),  # no file paths over HTTP
    ],
)
def test_bad_request_policies_are_validation_errors(extra_args: dict[str, Any], param: str) -> None:
    with pytest.raises(VLLMValidationError) as caught:
        validate_kvpress_request(VllmSamplingParams(max_tokens=4, extra_args=extra_args))
    assert caught.value.parameter == param


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logprobs": 21},
        {"prompt_logprobs": 21},
        {"repetition_penalty": 150.0},
        {"allowed_token_ids": [1, 2]},
    ],
)
def test_unsupported_sampling_features_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(VLLMValidationError) as caught:
        validate_kvpress_request(VllmSamplingParams(max_tokens=4, **kwargs))
    assert caught.value.parameter == next(iter(kwargs))


def test_supported_sampling_maps_onto_the_runner() -> None:
    validate_kvpress_request(VllmSamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=-1, seed=3))
    params = runner_sampling_params(VllmSamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=3))
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 0, 3)
    assert params.ignore_eos  # vLLM alone decides when a request stops


def test_penalties_min_p_and_min_tokens_reach_the_runners_sampler() -> None:
    vllm_params = VllmSamplingParams(
        max_tokens=8,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        min_tokens=3,
        stop_token_ids=[7, 5],
    )
    validate_kvpress_request(vllm_params)
    params = runner_sampling_params(vllm_params)
    assert (params.min_p, params.repetition_penalty, params.presence_penalty) == (0.1, 1.2, 0.5)
    assert (params.frequency_penalty, params.min_tokens) == (-0.25, 3)
    # What vLLM would stop on is what the sampler holds back until min_tokens are out.
    assert set(params.stop_token_ids) == vllm_params.all_stop_token_ids == {5, 7}
    assert runner_sampling_params(VllmSamplingParams(stop_token_ids=[5])).stop_token_ids == ()


def test_a_logit_bias_reaches_the_runners_sampler() -> None:
    vllm_params = VllmSamplingParams(max_tokens=4, logit_bias={3: 1.5, 9: -100.0})
    validate_kvpress_request(vllm_params)
    assert runner_sampling_params(vllm_params).logit_bias == ((3, 1.5), (9, -100.0))


def test_the_body_kv_policy_moves_into_vllm_xargs() -> None:
    moved = rewrite_request({"prompt": "a", "kv_policy": {"name": "snapkv", "ratio": 0.1}})
    assert "kv_policy" not in moved
    assert json.loads(moved["vllm_xargs"]["kv_policy"]) == {"name": "snapkv", "ratio": 0.1}
    merged = rewrite_request({"kv_policy": "snapkv", "vllm_xargs": {"kv_ratio": 0.25, "other": "x"}})
    assert json.loads(merged["vllm_xargs"]["kv_policy"]) == {"name": "snapkv", "ratio": 0.25}
    assert merged["vllm_xargs"]["other"] == "x"
    untouched = {"prompt": "a", "vllm_xargs": {"kv_policy": "h2o"}}
    assert rewrite_request(dict(untouched)) == untouched
    with pytest.raises(APIError, match="disagree"):
        rewrite_request({"kv_policy": "snapkv", "vllm_xargs": {"kv_policy": "h2o"}})


def test_kv_figures_move_into_usage() -> None:
    figures = {"policy": "snapkv", "kv_bytes": 4096, "kv_bytes_peak": 8192, "kv_retention": 0.25, "preemptions": 0}
    body = {"usage": {"prompt_tokens": 3}, "kv_transfer_params": {"kvpress": figures}}
    out = rewrite_response(body)
    assert "kv_transfer_params" not in out
    assert out["usage"] == {
        "prompt_tokens": 3,
        "kv_policy": "snapkv",
        "kv_bytes": 4096,
        "kv_bytes_peak": 8192,
        "kv_retention": 0.25,
    }
    other = {"usage": {}, "kv_transfer_params": {"remote": 1, "kvpress": figures}}
    assert rewrite_response(other)["kv_transfer_params"] == {"remote": 1}


def test_engine_metrics_reach_the_collector(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    metrics = EngineMetrics(path)
    metrics.scheduled(3)
    metrics.preempted_by_pool()
    metrics.pool(PoolReport(100, 60, 16, 8, 4096), running=3, waiting=2)
    metrics.request_finished({"policy": "snapkv", "kv_retention": 0.3, "compression_seconds": 0.002})
    metrics.request_finished({"policy": "full", "kv_retention": 1.0, "compression_seconds": 0.0})
    families = {f.name: f for f in SnapshotCollector(path).collect()}
    value = {f.name: f.samples[0].value for f in families.values() if f.samples and not f.samples[0].labels}
    assert value["kvpress_kv_pages_free"] == 60 and value["kvpress_kv_pages_used"] == 40
    assert value["kvpress_requests_running_peak"] == 3 and value["kvpress_pool_preemptions"] == 1
    retention = {
        (s.name, s.labels.get("policy"), s.labels.get("le")): s.value
        for s in families["kvpress_kv_retention_ratio"].samples
    }
    assert retention[("kvpress_kv_retention_ratio_bucket", "snapkv", "0.2")] == 0
    assert retention[("kvpress_kv_retention_ratio_bucket", "snapkv", "0.3")] == 1
    assert retention[("kvpress_kv_retention_ratio_count", "full", None)] == 1
    assert "full" not in {s.labels.get("policy") for s in families["kvpress_compression_seconds"].samples}
    assert list(SnapshotCollector(tmp_path / "absent.json").collect())  # no engine yet: zeros, no error
    assert value["kvpress_prefix_cache_hits"] == 0 and value["kvpress_prefix_cache_entries"] == 0  # store off


def test_each_data_parallel_replica_reports_under_its_engine_label(tmp_path: Path) -> None:
    """Two engine cores (data parallelism) write their own snapshots; every series carries vLLM's `engine` label."""
    from vllm_kvpress_ext.vllm_plugin.metrics import replica_metrics_file

    path = tmp_path / "snapshot.json"
    for index, free in ((0, 60), (1, 20)):
        # As vLLM configures a dense model's replicas: independent engines, each with its index.
        config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_index=index))
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVPRESS_METRICS_FILE", str(path))
            patch.setenv("KVPRESS_METRICS_FILE_PID", str(os.getpid()))
            replica_path = replica_metrics_file(config)
        assert replica_path == (path if index == 0 else tmp_path / "snapshot.json.replica1")
        metrics = EngineMetrics(replica_path)
        metrics.pool(PoolReport(100, free, 16, 8, 4096), running=1, waiting=index)
        metrics.request_finished({"policy": "snapkv", "kv_retention": 0.3, "compression_seconds": 0.002})
    (tmp_path / "snapshot.json.replica1.123.tmp").write_text("{")  # a snapshot being written: not a replica
    families = {f.name: f for f in SnapshotCollector(path).collect()}
    free = {s.labels["engine"]: s.value for s in families["kvpress_kv_pages_free"].samples}
    assert free == {"0": 60, "1": 20}
    finished = {(s.labels["policy"], s.labels["engine"]) for s in families["kvpress_requests_finished"].samples}
    assert finished == {("snapkv", "0"), ("snapkv", "1")}
    assert all("engine" in s.labels for f in families.values() for s in f.samples)


def test_prefix_store_figures_reach_the_collector(tmp_path: Path) -> None:
    """The worker's store is cumulative: each report carries its totals, and the collector shows the last."""
    from vllm_kvpress_ext.engine.stats import PrefixStoreStats

    path = tmp_path / "snapshot.json"
    metrics = EngineMetrics(path)
    for hits, tokens, pages, entries in ((1, 80, 12, 1), (3, 250, 30, 2)):
        report = PoolReport(100, 60, 16, 8, 4096, prefix_stats=PrefixStoreStats(hits, tokens, pages, entries))
        metrics.pool(report, running=1, waiting=0)
    metrics.write(force=True)
    samples = {s.name: s.value for f in SnapshotCollector(path).collect() for s in f.samples if not s.labels}
    assert samples["kvpress_prefix_cache_hits_total"] == 3
    assert samples["kvpress_prefix_cache_tokens_reused_total"] == 250
    assert samples["kvpress_prefix_cache_pages"] == 30 and samples["kvpress_prefix_cache_entries"] == 2


def test_the_flag_reaches_additional_config_and_is_refused_when_the_plugin_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    install_kv_policy_flag()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = ["--model", str(MODEL_DIR), "--kv-policy", '{"name": "snapkv", "ratio": 0.25}']
    monkeypatch.setenv(activation.ENV, "on")
    engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert engine_args.additional_config["kv_policy"] == {"name": "snapkv", "ratio": 0.25}
    monkeypatch.setenv(activation.ENV, "off")
    with pytest.raises(PolicyConfigError, match="KVPRESS_VLLM=off"):
        EngineArgs.from_cli_args(parser.parse_args(argv))
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", str(MODEL_DIR)])).additional_config == {}


def _through_middleware(body: bytes) -> tuple[list[dict[str, Any]], list[bytes]]:
    """What `KVPressMiddleware` sends back for `body`, and the bodies the wrapped app (vLLM) received."""
    sent: list[dict[str, Any]] = []
    forwarded: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        forwarded.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(KVPressMiddleware(app)(scope, receive, send))
    return sent, forwarded


def test_a_deeply_nested_body_is_an_openai_shaped_400_not_a_500() -> None:
    nested = b'{"prompt": "a", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    for body in (nested, b"[" * 20_000 + b"]" * 20_000):
        sent, forwarded = _through_middleware(body)
        assert sent[0]["status"] == 400 and not forwarded
        error = json.loads(sent[1]["body"])["error"]
        assert "nested too deeply" in error["message"] and error["code"] == 400


def test_bodies_the_middleware_cannot_rewrite_reach_vllm_or_get_a_400() -> None:
    sent, forwarded = _through_middleware(b"not json")
    assert forwarded == [b"not json"]  # vLLM answers it with its own 400
    sent, forwarded = _through_middleware(json.dumps({"kv_policy": "snapkv", "vllm_xargs": [1]}).encode())
    assert not forwarded and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["param"] == "vllm_xargs"


def test_kv_figures_of_several_requests_add_up() -> None:
    one = {"policy": "snapkv", "kv_bytes": 100, "kv_bytes_peak": 300, "kv_tokens_kept": 10, "kv_tokens_full": 40}
    two = {"policy": "snapkv", "kv_bytes": 50, "kv_bytes_peak": 200, "kv_tokens_kept": 20, "kv_tokens_full": 40}
    assert combine_figures([one]) == one
    combined = combine_figures([one, two])
    assert combined == {
        "policy": "snapkv",
        "kv_bytes": 150,
        "kv_bytes_peak": 500,
        "kv_tokens_kept": 30,
        "kv_tokens_full": 80,
        "kv_retention": 0.375,
    }
    assert combine_figures([one, {**two, "policy": "full"}])["policy"] == "full,snapkv"


def test_only_the_final_usage_chunk_of_a_stream_gets_the_figures() -> None:
    figures = [{"policy": "h2o", "kv_bytes": 64, "kv_retention": 0.5, "kv_tokens_kept": 4, "kv_tokens_full": 8}]
    final = 'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    usage = json.loads(add_figures_to_usage_chunk(final, figures)[len("data: ") :])["usage"]
    assert usage == {
        "prompt_tokens": 3,
        "kv_policy": "h2o",
        "kv_bytes": 64,
        "kv_retention": 0.5,
        "kv_tokens_kept": 4,
        "kv_tokens_full": 8,
    }
    continuous = 'data: {"choices":[{"index":0,"text":"a"}],"usage":{"prompt_tokens":3}}\n\n'
    for chunk in (continuous, "data: [DONE]\n\n", 'data: {"choices":[{"text":"usage"}]}\n\n'):
        assert add_figures_to_usage_chunk(chunk, figures) == chunk
    assert add_figures_to_usage_chunk(final, []) == final


def test_the_running_gauge_returns_to_zero_when_the_last_request_finishes(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    metrics = EngineMetrics(path)
    report = PoolReport(100, 60, 16, 8, 4096)
    metrics.pool(report, running=1, waiting=0)
    metrics.request_finished({"policy": "full", "kv_retention": 1.0, "compression_seconds": 0.0})
    metrics.pool(report, running=0, waiting=0)  # within the write interval of the finish's forced write
    assert json.loads(path.read_text())["gauges"]["kvpress_requests_running"] == 0
    metrics.requests(running=0, waiting=1)  # an abort outside a step
    assert json.loads(path.read_text())["gauges"]["kvpress_requests_waiting"] == 1


def test_a_catalog_name_survives_hf_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HF_HUB_OFFLINE, vLLM asks the hub cache for the model by name before the plugin resolves it."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvpress_ext.vllm_plugin.gguf_model import install_gguf_models

    install_gguf_models()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv(activation.ENV, "on")
    assert EngineArgs(model="smollm2-135m").model == "smollm2-135m"  # resolved later, in create_engine_config
    monkeypatch.setenv(activation.ENV, "off")
    with pytest.raises(LocalEntryNotFoundError):  # without the plugin, vLLM's own lookup (the defect's error)
        EngineArgs(model="smollm2-135m")


def test_metrics_file_is_chosen_again_when_its_variable_was_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that chose the snapshot path and then lost the variable (a test fixture, an embedding
    application restoring its environment) chooses again instead of failing with a KeyError."""
    from vllm_kvpress_ext.vllm_plugin import metrics

    monkeypatch.delenv(metrics.ENV, raising=False)
    monkeypatch.delenv("KVPRESS_METRICS_FILE_PID", raising=False)
    first = metrics.metrics_file()
    assert metrics.metrics_file() == first  # chosen once, then read back
    monkeypatch.delenv(metrics.ENV)
    again = metrics.metrics_file()
    assert again == first and metrics.metrics_file() == again
    monkeypatch.setenv(metrics.ENV, "/tmp/elsewhere.json")  # a parent's choice is taken as it is
    assert metrics.metrics_file() == Path("/tmp/elsewhere.json")


def test_the_cuda_platform_wires_vllms_cuda_platform_to_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's CUDA platform, as vLLM resolves it from `activation.CUDA_PLATFORM`, on a machine without
    CUDA. vLLM's own `vllm.platforms.cuda` loads its CUDA ops at import (`libcuda.so.1`, then torch's
    `libtorch_cuda.so`, which a CPU build of torch lacks), so a stand-in for that one module takes its place:
    what is checked is the plugin's side, that vLLM's CUDA checks run first and the plugin's after them."""
    import sys
    import types

    from vllm.config import VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_kvpress_ext.vllm_plugin.config import SCHEDULER_CLS, WORKER_CLS

    calls: list[str] = []

    class CudaPlatform(Platform):  # vLLM's CUDA platform, down to the two hooks the plugin extends
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            calls.append("vllm config")

        @classmethod
        def validate_request(cls, processed_inputs: Any, params: Any) -> None:
            calls.append("vllm request")

    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", types.SimpleNamespace(CudaPlatform=CudaPlatform))
    monkeypatch.delitem(sys.modules, "vllm_kvpress_ext.vllm_plugin.cuda_platform", raising=False)
    platform = resolve_obj_by_qualname(activation.CUDA_PLATFORM)
    assert issubclass(platform, CudaPlatform) and platform().is_cuda()
    config = VllmConfig()
    config.additional_config = {}  # as the CUDA platform gets it: not yet settled by this machine's CPU platform
    config.parallel_config.worker_cls = "auto"
    config.cache_config.enable_prefix_caching = True
    platform.check_and_update_config(config)
    assert calls == ["vllm config"]
    assert config.parallel_config.worker_cls == WORKER_CLS and config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert not config.scheduler_config.async_scheduling and not config.cache_config.enable_prefix_caching
    assert config.compilation_config.cudagraph_capture_sizes == []
    platform.validate_request(None, VllmSamplingParams(max_tokens=4))
    with pytest.raises(VLLMValidationError):
        platform.validate_request(None, VllmSamplingParams(max_tokens=4, extra_args={"kv_policy": "nope"}))
    assert calls == ["vllm config", "vllm request", "vllm request"]
    monkeypatch.delitem(sys.modules, "vllm_kvpress_ext.vllm_plugin.cuda_platform")  # built on the stand-in


def test_the_worker_on_cuda_sizes_its_pool_from_free_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's CUDA path with the device mocked where it is asked (`set_device`, `mem_get_info`): it picks
    `cuda:<local rank>` and gives the pool the free memory within --gpu-memory-utilization, less the weights."""
    from types import SimpleNamespace

    import torch

    from vllm_kvpress_ext.vllm_plugin.worker import KVPressWorker, _weight_bytes

    gib = 2**30
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    worker = KVPressWorker.__new__(KVPressWorker)
    worker.current_platform = SimpleNamespace(device_type="cuda")
    worker.local_rank = 1
    worker.init_device()
    assert worker.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    worker.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    worker.model_config = SimpleNamespace(dtype=torch.bfloat16)
    weights = _weight_bytes(MODEL_DIR, torch.bfloat16)
    assert weights > 0
    assert worker._pool_size({}, MODEL_DIR) == (None, int(60 * gib - 80 * gib * (1.0 - 0.9) - weights))
    assert worker._pool_size({"kv_num_pages": 77}, MODEL_DIR) == (77, None)
    worker.cache_config.kv_cache_memory_bytes = 5 * gib
    assert worker._pool_size({}, MODEL_DIR) == (None, 5 * gib)


@pytest.mark.parametrize("value", [3, -1, 10**9, "x"])
def test_kv_prefix_messages_is_a_400_not_ignored(value: Any) -> None:
    """vLLM drops unknown body fields unread: without this, a client naming its context by messages got a 200 for
    a request that was not what it asked for."""
    with pytest.raises(APIError) as refused:
        rewrite_request({"prompt": "a", "kv_prefix_messages": value, "kv_policy": "snapkv"})
    assert refused.value.status == 400 and refused.value.param == "kv_prefix_messages"
    assert "kv_prefix_tokens" in str(refused.value)


def test_kv_prefix_tokens_moves_into_vllm_xargs_unread() -> None:
    """The body field goes where vLLM passes it to the engine (checked there against the prompt); it is no policy
    field, so it never refines the policy; two values that disagree are a 400, a null is no context."""
    moved = rewrite_request({"prompt": "a", "kv_prefix_tokens": 40, "kv_policy": "snapkv"})
    assert moved["vllm_xargs"] == {"kv_prefix_tokens": 40, "kv_policy": "snapkv"}
    alone = rewrite_request({"prompt": "a", "kv_prefix_tokens": "x"})
    assert alone["vllm_xargs"] == {"kv_prefix_tokens": "x"}  # refused by name where the prompt is known
    flat = rewrite_request({"kv_policy": "snapkv", "vllm_xargs": {"kv_ratio": 0.5, "kv_prefix_tokens": 8}})
    assert flat["vllm_xargs"]["kv_prefix_tokens"] == 8
    assert json.loads(flat["vllm_xargs"]["kv_policy"]) == {"name": "snapkv", "ratio": 0.5}
    assert rewrite_request({"prompt": "a", "kv_prefix_tokens": None}) == {"prompt": "a", "vllm_xargs": {}}
    with pytest.raises(APIError, match="disagree") as refused:
        rewrite_request({"kv_prefix_tokens": 3, "vllm_xargs": {"kv_prefix_tokens": 4}})
    assert refused.value.param == "kv_prefix_tokens"
    fields = {"kv_prefix_tokens": 3, "kv_transfer_params": {}, "kv_policy": "snapkv", "kv_ratio": 0.5, "seed": 1}
    assert policy_fields(fields) == {"kv_policy": "snapkv", "kv_ratio": 0.5}


def test_the_runner_is_vllms_unless_asked_or_on_a_gpu_for_an_architecture_the_own_runner_runs() -> None:
    assert chosen_runner({}, ["LlamaForCausalLM"]) == "vllm"
    assert chosen_runner({}, ["Gemma3ForCausalLM"]) == "vllm"
    assert chosen_runner({}, None) == "vllm"
    # On a GPU vLLM's runner does not run yet: the plugin's own runner serves what it can.
    assert chosen_runner({}, ["LlamaForCausalLM"], on_gpu=True) == "project"
    assert chosen_runner({}, None, on_gpu=True) == "project"  # not known yet
    assert chosen_runner({}, ["Gemma3ForCausalLM"], on_gpu=True) == "vllm"  # refused there at start, with the reason
    assert chosen_runner({"kv_runner": "project"}, ["LlamaForCausalLM"]) == "project"
    assert chosen_runner({"kv_runner": "project"}, ["Gemma3ForCausalLM"]) == "project"  # asked for: it says why not
    with pytest.raises(UnsupportedConfigError, match="kv_runner must be one of"):
        chosen_runner({"kv_runner": "mine"}, ["LlamaForCausalLM"])
    # Settled once and written down, so that every process built from the config agrees.
    config = SimpleNamespace(model_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), additional_config=None)
    assert settle_runner(config) == "vllm" and config.additional_config == {"kv_runner": "vllm"}


def test_a_plan_over_all_heads_is_cut_to_each_tensor_parallel_workers_part() -> None:
    import torch

    from vllm_kvpress_ext.cache import KeepPlan
    from vllm_kvpress_ext.engine.compression import workers_part
    from vllm_kvpress_ext.policies.base import HeadShard

    mask = torch.rand(2, 4, 10, generator=torch.Generator().manual_seed(0)) > 0.5
    plan = KeepPlan.from_mask(mask)
    for first in (0, 2):
        shard = HeadShard(first, 2, 4, gather=lambda t: t)
        part = workers_part(plan, shard)
        assert torch.equal(part.to_mask(torch.full((2, 2), 10)), mask[:, first : first + 2])
        assert workers_part(part, shard) is part  # a plan over the worker's own heads is applied as it is
    with pytest.raises(ValueError, match="covers 3 KV heads"):
        workers_part(KeepPlan.from_mask(mask[:, :3]), HeadShard(0, 2, 4, gather=lambda t: t))


def test_the_scheduler_reads_the_tightest_tensor_parallel_worker() -> None:
    """The workers' pool reports merged: the fewest free pages, the most any request's next token needs, every
    worker's failures, the blocks all of them keep, and a request's figures over all of its heads."""
    from vllm_kvpress_ext.vllm_plugin.native.tensor_parallel import merge_reports

    def figures(kept: int, seconds: float) -> dict[str, Any]:
        return {
            "policy": "snapkv",
            "kv_bytes": 64 * kept,
            "kv_bytes_peak": 128 * kept,
            "kv_tokens_kept": kept,
            "kv_tokens_full": 100,
            "kv_retention": kept / 100,
            "compression_seconds": seconds,
            "preemptions": 1,
        }

    first = PoolReport(100, 60, 16, 8, 4096, decode_pages={"a": 1, "b": 0}, pages_held={"a": 5})
    second = PoolReport(100, 40, 16, 8, 4096, decode_pages={"a": 0, "b": 2}, pages_held={"a": 7})
    first.kv, second.kv = {"a": figures(30, 0.5)}, {"a": figures(10, 0.75)}
    second.failed = {"c": "pool exhausted"}
    first.prefix_blocks, second.prefix_blocks = frozenset({1, 2, 3}), frozenset({2, 3, 4})
    merged = merge_reports([first, second])
    assert merged.pages_free == 40 and merged.decode_pages == {"a": 1, "b": 2} and merged.pages_held == {"a": 7}
    assert merged.failed == {"c": "pool exhausted"} and merged.prefix_blocks == frozenset({2, 3})
    kv = merged.kv["a"]
    assert (kv["kv_tokens_kept"], kv["kv_tokens_full"], kv["kv_bytes"]) == (40, 200, 64 * 40)
    assert kv["kv_retention"] == 0.2 and kv["compression_seconds"] == 0.75 and kv["preemptions"] == 1
    replicated = merge_reports([first, first], replicas=2)  # one head held twice is counted once
    assert replicated.kv["a"]["kv_tokens_kept"] == 30 and replicated.kv["a"]["kv_tokens_full"] == 100


def test_a_tensor_parallel_workers_report_travels_as_numbers() -> None:
    """A usual step's report crosses the workers as one float tensor: the merge of reports rebuilt from it equals
    the merge of the reports themselves, for requests with and without figures or a next-token count."""
    from vllm_kvpress_ext.vllm_plugin.native.tensor_parallel import merge_reports, report_from_numbers, report_numbers

    def report(free: int, kept: int, seconds: float) -> PoolReport:
        made = PoolReport(100, free, 16, 8, 4096, prefix_evictable=free // 3, compresses_layerwise=free > 50)
        made.pages_held = {"a": kept, "b": 3, "c": 2**40 + kept}
        made.decode_pages = {"a": 1, "c": kept % 3}
        made.kv = {
            "a": {
                "policy": "adakv",
                "kv_bytes": 2**40 * kept,
                "kv_bytes_peak": 2**41,
                "kv_tokens_kept": kept,
                "kv_tokens_full": 100,
                "kv_retention": kept / 100,
                "compression_seconds": seconds,
                "preemptions": 2,
            },
        }
        return made

    first, second = report(60, 30, 0.125), report(40, 10, 1 / 3)
    assert report_numbers(first).shape == (4 + 3 * 8,)
    rebuilt = [report_from_numbers(first, report_numbers(part)) for part in (first, second)]
    assert rebuilt[0] == first and rebuilt[1] == second
    assert merge_reports(rebuilt, replicas=1) == merge_reports([first, second])
