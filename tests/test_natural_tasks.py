"""Natural-language tasks rendered with a real tokenizer, and the natural accuracy bench end to end.

The tokenizer is the byte-level BPE of the GGUF file the tests write, on every machine: the data of a
test never depends on which models a machine happens to have pulled. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from gguf_utils import tiny_model, write_gguf

from vllm_kvpress_ext.models import load_tokenizer
from vllm_kvpress_ext.tasks.natural import (
    NATURAL_TASKS,
    NOISE,
    filler_sentences,
    prose_sentences,
    render,
    render_questions,
    score,
)
from vllm_kvpress_ext.tasks.natural.tasks import common_word_vocabulary


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama GGUF with a byte-level tokenizer and a 4K context."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = 4096
    return write_gguf(tmp_path_factory.mktemp("nl") / "tiny.gguf", model)


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf: Path) -> Any:
    return load_tokenizer(tiny_gguf)


@pytest.mark.parametrize("task", list(NATURAL_TASKS))
def test_render_fits_the_length_and_holds_the_answers(tokenizer: Any, task: str) -> None:
    length = 2500  # a byte-level tokenizer: the word list's 120 counted items alone take about 1,600
    prompt = render(task, tokenizer, length, seed=7, protocol="agnostic")
    assert length - 80 <= len(prompt.token_ids) <= length  # the largest haystack that fits
    assert prompt.compress_after == prompt.context_tokens < len(prompt.token_ids)
    context = tokenizer.decode(prompt.token_ids[: prompt.context_tokens])
    question = tokenizer.decode(prompt.token_ids[prompt.context_tokens :])
    for answer in prompt.answers:
        if task in ("nl_common_words", "nl_frequent_words"):
            assert context.count(f" {answer}") >= 3, answer  # the counted words occur repeatedly
        elif task == "nl_variable_tracking":
            assert f"VAR {answer} =" in context
        else:
            assert answer in context and answer not in question
    served = render(task, tokenizer, length, seed=7, protocol="served")
    assert served.token_ids == prompt.token_ids and served.compress_after is None
    assert render(task, tokenizer, length, seed=8).token_ids != prompt.token_ids


def test_several_questions_share_one_context(tokenizer: Any) -> None:
    """One multi-key context asked about each of its keys: the same context tokens, a different answer each."""
    length = 1500
    prompts = render_questions("nl_niah_multikey", tokenizer, length, seed=7, count=4)
    contexts = {tuple(p.token_ids[: p.context_tokens]) for p in prompts}
    assert len(contexts) == 1 and all(p.compress_after == p.context_tokens for p in prompts)
    assert [p.question for p in prompts] == [0, 1, 2, 3]
    assert len({p.answers for p in prompts}) == 4 and all(len(p.token_ids) <= length for p in prompts)
    context = tokenizer.decode(prompts[0].token_ids[: prompts[0].context_tokens])
    assert all(answer in context for p in prompts for answer in p.answers)
    assert render_questions("nl_niah_multikey", tokenizer, length, seed=7, count=1)[0].token_ids == (
        render("nl_niah_multikey", tokenizer, length, seed=7).token_ids
    )
    with pytest.raises(ValueError, match="1 to 4 questions"):
        render_questions("nl_niah_multikey", tokenizer, length, seed=7, count=5)
    with pytest.raises(ValueError, match="1 to 1 questions"):
        render_questions("nl_passkey", tokenizer, length, seed=7, count=2)


def test_filler_kinds() -> None:
    assert filler_sentences("noise", 7, random.Random(0)) == [*NOISE, *NOISE[:2]]
    prose = prose_sentences()
    assert len(prose) > 300 and all(s.endswith(".") and "\n" not in s for s in prose)
    first, second = (filler_sentences("prose", 5, random.Random(s)) for s in (1, 2))
    assert first != second and all(s in prose for s in first)
    with pytest.raises(ValueError, match="filler must be one of"):
        filler_sentences("lorem", 3, random.Random(0))  # type: ignore[arg-type]


def test_the_word_list_ships_with_the_package() -> None:
    """The word-counting task reads its vocabulary from the package, not from the Python it runs on."""
    words = common_word_vocabulary()
    assert len(words) == len(set(words)) == 1207 and list(words) == sorted(words)
    assert all(len(w) >= 4 and w.isalpha() and w.islower() for w in words)
    draft = NATURAL_TASKS["nl_common_words"](random.Random("nl_common_words-7"), 40, "noise")
    assert draft.answers[:4] == ("counter", "unnecessary", "adaptability", "enclosed")  # the same draw everywhere


def test_a_bounded_haystack_says_it_is_full(tokenizer: Any) -> None:
    """The word list holds 1,197 uncounted words: asked for more tokens than they make, the renderer says
    so instead of doubling the size forever."""
    with pytest.raises(ValueError, match="largest haystack makes"):
        render("nl_common_words", tokenizer, 100_000, seed=1)


def test_prose_filler_and_errors(tokenizer: Any) -> None:
    prompt = render("nl_passkey", tokenizer, 800, seed=1, filler="prose")
    assert any(s in tokenizer.decode(prompt.token_ids) for s in prose_sentences())
    with pytest.raises(ValueError, match="too short"):
        render("nl_niah_multiquery", tokenizer, 20, seed=1)
    with pytest.raises(ValueError, match="unknown natural task"):
        render("nl_nope", tokenizer, 800, seed=1)
    with pytest.raises(ValueError, match="protocol must be one of"):
        render("nl_passkey", tokenizer, 800, seed=1, protocol="strict")  # type: ignore[arg-type]


def test_score_is_the_share_of_answers_found(tokenizer: Any) -> None:
    prompt = render("nl_niah_multivalue", tokenizer, 800, seed=3)
    a, b, c, d = prompt.answers
    assert score(prompt, f"{a}, {b} and {c.upper()}") == 0.75
    assert score(prompt, f"{a} {b} {c} {d}") == 1.0 and score(prompt, "no idea") == 0.0


@pytest.mark.slow
def test_natural_bench_end_to_end(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kvpress_ext.cli import main

    monkeypatch.setenv("KVPRESS_MODEL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["bench", "accuracy", "--model", str(tiny_gguf), "--tasks", "nl_passkey"]
    argv += ["--policies", "full,snapkv,wgkv", "--budgets", "0.5,0.25", "--context-lens", "400"]
    argv += ["--samples", "2", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    summary = {(s["policy"], s["budget"]): s for s in result["summary"]}
    assert set(summary) == {("full", None), ("snapkv", 0.5), ("snapkv", 0.25), ("wgkv", None)}
    assert "no write gates" in summary[("wgkv", None)]["note"]
    full = summary[("full", None)]["kv_bytes_mean"]
    assert summary[("snapkv", 0.25)]["kv_bytes_mean"] < summary[("snapkv", 0.5)]["kv_bytes_mean"] < full
    assert (out / "accuracy_vs_memory.png").stat().st_size > 0
    for s in result["summary"]:
        if s["runs"]:
            low, high = s["accuracy_interval"]
            assert 0.0 <= low <= s["accuracy"] <= high <= 1.0
    assert "95% interval" in (out / "results.md").read_text()
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 2 * 3  # samples x runnable (policy, budget)
    assert all(r["task"] == "nl_passkey" and 0.0 <= r["score"] <= 1.0 for r in runs)
    assert main([*argv[:-1], str(tmp_path / "bad"), "--protocol", "strict"]) == 2


def test_natural_bench_several_questions_per_context(tiny_gguf: Path, tmp_path: Path) -> None:
    """Question-agnostic, every question of a context forks its one prefill: a run per (policy, question)."""
    from vllm_kvpress_ext.cli import main

    out = tmp_path / "out"
    argv = ["bench", "accuracy", "--model", str(tiny_gguf), "--tasks", "nl_niah_multikey,nl_passkey"]
    argv += ["--policies", "full,snapkv", "--budgets", "0.5", "--context-lens", "900", "--samples", "1"]
    argv += ["--questions-per-context", "3", "--protocol", "agnostic", "--out", str(out)]
    assert main(argv) == 0
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    asked = sorted((r["task"], r["policy"], r["question"]) for r in runs)
    multikey = [("nl_niah_multikey", p, q) for p in ("full", "snapkv") for q in range(3)]
    assert asked == [*multikey, ("nl_passkey", "full", 0), ("nl_passkey", "snapkv", 0)]  # pass key: one question
    summary = {s["policy"]: s for s in json.loads((out / "results.json").read_text())["summary"]}
    assert summary["snapkv"]["runs"] == 4
    bad = ["bench", "accuracy", "--model", str(tiny_gguf), "--questions-per-context", "0", "--out", str(tmp_path / "b")]
    assert main(bad) == 2


def _fake_run(directory: Path, length: int, task: str, scores: list[float], protocol: str = "served") -> Path:
    """What one `bench accuracy` run leaves on disk, for two policies (full, snapkv 0.5) and wgkv not run."""
    directory.mkdir(parents=True)
    runs = []
    for seed, value in enumerate(scores):
        runs.append(
            {
                "context_len": length,
                "task": task,
                "policy": "full",
                "budget": None,
                "seed": seed,
                "score": 1.0,
                "kv_bytes": 4096,
                "retention": 1.0,
                "text": "x",
            }
        )
        runs.append(
            {
                "context_len": length,
                "task": task,
                "policy": "snapkv",
                "budget": 0.5,
                "seed": seed,
                "score": value,
                "kv_bytes": 2048,
                "retention": 0.5,
                "text": "y",
            }
        )
    note = "not run: wgkv: no write gates for this model"
    rows = [
        {
            "context_len": length,
            "task": task,
            "policy": p,
            "budget": b,
            "samples": len(scores),
            "accuracy": 0.0,
            "kv_bytes_mean": 0.0,
            "retention": 0.0,
            "note": "",
        }
        for p, b in (("full", None), ("snapkv", 0.5))
    ]
    rows.append(
        {
            "context_len": length,
            "task": task,
            "policy": "wgkv",
            "budget": None,
            "samples": 0,
            "accuracy": None,
            "kv_bytes_mean": None,
            "retention": None,
            "note": note,
        }
    )
    config = {
        "model": "m.gguf",
        "tasks": [task],
        "context_lens": [length],
        "samples": len(scores),
        "protocol": protocol,
        "filler": "noise",
    }
    payload = {"config": config, "seconds": 10.0, "prefill_seconds": 2.0, "rows": rows}
    (directory / "results.json").write_text(json.dumps(payload))
    (directory / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    return directory


def test_merged_runs_make_one_report(tmp_path: Path) -> None:
    from vllm_kvpress_ext.bench.natural_accuracy import merge_results

    dirs = [
        _fake_run(tmp_path / "a", 2048, "nl_passkey", [1.0, 0.0, 1.0, 1.0]),
        _fake_run(tmp_path / "b", 2048, "nl_niah_single", [0.0, 0.0]),
        _fake_run(tmp_path / "c", 4096, "nl_passkey", [0.0, 1.0, 0.0, 0.0]),
    ]
    rows = merge_results(dirs, tmp_path / "out")
    cells = {(r.context_len, r.task, r.policy, r.budget): r for r in rows}
    assert cells[(2048, "nl_passkey", "snapkv", 0.5)].accuracy == 0.75
    assert cells[(2048, "nl_passkey", "snapkv", 0.5)].samples == 4
    assert cells[(2048, "nl_niah_single", "snapkv", 0.5)].samples == 2
    assert cells[(4096, "nl_passkey", "snapkv", 0.5)].accuracy == 0.25
    assert (4096, "nl_niah_single", "snapkv", 0.5) not in cells  # never run at 4K: no row, "-" in its column
    assert cells[(2048, "nl_passkey", "wgkv", None)].note.startswith("not run")
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    summary = {(s["context_len"], s["policy"], s["budget"]): s for s in result["summary"]}
    assert summary[(2048, "snapkv", 0.5)]["accuracy"] == pytest.approx((0.75 + 0.0) / 2)
    assert summary[(2048, "snapkv", 0.5)]["runs"] == 6
    assert summary[(4096, "snapkv", 0.5)]["runs"] == 4
    assert (tmp_path / "out" / "accuracy_vs_memory.png").stat().st_size > 0
    assert "| 2048 | snapkv | 0.5 | 6 | 37.5 |" in (tmp_path / "out" / "results.md").read_text()


def test_merge_refuses_what_it_cannot_combine(tmp_path: Path) -> None:
    from vllm_kvpress_ext.bench.natural_accuracy import merge_results

    served = _fake_run(tmp_path / "served", 2048, "nl_passkey", [1.0])
    agnostic = _fake_run(tmp_path / "agnostic", 2048, "nl_passkey", [0.0], protocol="agnostic")
    with pytest.raises(ValueError, match="different protocols"):
        merge_results([served, agnostic], tmp_path / "out")
    with pytest.raises(ValueError, match="no finished"):
        merge_results([tmp_path / "absent"], tmp_path / "out")
    with pytest.raises(ValueError, match="no result directories"):
        merge_results([], tmp_path / "out")


def test_task_weighted_mean_counts_each_task_once() -> None:
    """Hand-computed: 2 pass-key runs (both right) and 4 multi-key questions (one right)."""
    from vllm_kvpress_ext.bench.natural_accuracy import Run, task_weighted_mean

    def run(task: str, score: float) -> Run:
        return Run(2048, task, "snapkv", 0.5, 0, score, 1, 0.5, "")

    runs = [run("nl_passkey", 1.0), run("nl_passkey", 1.0)] + [run("nl_niah_multikey", s) for s in (1, 0, 0, 0)]
    mean, effective = task_weighted_mean(runs)
    assert mean == (1.0 + 0.25) / 2  # the mean of the task columns, not 3 of 6 runs
    assert abs(effective - 2**2 / (2 * 0.5**2 + 4 * 0.25**2)) < 1e-12  # (sum w)^2 / sum w^2 = 4 / 0.75
    same = [run("nl_passkey", 1.0), run("nl_passkey", 0.0), run("nl_niah_single", 1.0), run("nl_niah_single", 1.0)]
    assert task_weighted_mean(same) == (0.75, 4.0)  # equal runs per task: the plain mean over runs
    assert math.isnan(task_weighted_mean([])[0])


def test_wilson_interval_by_hand() -> None:
    from vllm_kvpress_ext.bench.natural_accuracy import wilson_interval

    # 8 of 8 right: the interval is [0.676, 1] (z = 1.96), not the point 1.
    low, high = wilson_interval(1.0, 8)
    assert low == pytest.approx(0.6756, abs=1e-4) and high == 1.0
    low, high = wilson_interval(0.0, 8)
    assert low == 0.0 and high == pytest.approx(0.3244, abs=1e-4)
    low, high = wilson_interval(0.5, 100)
    assert (low, high) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
    assert all(x != x for x in wilson_interval(0.5, 0))  # no runs: nan
