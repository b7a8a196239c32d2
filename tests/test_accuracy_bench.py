"""The accuracy bench runs the suite through real compression, and the protocols mean what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.bench.tasks import build_prompt, generate
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def suite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("suite-model"), hidden=64, seed=5, std=0.2, max_positions=2048)


def _first_tokens(engine: LLMEngine, protocol: str, policy: object) -> list[int]:
    firsts = []
    for seed in range(6):
        spec = build_prompt(generate("niah_multikey", seed, context_length=200), engine.tokenizer, protocol)  # type: ignore[arg-type]
        after = spec.compress_after if spec.compress_after < len(spec.token_ids) else None
        rid = engine.add_request(
            spec.token_ids, SamplingParams(max_tokens=1, temperature=0), policy=policy, compress_after=after
        )  # type: ignore[arg-type]
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
    assert main(["bench", "accuracy", "--model", str(suite_model), "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "protocol: strict" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert {r["policy"] for r in rows} == {"full", "streaming_llm", "snapkv"}
    full = [r for r in rows if r["policy"] == "full"]
    compressed = [r for r in rows if r["policy"] != "full"]
    assert all(r["retention"] == 1.0 for r in full)
    assert all(r["kv_bytes_mean"] < min(f["kv_bytes_mean"] for f in full) for r in compressed)
    for name in ("results.md", "results.csv", "accuracy_vs_memory.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "accuracy_vs_memory.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_accuracy_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "accuracy"]) == 2
    assert "--model is required" in capsys.readouterr().err
