"""Benchmarks run end to end at small sizes and print their tables (no timing asserted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_kvpress_ext.bench.cache_bench import CacheBenchConfig, run_cache_bench
from vllm_kvpress_ext.cli import main


def test_bench_cache_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run_cache_bench(
        CacheBenchConfig(num_requests=4, num_layers=2, num_kv_heads=2, head_dim=8, prompt_len=40, decode_steps=20)
    )
    out = capsys.readouterr().out
    assert "vectorised cache" in out and "naive per-head loop" in out and "tokens examined / s" in out
    assert figures["decode_bookkeeping_ms"] > 0 and figures["compaction_tokens_per_s"] > 0


def test_bench_throughput_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "throughput",
                "--batch-sizes",
                "1,2",
                "--prompt-lens",
                "24",
                "--decode-steps",
                "3",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prefill tok/s" in out and "decode tok/s" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("24 ")]) == 2


def test_bench_rejects_bad_lists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--batch-sizes", "0,x"])
    assert exit_info.value.code == 2  # argparse's usage error
    assert "argument --batch-sizes: expected comma-separated integers, got '0,x'" in capsys.readouterr().err


def test_bench_policies_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "policies", "--prompt-lens", "64", "--policies", "full,snapkv", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("64 ")]
    assert [r[1] for r in rows] == ["full", "snapkv"]
    assert float(rows[0][7]) == 1.0 and float(rows[1][7]) < 0.6  # retention column
    assert rows[0][5] == "+0.0%"  # `full` is the baseline of the cost column


def test_bench_policies_runs_the_baseline_first_and_repeats(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_kvpress_ext.bench import policies_bench

    prompt_lengths: list[int] = []
    timed = policies_bench._timed_request

    def counting(engine: Any, prompt: list[int], params: Any, policy: str) -> Any:
        prompt_lengths.append(len(prompt))
        return timed(engine, prompt, params, policy)

    monkeypatch.setattr(policies_bench, "_timed_request", counting)
    argv = ["bench", "policies", "--prompt-lens", "600", "--policies", "h2o", "--decode-steps", "1", "--repeats", "2"]
    assert main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("600 ")]
    assert [r[1] for r in rows] == ["full", "h2o"]
    # A warm-up per policy (512 tokens: long enough for every policy to compress), then each request twice.
    assert prompt_lengths == [512, 512, 600, 600, 600, 600]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv[:-1], "0"])
    assert exit_info.value.code == 2 and "--repeats" in capsys.readouterr().err


def test_bench_capacity_holds_more_compressed_requests(capsys: pytest.CaptureFixture[str]) -> None:
    """Same pool, same prompts: the count of requests held at once comes from the scheduler, pages from the pool."""
    from vllm_kvpress_ext.bench.capacity import CapacityConfig, run_capacity_bench

    # Bench model: 4 layers x 2 KV heads, head_dim 32, fp32 -> 4 KiB pages. A 256 + 8 token request
    # needs 17 pages per head = 136 pages uncompressed; the 320-page pool admits 2 of them at once.
    results = run_capacity_bench(
        CapacityConfig(
            policies=("full", "snapkv"), prompt_len=256, new_tokens=8, requests=6, kv_memory=320 * 4096, ratio=0.25
        )
    )
    full, snapkv = results
    assert full["held_peak"] == 2 and full["retention"] == 1.0
    assert snapkv["held_peak"] >= 2 * full["held_peak"]
    assert 0.2 < snapkv["retention"] < 0.35
    assert "held peak" in capsys.readouterr().out


def test_bench_capacity_cli_rejects_unknown_shape() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "capacity", "--shape", "llama-70b"])
    assert exc.value.code == 2


def test_bench_policies_defaults_run_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """The default run covers every registered policy; the random model gets untrained WG-KV gates."""
    from vllm_kvpress_ext.policies import policy_names

    assert main(["bench", "policies", "--prompt-lens", "48", "--decode-steps", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("48 ")]
    assert sorted(r[1] for r in rows) == sorted(policy_names())


def test_bench_policies_skips_wgkv_on_a_model_without_gates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.bench.models import bench_model_dir
    from vllm_kvpress_ext.models.write_gate import default_gate_path

    model = bench_model_dir(tmp_path)
    argv = ["bench", "policies", "--model", str(model), "--prompt-lens", "48", "--policies", "wgkv,snapkv"]
    assert main([*argv, "--decode-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "wgkv: skipped, no write gates at" in out
    assert [line.split()[1] for line in out.splitlines() if line.strip().startswith("48 ")] == ["full", "snapkv"]
    assert not default_gate_path(model).exists()  # nothing written beside a user's model


def test_bench_capacity_samples_sharing_the_prompt_hold_more_at_once() -> None:
    """n samples of a prompt on its shared pages fit more answers in one pool than n separate requests."""
    from vllm_kvpress_ext.bench.capacity import CapacityConfig, run_capacity_bench

    results = run_capacity_bench(
        CapacityConfig(policies=("full",), prompt_len=256, new_tokens=4, requests=2, samples=4, kv_memory=320 * 4096)
    )
    shared, separate = results
    assert shared["policy"] == "full (n=4, shared)" and separate["policy"] == "full (n=4, separate)"
    # Separate: 136 pages per answer, 2 at once. Shared: one prompt plus a page per (layer, head) and sample.
    assert separate["held_peak"] == 2
    assert shared["held_peak"] >= 4
    assert shared["kv_mib_per_request"] < separate["kv_mib_per_request"] / 2


def test_bench_linear_times_both_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from model_utils import write_suite_model

    from vllm_kvpress_ext.bench.linear_bench import LinearBenchConfig, run_linear_bench
    from vllm_kvpress_ext.models import linear as linear_module

    model = write_suite_model(tmp_path / "model")
    results = run_linear_bench(LinearBenchConfig(model=str(model), rows=(1, 3), repeats=1))
    out = capsys.readouterr().out
    assert "14 projections" in out and "F.linear / oneDNN" in out  # 2 layers x 7 projections
    assert [r["rows"] for r in results] == [1, 3]
    assert all(r["f_linear_ms"] > 0 and r["onednn_ms"] > 0 for r in results)
    if linear_module.onednn_runs(torch.float32):  # the packed weights' path, the one vLLM's runner takes
        assert "oneDNN / packed" in out and all(r["packed_ms"] > 0 for r in results)
    run_linear_bench(LinearBenchConfig(model=str(model), rows=(2,), repeats=1, head=True))
    assert "14 projections and the vocabulary head" in capsys.readouterr().out
    with pytest.raises(ValueError, match="row counts"):
        LinearBenchConfig(model=str(model), rows=(0,))


def test_bench_decode_step_measures_a_step_against_its_floor(capsys: pytest.CaptureFixture[str]) -> None:
    """The floor counts what a step reads: compressing to a quarter cuts the kept K/V bytes to about a
    quarter and lowers the floor by exactly the bytes' difference over the same bandwidth; H2O, which
    needs decode attention weights, shows more host syncs per step than full."""
    from vllm_kvpress_ext.bench.decode_step import DecodeStepConfig, run_decode_step_bench

    results = run_decode_step_bench(
        DecodeStepConfig(policies=("full", "snapkv", "h2o"), batch=2, prompt_len=256, steps=3, profile_steps=2)
    )
    by_name = {r["policy"]: r for r in results}
    full, snap = by_name["full"], by_name["snapkv"]
    assert full["weights_GB"] == snap["weights_GB"] > 0
    assert 0.2 < snap["kv_GB"] / full["kv_GB"] < 0.35
    bandwidth = (full["weights_GB"] + full["kv_GB"]) / full["floor_ms"]
    assert snap["floor_ms"] == pytest.approx((snap["weights_GB"] + snap["kv_GB"]) / bandwidth, rel=1e-9)
    for r in results:
        assert r["step_ms"] > 0 and r["x_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["device_busy_ms"] > 0 and r["top_host_ops"]
    assert by_name["h2o"]["host_syncs"] > full["host_syncs"]
    assert "x floor" in capsys.readouterr().out


def test_decode_step_weight_bytes_count_an_untied_embedding_by_rows() -> None:
    import torch

    from vllm_kvpress_ext.bench.decode_step import weight_bytes_read

    class Untied(torch.nn.Module):
        def __init__(self, lm_head: bool) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)
            self.lm_head = torch.nn.Linear(8, 100, bias=False) if lm_head else None

    # 4 rows of the table, the projection, the logits matrix; tied: the whole table, read for the logits.
    assert weight_bytes_read(Untied(lm_head=True), batch=4) == 4 * (4 * 8 + 64 + 800)
    assert weight_bytes_read(Untied(lm_head=False), batch=4) == 4 * (800 + 64)


def test_bench_policies_profiles_each_compression(capsys: pytest.CaptureFixture[str]) -> None:
    """`--profile` runs one more request per compressing policy with its compression under the profiler:
    KVzip's reconstruction pass (a prefill's worth of work) shows far more device time than SnapKV's scoring."""
    argv = ["bench", "policies", "--prompt-lens", "256", "--policies", "snapkv,kvzip", "--decode-steps", "1"]
    assert main([*argv, "--profile"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("compression profile") :].splitlines()
    busy = {line.split()[0]: float(line.split()[1]) for line in table[3:] if line.strip()}
    assert set(busy) == {"snapkv", "kvzip"}
    # Profiled times on a shared 2-core machine: a margin, not a ratio (3x and more alone, 2.9x under the suite).
    assert busy["kvzip"] > 1.5 * busy["snapkv"] > 0
