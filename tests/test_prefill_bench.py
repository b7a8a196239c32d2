"""`kvpress bench prefill`: every mode runs on the bundled model and bad settings are refused."""

from __future__ import annotations

import os

import pytest

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.attention.ops import PREFILL_ORACLE_ENV
from vllm_kvpress_ext.bench.prefill_bench import MODES, PrefillBenchConfig, run_prefill_bench


def test_every_mode_times_every_length_and_leaves_the_switch_as_it_was(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(PREFILL_ORACLE_ENV, raising=False)
    rows = run_prefill_bench(PrefillBenchConfig(model=str(default_model_dir()), prompt_lens=(40, 70), chunk=16))
    assert [r["prompt_tokens"] for r in rows] == [40, 70]
    for row in rows:
        for mode in MODES:
            assert row[mode]["seconds"] > 0
            assert row[mode]["tokens_per_s"] == pytest.approx(row["prompt_tokens"] / row[mode]["seconds"])
    assert "fused / oracle" in capsys.readouterr().out
    assert PREFILL_ORACLE_ENV not in os.environ


@pytest.mark.parametrize(
    "settings",
    [{"prompt_lens": ()}, {"prompt_lens": (0,)}, {"chunk": 0}, {"repeats": 0}, {"modes": ("sideways",)}],
)
def test_bad_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PrefillBenchConfig(**settings)  # type: ignore[arg-type]


def test_a_prompt_past_the_model_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than"):
        run_prefill_bench(PrefillBenchConfig(model=str(default_model_dir()), prompt_lens=(10**6,)))
