"""`kvpress profile xkv`: sampled suite prompts in, a per-layer XKV profile out, usable by the policy.

The profile is checked against an independent measurement (each prompt run through the engine with
XKV's R_avg mode, the kept entries read back from the pool's per-head figures), the policy applying
it is checked against the allocation computed from the saved fractions, and bad arguments must fail
with a message and exit code 2 before any model is loaded.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from model_utils import write_suite_model

from vllm_kvpress_ext import cli
from vllm_kvpress_ext.bench import models as bench_models
from vllm_kvpress_ext.bench.accuracy import HELD_OUT_SEED
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.policies import XKVPolicy, load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.capture import LayerCapture
from vllm_kvpress_ext.policies.xkv import XKVProfile, allocation_from_fractions
from vllm_kvpress_ext.tasks.synthetic import build_prompt, generate
from vllm_kvpress_ext.tasks.tokenizer import load_tokenizer

TASKS = ("niah_multikey", "variable_tracking")
SAMPLES, CONTEXT, TARGET, WINDOW = 2, 128, 0.9, 8


@pytest.fixture(scope="module")
def suite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("profile-model"), hidden=32, seed=1, std=0.3, max_positions=512)


@pytest.fixture(scope="module")
def profile_run(suite_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One CLI run shared by the tests that read its output (profiling is the slow part)."""
    out = tmp_path_factory.mktemp("profile") / "sub" / "xkv.yaml"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(
            [
                *("profile", "xkv", "--model", str(suite_model), "--samples", str(SAMPLES)),
                *("--tasks", ",".join(TASKS), "--context-len", str(CONTEXT), "--budget", str(TARGET)),
                *("--out", str(out)),
            ]
        )
    assert rc == 0
    return out, buffer.getvalue()


def suite_prompts(model: Path) -> list[list[int]]:
    """The prompts the command profiles: training seeds 0..SAMPLES-1, cut where the strict protocol compresses."""
    tokenizer = load_tokenizer(model)
    prompts = []
    for task in TASKS:
        for seed in range(SAMPLES):
            spec = build_prompt(generate(task, seed, context_length=CONTEXT), tokenizer, "strict")
            prompts.append(spec.token_ids[: spec.compress_after])
    return prompts


