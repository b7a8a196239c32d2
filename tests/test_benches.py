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
    argv = ["bench", "policies", "--prompt-lens", "40", "--policies", "h2o", "--decode-steps", "1", "--repeats", "2"]
    assert main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("40 ")]
    assert [r[1] for r in rows] == ["full", "h2o"]
    assert prompt_lengths == [4, 4, 40, 40, 40, 40]  # a warm-up per policy, then each request twice
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
    from model_utils import write_suite_model

    from vllm_kvpress_ext.bench.linear_bench import LinearBenchConfig, run_linear_bench

    model = write_suite_model(tmp_path / "model")
    results = run_linear_bench(LinearBenchConfig(model=str(model), rows=(1, 3), repeats=1))
    out = capsys.readouterr().out
    assert "14 projections" in out and "F.linear / oneDNN" in out  # 2 layers x 7 projections
    assert [r["rows"] for r in results] == [1, 3]
    assert all(r["f_linear_ms"] > 0 and r["onednn_ms"] > 0 for r in results)
    with pytest.raises(ValueError, match="row counts"):
        LinearBenchConfig(model=str(model), rows=(0,))
