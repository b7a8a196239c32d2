"""The accuracy bench runs the suite through real compression, and the protocols mean what they say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.bench.accuracy import prompt_coverage
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.kept import kept_entries
from vllm_kvpress_ext.tasks.synthetic import build_prompt, generate


@pytest.fixture(scope="module")
def suite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("suite-model"), hidden=64, seed=5, std=0.2, max_positions=2048)


def _first_tokens(engine: LLMEngine, protocol: str, policy: str | dict[str, Any]) -> list[int]:
    firsts = []
    for seed in range(6):
        spec = build_prompt(generate("niah_multikey", seed, context_length=200), engine.tokenizer, protocol)  # type: ignore[arg-type]
        after = spec.compress_after if spec.compress_after < len(spec.token_ids) else None
        rid = engine.add_request(
            spec.token_ids, SamplingParams(max_tokens=1, temperature=0), policy=policy, compress_after=after
        )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    firsts.append(out.output_token_ids[0])
    return firsts


def test_strict_and_agnostic_decode_from_the_compressed_cache(suite_model: Path) -> None:
    engine = LLMEngine(suite_model, dtype=torch.float32, num_pages=2048, page_size=4)
    window_only = {"name": "streaming_llm", "ratio": 0.05, "sink_tokens": 0}
    # Served: the first answer token comes from the uncompressed prefill, whatever the policy drops.
    assert _first_tokens(engine, "served", window_only) == _first_tokens(engine, "served", "full")
    # Strict and agnostic: the answer is decoded from what the policy kept, so dropping the context shows.
    for protocol in ("strict", "agnostic"):
        assert _first_tokens(engine, protocol, window_only) != _first_tokens(engine, protocol, "full")
    assert engine.cache.pool.num_used == 0


def test_bench_accuracy_quick_writes_table_and_plot(
    suite_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "accuracy", "--model", str(suite_model), "--quick", "--budgets", "0.1", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "protocol: strict" in out
    assert "coverage" in out and "head cov" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert {r["policy"] for r in rows} == {"full", "streaming_llm", "snapkv"}
    full = [r for r in rows if r["policy"] == "full"]
    compressed = [r for r in rows if r["policy"] != "full"]
    assert all(r["retention"] == 1.0 for r in full)
    assert all(r["kv_bytes_mean"] < min(f["kv_bytes_mean"] for f in full) for r in compressed)
    # Coverage: in [0, 1], whole for `full`; StreamingLLM keeps the same few positions in every head,
    # so at a small ratio it covers less of the prompt, and no more than SnapKV at the same budget.
    assert "coverage" in (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    for r in rows:
        assert 0.0 <= r["head_coverage"] <= r["coverage"] <= 1.0, r
    assert all(r["coverage"] == r["head_coverage"] == 1.0 for r in full)
    for task in {r["task"] for r in rows}:
        cell = {r["policy"]: r for r in rows if r["task"] == task}
        assert cell["streaming_llm"]["coverage"] < cell["full"]["coverage"]
        assert cell["streaming_llm"]["coverage"] <= cell["snapkv"]["coverage"]
    for name in ("results.md", "results.csv", "accuracy_vs_memory.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "accuracy_vs_memory.png").read_bytes()[:4] == b"\x89PNG"


def test_prompt_coverage_reads_the_positions_the_cache_holds() -> None:
    cache = PagedKVCache(2, 2, 4, num_pages=64, page_size=4, max_requests=2, dtype=torch.float32)
    row = cache.add_request("a")
    n = 10
    slots = cache.append_slots([row], torch.arange(n).view(1, -1))
    cache.write(slots, torch.zeros(*slots.shape, 4), torch.zeros(*slots.shape, 4))
    assert prompt_coverage(kept_entries(cache, "a"), n) == (1.0, 1.0)
    keep = torch.zeros(2, 2, n, dtype=torch.bool)
    keep[0, 0, [0, 1]] = keep[0, 1, [1, 2]] = keep[1, 0, [5]] = keep[1, 1, [5]] = True
    cache.apply_keep_plan("a", KeepPlan.from_mask(keep))
    # Union over everything: {0, 1, 2, 5}; per layer: {0, 1, 2} and {5}.
    assert prompt_coverage(kept_entries(cache, "a"), n) == pytest.approx((4 / n, (3 / n + 1 / n) / 2))
    # Entries past the prompt (generated tokens) never count; a shorter "prompt" ignores the rest.
    assert prompt_coverage(kept_entries(cache, "a"), 3) == pytest.approx((1.0, (1.0 + 0.0) / 2))
    # A local ring's entries count too: the last W tokens in every head, plus the admitted older ones.
    row_b = cache.add_request("b")
    slots = cache.append_slots([row_b], torch.arange(n).view(1, -1))
    cache.write(slots, torch.zeros(*slots.shape, 4), torch.zeros(*slots.shape, 4))
    admitted = torch.zeros(2, 2, n, dtype=torch.bool)
    admitted[1, 0, 2] = True
    cache.start_ring("b", 4, admitted)
    assert prompt_coverage(kept_entries(cache, "b"), n) == pytest.approx((5 / n, (4 / n + 5 / n) / 2))


def test_bench_accuracy_rejects_a_directory_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "accuracy", "--model", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_bench_accuracy_takes_presets_such_as_wgkv_gates(
    suite_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_kvpress_ext.models import load_config
    from vllm_kvpress_ext.models.write_gate import WriteGates

    config = load_config(suite_model)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    with torch.no_grad():
        gates.w2.zero_()
        gates.b2.fill_(100.0)  # admit everything: exactly full attention
    gate_file = gates.save(tmp_path / "ones.wgkv.safetensors", {"local_window": 16})
    preset = tmp_path / "wgkv-all.yaml"
    preset.write_text(f"name: wgkv\ngates: {gate_file}\n")
    argv = ["bench", "accuracy", "--model", str(suite_model), "--policies", f"full,{preset}"]
    argv += ["--tasks", "niah_multikey", "--samples", "3", "--context-len", "200", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    by_policy = {r["policy"]: r for r in rows}
    assert set(by_policy) == {"full", "wgkv-all"}
    assert by_policy["wgkv-all"]["accuracy"] == by_policy["full"]["accuracy"]
    assert by_policy["wgkv-all"]["coverage"] == 1.0