def kept_per_head(engine: LLMEngine, prompt: list[int], policy: Any) -> list[list[int]]:
    """Entries each (layer, KV head) holds right after compression (one token sampled, none appended)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), policy=policy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.kv.kept_per_head
    raise AssertionError("request did not finish")


def test_profile_xkv_writes_the_mean_allocation(suite_model: Path, profile_run: tuple[Path, str]) -> None:
    path, stdout = profile_run
    profile = XKVProfile.load(path)
    raw = yaml.safe_load(path.read_text())
    assert raw["policy"] == "xkv" and raw["num_layers"] == 2 == profile.num_layers
    # Positive fractions of the ranked prefix; their mean is the recorded mean share (the documented sum).
    assert all(0.0 < f <= 1.0 for f in profile.fractions), profile.fractions
    meta = profile.metadata
    assert sum(profile.fractions) / profile.num_layers == pytest.approx(meta["mean_fraction"])
    assert meta["requests"] == len(TASKS) * SAMPLES and meta["tasks"] == list(TASKS)
    assert meta["target_ratio"] == TARGET and meta["context_len"] == CONTEXT and meta["protocol"] == "strict"
    assert meta["seeds"] == [0, SAMPLES - 1] and meta["seeds"][1] < HELD_OUT_SEED  # training seeds only
    # Independent measurement: each prompt with XKV's R_avg mode, m_l read back from the pool.
    engine = LLMEngine(suite_model, dtype=torch.float32, num_pages=4096, page_size=4)
    shares = []
    for prompt in suite_prompts(suite_model):
        ranked = len(prompt) - WINDOW
        kept = kept_per_head(engine, prompt, {"name": "xkv", "target_ratio": TARGET})
        assert all(len(set(heads)) == 1 for heads in kept)  # XKV: one size per layer
        shares.append([(heads[0] - WINDOW) / ranked for heads in kept])
    expected = [sum(col) / len(shares) for col in zip(*shares, strict=True)]
    assert profile.fractions == pytest.approx(expected, abs=1e-12)
    # The printed table: one row per layer with its fraction, and where the file went.
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["layer", "fraction", "kept"]
    for layer, fraction in enumerate(profile.fractions):
        assert any(line.split()[:2] == [str(layer), f"{fraction:.4f}"] for line in lines)
    assert f"wrote {path}" in stdout


def synthetic_layers(n: int, num_layers: int = 2) -> list[LayerPrefill]:
    layers = []
    for layer in range(num_layers):
        g = torch.Generator().manual_seed(40 + layer)
        keys = torch.randn(2, n, 8, generator=g) * 1.5
        queries = torch.randn(WINDOW, 4, 8, generator=g) * 1.5
        capture = LayerCapture(queries=queries, query_positions=torch.arange(n - WINDOW, n))
        layers.append(
            LayerPrefill(layer, num_layers, keys, torch.randn_like(keys), torch.arange(n), capture, None, 8**-0.5)  # type: ignore[arg-type]
        )
    return layers


def plan_sizes(policy: Any, layers: list[LayerPrefill]) -> tuple[list[int], list[list[int]]]:
    state: dict[str, Any] = {}
    results = [policy.on_layer_prefilled(layer, state) for layer in layers]
    plan = policy.plan(RequestPrefill("r", len(layers), 2, 4, layers[0].length), results, state)
    return state["allocation"], plan.lengths.tolist()


def test_the_policy_applies_the_saved_profile(suite_model: Path, profile_run: tuple[Path, str], tmp_path: Path) -> None:
    path, _ = profile_run
    fractions = XKVProfile.load(path).fractions
    preset = tmp_path / "xkv-profiled.yaml"
    preset.write_text(yaml.safe_dump({"name": "xkv", "profile": str(path)}))
    from_preset = load_policy(str(preset))
    assert from_preset == load_policy({"name": "xkv", "profile": str(path)}) == XKVPolicy(profile=str(path))
    # Synthetic prefill: no budget -> m_l = round(f_l P); a tokens budget -> the total shared by f_l.
    n = 60
    layers = synthetic_layers(n)
    allocation, lengths = plan_sizes(from_preset, layers)
    assert allocation == allocation_from_fractions(fractions, n - WINDOW)
    assert lengths == [[m + WINDOW] * 2 for m in allocation]
    budgeted = load_policy({"name": "xkv", "profile": str(path), "tokens": 20})
    allocation, _ = plan_sizes(budgeted, layers)
    assert allocation == allocation_from_fractions(fractions, n - WINDOW, 2 * (20 - WINDOW))
    # Through the engine, the policy given as a preset path: the pool holds exactly that allocation.
    engine = LLMEngine(suite_model, dtype=torch.float32, num_pages=2048, page_size=4)
    prompt = suite_prompts(suite_model)[0]
    expected = allocation_from_fractions(fractions, len(prompt) - WINDOW)
    assert kept_per_head(engine, prompt, str(preset)) == [[m + WINDOW] * 2 for m in expected]
    assert engine.cache.pool.num_used == 0


def test_without_a_model_the_random_bench_model_is_profiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    small = {**bench_models.BENCH_MODEL, "hidden_size": 32, "intermediate_size": 64, "num_layers": 3}
    monkeypatch.setattr(bench_models, "BENCH_MODEL", small)  # the default shape, shrunk for a 2-core CI
    out = tmp_path / "random.yaml"
    rc = main(
        ["profile", "xkv", "--samples", "1", "--tasks", "niah_multikey", "--context-len", "96", "--out", str(out)]
    )
    assert rc == 0
    assert "RANDOM-WEIGHT" in capsys.readouterr().err
    profile = XKVProfile.load(out)
    assert profile.num_layers == 3 and profile.metadata["model"] == "random suite bench model (seed 0)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{missing}"], "model directory not found"),
        (["--model", "{no_tokenizer}"], "has no tokenizer"),
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (["--tasks", "niah_multikey,nope"], "unknown task(s) nope; known: aggregation"),
        (["--budget", "0"], "--budget (the R_avg coverage target) must lie in (0, 1]"),
        (["--budget", "1.5"], "must lie in (0, 1]"),
        (["--context-len", "0"], "--context-len must be >= 1"),
        (["--context-len", "8"], "context_length=8 is too short"),
        (["--seed", str(HELD_OUT_SEED - 1), "--samples", "2"], "not all training seeds"),
    ],
    ids=[
        "missing-model",
        "no-tokenizer",
        "zero-samples",
        "unknown-task",
        "zero-budget",
        "big-budget",
        "zero-context",
        "short-context",
        "held-out-seeds",
    ],
)
def test_bad_inputs_fail_clearly(
    suite_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((suite_model / "config.json").read_text())
    paths = {"missing": str(tmp_path / "missing"), "no_tokenizer": str(no_tokenizer)}
    args = [a.format(**paths) for a in args]
    if "--model" not in args:
        args = ["--model", str(suite_model), *args]
    out = tmp_path / "xkv.yaml"
    assert main(["profile", "xkv", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpress profile xkv: ") and message in err, err
    assert not out.exists()


def test_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "xkv", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model", "--out", "--samples", "--tasks", "--context-len", "--budget", "--protocol", "--seed"):
        assert option in text
    assert "training seeds" in text and "target_ratio" in text and '"profile"' in text
    with pytest.raises(SystemExit) as exc:
        main(["profile", "xkv", "--model", "x"])  # --out is required
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
    assert main(["profile"]) == 2
    assert "xkv" in capsys.readouterr().err
    assert "profile" in cli.build_parser().format_help()
