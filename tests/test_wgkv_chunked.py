"""WG-KV admission during a chunked prefill: what the gates do not admit leaves the cache with its chunk."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.admission import PromptAdmission
from vllm_kvpress_ext.engine.layerwise import prefill_reservation
from vllm_kvpress_ext.engine.request import RequestStatus
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.models.write_gate import WriteGates
from vllm_kvpress_ext.policies import WGKVPolicy, load_policy
from vllm_kvpress_ext.policies.base import AdmissionPolicy, full_prompt_pages

PAGE = 8
WINDOW = 16
PROMPT = 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("wgkv-chunked") / "model", hidden=64, max_positions=1024)


@pytest.fixture(scope="module")
def gates(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random gates spread widely around 0.5, so that about half the keys are admitted at tau 0.5."""
    config = load_config(model_dir)
    torch.manual_seed(7)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, init_bias=0.0)
    with torch.no_grad():
        gates.w2.normal_(0.0, 3.0)
    return gates.save(tmp_path_factory.mktemp("gates") / "random.wgkv.safetensors", {"local_window": WINDOW})


def prompt(seed: int = 0, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def cache_after_prefill(engine: LLMEngine, tokens: list[int], policy: Any) -> dict[str, Any]:
    """Every (layer, head, region)'s keys, values and positions once the prefill is over, and the page peak."""
    request_id = engine.add_request(
        tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), policy=policy
    )
    cache = engine.cache
    while not any(o.request_id == request_id for o in engine.step()):
        pass
    state = {
        (layer, head, region): cache.gather(request_id, layer, head, region)
        for layer in range(cache.num_layers)
        for head in range(cache.num_kv_heads)
        for region in ("global", "ring")
    }
    peak = cache.peak_pages(request_id)
    held = int(cache.pages_per_head(request_id).sum())
    output: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                output = list(o.output_token_ids)
    return {"state": state, "peak": peak, "held": held, "output": output}


def run(model_dir: Path, gates: Path, chunk: int, tokens: list[int], **policy: Any) -> dict[str, Any]:
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE, max_num_batched_tokens=chunk)
    return cache_after_prefill(engine, tokens, {"name": "wgkv", "gates": str(gates), "tau": 0.5, **policy})


@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 64, 99, 100])
def test_chunkwise_admission_gives_exactly_the_prefill_completion_cache(
    model_dir: Path, gates: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(chunk)
    with monkeypatch.context() as patch:
        # The prefill-completion path: every chunk written whole, admission applied once by `start_ring`.
        patch.setattr(PromptAdmission, "drop_unadmitted", lambda self, cache, request_id: None)
        whole = run(model_dir, gates, chunk, tokens)
    chunked = run(model_dir, gates, chunk, tokens)
    assert chunked["state"].keys() == whole["state"].keys()
    for key, (keys, values, positions) in whole["state"].items():
        got_keys, got_values, got_positions = chunked["state"][key]
        assert torch.equal(got_positions, positions), key
        assert torch.equal(got_keys, keys), key  # bit for bit: the dropped keys were never attended to
        assert torch.equal(got_values, values), key
    assert chunked["output"] == whole["output"]
    assert chunked["held"] == whole["held"]
    # Some keys were admitted, some not: the test exercises both (else both paths are trivially equal).
    admitted_old = sum(len(p) for (_, _, region), (_, _, p) in whole["state"].items() if region == "global")
    assert 0 < admitted_old < (PROMPT - WINDOW) * len(whole["state"]) // 2
    if chunk < PROMPT - WINDOW:
        assert chunked["peak"] < whole["peak"]  # the saving happens during the prefill, not after it
    else:
        assert chunked["peak"] == whole["peak"]  # one chunk (or a last chunk reaching into the window)


def capped(gates: Path, cap: int = 8) -> dict[str, Any]:
    return {"name": "wgkv", "gates": str(gates), "tau": 0.5, "cap": cap, "local_window": WINDOW}


@pytest.mark.parametrize("chunk", [8, 24, 40, 64])
def test_capped_admission_never_holds_more_pages_than_it_declared(model_dir: Path, gates: Path, chunk: int) -> None:
    config = load_config(model_dir)
    layers, heads, length = config.num_hidden_layers, config.num_key_value_heads, 200
    policy = load_policy(capped(gates))
    declared = policy.chunked_prefill_peak_pages(length, layers, heads, PAGE, chunk)
    assert declared < full_prompt_pages(length, layers, heads, PAGE)
    engine = LLMEngine(model_dir, num_pages=512, page_size=PAGE, max_num_batched_tokens=chunk)
    request_id = engine.add_request(
        prompt(chunk, length), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), policy=capped(gates)
    )
    request = engine.requests[request_id]
    peak_between_steps = 0
    while request.status is not RequestStatus.RUNNING:
        engine.step()
        assert request.reserved_pages == declared  # what the scheduler set aside
        peak_between_steps = max(peak_between_steps, int(engine.cache.pages_per_head(request_id).sum()))
    peak = engine.cache.peak_pages(request_id)  # exact: the cache notes it at every allocation
    assert 0 < peak_between_steps <= peak <= declared
    # The cap holds after the prefill too (these gates admit about half of every head, far over it).
    positions, _ = engine.cache.entry_positions(request_id)
    assert int((positions >= 0).sum(dim=(1, 2)).max()) <= 8 * heads
    while engine.has_unfinished_requests():
        engine.step()


