"""`kvpress bench recall`: the instrument that scores kept sets against the full cache's future decode attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_utils import tiny_model, write_gguf

from vllm_kvpress_ext.bench.attention_recall import FutureAttention, RecordingContext, future_attention, score_kept
from vllm_kvpress_ext.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("llama")
    model.config.max_position_embeddings = 1024
    return write_gguf(tmp_path_factory.mktemp("recall") / "tiny.gguf", model)


def test_score_kept_by_hand() -> None:
    """One layer, one head, one step: attention [.5, .25, .25] over values 1, 2, 4 (d = 1)."""
    future = FutureAttention([torch.tensor([[[0.5, 0.25, 0.25]]])], [torch.tensor([[[1.0], [2.0], [4.0]]])])
    everything = torch.ones(1, 1, 3, dtype=torch.bool)
    assert score_kept(future, everything) == ([1.0], [0.0])
    # Keep entries 0 and 2: recall .75; o = .5 + .5 + 1 = 2, o_K = (.5 * 1 + .25 * 4) / .75 = 2, error 0.
    recall, error = score_kept(future, torch.tensor([[[True, False, True]]]))
    assert recall == [pytest.approx(0.75)] and error == [pytest.approx(0.0, abs=1e-7)]
    # Keep entry 0 alone: recall .5; o_K = 1, error |2 - 1| / 2 = .5.
    recall, error = score_kept(future, torch.tensor([[[True, False, False]]]))
    assert recall == [pytest.approx(0.5)] and error == [pytest.approx(0.5)]


def test_recorded_forward_is_the_engines_full_cache_answer(tiny_gguf: Path) -> None:
    """The dense recording forward gives the logits the engine's greedy full-cache answer came from."""
    llm = LLM(tiny_gguf, dtype=torch.float32, num_pages=512)
    engine = llm.engine
    prompt = torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    answer = list(out.output_token_ids)
    tokens = torch.tensor(prompt + answer)
    with torch.no_grad():
        hidden = engine.model(tokens, torch.arange(len(tokens)), RecordingContext())
    greedy = engine.model.compute_logits(hidden).argmax(-1)
    assert greedy[len(prompt) - 1 : -1].tolist() == answer
    future = future_attention(engine.model, prompt, answer)
    assert len(future.attention) == engine.config.num_hidden_layers
    for attention in future.attention:
        assert attention.shape == (engine.config.num_attention_heads, len(answer), len(prompt))
        assert torch.allclose(attention.sum(-1), torch.ones(attention.shape[:2]))


def test_recall_bench_end_to_end(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kvpress_ext.cli import main

    monkeypatch.setenv("KVPRESS_MODEL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    # This random model attends diffusely: at p_nuc 0.95 GVote keeps everything, at 0.3 it compresses.
    gvote = tmp_path / "gvote.yaml"
    gvote.write_text("name: gvote\np_nuc: 0.3\n")
    argv = ["bench", "recall", "--model", str(tiny_gguf), "--tasks", "nl_passkey", "--context-lens", "300"]
    argv += ["--policies", f"full,snapkv,{gvote}", "--budgets", "0.25", "--match", "adakv", "--samples", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    runs = json.loads((out / "runs.json").read_text())
    by = {(r["policy"], r["budget"], r["seed"]): r for r in runs}
    assert {(p, b) for p, b, _ in by} == {("full", "-"), ("snapkv", "0.25"), ("gvote", "-"), ("adakv", "=gvote")}
    for (policy, budget, seed), r in by.items():
        assert 0.0 <= r["recall"] <= 1.0 + 1e-6 and r["error"] >= 0.0
        if policy == "full":
            assert (
                r["retention"] == 1.0
                and r["recall"] == pytest.approx(1.0)
                and r["error"] == pytest.approx(0.0, abs=1e-6)
            )
        if budget == "=gvote":  # AdaKV at GVote's own retention on the same sample (to a whole entry per head)
            assert r["retention"] == pytest.approx(by[("gvote", "-", seed)]["retention"], abs=0.02)
            assert r["retention"] < 1.0
    assert "output error" in (out / "results.md").read_text()
    assert main([*argv[:-2], "--match", "gvote", "--samples", "1", "--out", str(tmp_path / "bad")]) == 2
