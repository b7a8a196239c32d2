"""`kvpress bench gated-prefill`: its rows take the paths they name; bad inputs are refused (no timing asserted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_kvpress_ext.attention import ops
from vllm_kvpress_ext.bench.gated_prefill import ROWS, GatedPrefillConfig, run_gated_prefill_bench
from vllm_kvpress_ext.bench.models import bench_model_dir, write_untrained_gates
from vllm_kvpress_ext.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = bench_model_dir(tmp_path_factory.mktemp("gated-prefill-model"))
    write_untrained_gates(out)  # gate values near 0.95 everywhere: tau 0.99 admits almost nothing
    return out


def test_only_the_gated_row_runs_the_vertical_slash_attention(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[int] = []
    original = ops.vertical_slash_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    # A gated chunk reaches it through `gated_chunk_attention`, in the same module.
    monkeypatch.setattr(ops, "vertical_slash_attention", counted)
    config = GatedPrefillConfig(model=str(model_dir), context_lens=(256,), repeats=1, max_batched_tokens=128, tau=0.99)
    result = run_gated_prefill_bench(config)
    rows = {r["row"]: r for r in result["prefill"]}
    assert list(rows) == list(ROWS)
    # Warm-up and one timed run of the gated row, 4 layers, 2 chunks of 128 (both past the 64-token window).
    assert calls == [128] * (2 * 4 * 2)
    assert rows["full"]["kv_share"] == 1.0 and rows["wgkv, gates open"]["kv_share"] == 1.0
    assert rows["wgkv"]["kv_share"] < 0.6  # nearly everything outside the window and the last chunk dropped
    assert rows["full"]["wall_ratio"] == rows["full"]["cpu_ratio"] == 1.0
    assert all(r["wall_s"] > 0 and r["cpu_ratio"] > 0 for r in rows.values())
    (attention,) = result["attention"]
    assert attention["context_len"] == 256 and attention["ratio"] > 0
    out = capsys.readouterr().out
    assert "wgkv, gates open" in out and "vertical-slash / causal" in out


def test_the_command_line_runs_it(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "gated-prefill", "--model", str(model_dir), "--context-lens", "96", "--repeats", "1"]
    assert main(argv) == 0
    assert "CPU / full" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"context_lens": ()}, "context_lens"),
        ({"context_lens": (1,)}, "context_lens"),
        ({"repeats": 0}, "repeats"),
        ({"max_batched_tokens": 0}, "max_batched_tokens"),
        ({"tau": 1.5}, "tau"),
        ({"op_admitted": -0.1}, "op_admitted"),
        ({"op_window": 0}, "op_window"),
        ({"context_lens": (20000,)}, "exceeds"),
    ],
)
def test_bad_inputs_are_refused(model_dir: Path, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_gated_prefill_bench(GatedPrefillConfig(model=str(model_dir), **overrides))


def test_the_command_line_reports_a_bad_input(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gated-prefill", "--model", str(model_dir), "--repeats", "0"]) == 2
    assert "repeats" in capsys.readouterr().err