def test_without_cap_the_declared_chunked_peak_is_the_full_prompt(gates: Path) -> None:
    policy = load_policy({"name": "wgkv", "gates": str(gates), "local_window": WINDOW})
    assert isinstance(policy, AdmissionPolicy) and not policy.wants_gate_values
    assert policy.chunked_prefill_peak_pages(200, 2, 2, PAGE, 16) == full_prompt_pages(200, 2, 2, PAGE)
    # A cap without an explicit window: the window comes from the gate file, unknown here.
    assert load_policy(capped(gates) | {"local_window": None}).chunked_prefill_peak_pages(200, 2, 2, PAGE, 16) == (
        full_prompt_pages(200, 2, 2, PAGE)
    )
    # With both: (cap * H + H * (W + chunk) + H * (page - 1)) // page pages per layer.
    assert load_policy(capped(gates)).chunked_prefill_peak_pages(200, 2, 2, PAGE, 16) == 2 * (
        (8 * 2 + 2 * (WINDOW + 16) + 2 * (PAGE - 1)) // PAGE
    )
    # One chunk holding the whole prompt: nothing below the full prompt can be promised.
    assert load_policy(capped(gates)).chunked_prefill_peak_pages(200, 2, 2, PAGE, 200) == full_prompt_pages(
        200, 2, 2, PAGE
    )


def test_limit_prefill_admission_keeps_the_highest_gated_older_entries_across_heads() -> None:
    policy = WGKVPolicy(cap=2)
    admitted = torch.tensor([[[True, True, False, True, True, True], [True, False, True, True, False, True]]])
    values = torch.tensor([[[0.9, 0.2, 0.0, 0.5, 0.3, 0.3], [0.6, 0.0, 0.95, 0.1, 0.0, 0.3]]])
    kept = policy.limit_prefill_admission(admitted, values, window_start=4)
    # Older than the window (positions 0..3): admitted 0, 1, 3 in head 0 and 0, 2, 3 in head 1; the best
    # cap * H = 4 by gate value are 0.95, 0.9, 0.6, 0.5. The window's entries (4, 5) are untouched.
    assert kept.tolist() == [[[True, False, False, True, True, True], [True, False, True, False, False, True]]]
    assert WGKVPolicy().limit_prefill_admission(admitted, None, 4) is admitted
    # Without gate values the first admitted entries in (head, position) order stay.
    oldest = policy.limit_prefill_admission(admitted, None, 4)
    assert oldest.tolist() == [[[True, True, False, True, True, True], [True, False, False, False, False, True]]]


def test_both_schedulers_reserve_the_declared_chunked_peak(gates: Path) -> None:
    from vllm_kvpress_ext.vllm_plugin.report import PoolReport

    layers, heads = 2, 2
    report = PoolReport(
        pages_total=1000,
        pages_free=1000,
        page_size=PAGE,
        pages_per_token_block=layers * heads,
        page_bytes=1,
        num_layers=layers,
        num_kv_heads=heads,
    )
    policy = load_policy(capped(gates))
    declared = policy.chunked_prefill_peak_pages(300, layers, heads, PAGE, 32)
    assert report.prefill_pages(300, policy, False, 32) == declared < report.full_prompt_pages(300)
    assert report.prefill_pages(300, policy, False) == report.full_prompt_pages(300)  # chunk size unknown: full prompt
    assert prefill_reservation(policy, 300, False, layers, heads, PAGE, True, 32) == declared


def test_prefill_peak_bench_admission_rows(model_dir: Path, gates: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.bench.prefill_peak import PrefillPeakConfig, run_prefill_peak_bench

    config = PrefillPeakConfig(
        model=str(model_dir),
        context_len=160,
        ratio=0.25,
        max_batched_tokens=32,
        rows="admission",
        gates=str(gates),
        local_window=WINDOW,
        waiting=6,
        decode_tokens=2,
    )
    rows = {r["policy"]: r for r in run_prefill_peak_bench(config)}
    assert list(rows) == ["full", "snapkv", "wgkv", "wgkv + cap 40"]
    full, snapkv, wgkv, capped_row = rows.values()
    assert snapkv["prefill_peak_bytes"] == full["prefill_peak_bytes"]  # end of prefill: the whole prompt first
    assert wgkv["prefill_peak_bytes"] < full["prefill_peak_bytes"]  # admission after each chunk
    assert capped_row["prefill_peak_bytes"] <= capped_row["reserved_bytes"] < full["reserved_bytes"]
    assert wgkv["reserved_bytes"] == snapkv["reserved_bytes"] == full["reserved_bytes"]
    # A pool of four uncompressed prompts: the declared peak lets more requests in at once.
    assert full["held_at_once"] <= 4 < capped_row["held_at_once"]
    assert "held at once (pool of 4 prompts, 6 waiting)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="rows must be"):
        run_prefill_peak_bench(PrefillPeakConfig(model=str(model_dir), rows="other"))
    with pytest.raises(ValueError, match="local_window must be a positive multiple"):
        run_prefill_peak_bench(PrefillPeakConfig(model=str(model_dir), rows="admission", local_window=20))
