"""A request started from a shared prefill prefix equals the same request run whole (outputs and kept entries)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import write_suite_gemma3, write_suite_model

from vllm_kvpress_ext.bench.budgets import budgets_for, make_policy
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.prefix import add_forked_request, capture_prefix, merged_capture_spec
from vllm_kvpress_ext.policies import policy_names

PREFIX, TOTAL = 150, 170
# Every registered policy that can start from a shared prefix (WG-KV gates writes during prefill).
POLICIES = [p for p in policy_names() if p != "wgkv"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """The suite's Llama, and a Gemma 3 whose sliding layers (window 32) hold a ring the fork must copy whole."""
    if request.param == "gemma3":
        _, path = write_suite_gemma3(tmp_path_factory.mktemp("suite-gemma3"), window=32)
    else:
        path = write_suite_model(tmp_path_factory.mktemp("suite-model"), std=0.3)
    return LLMEngine(path, max_num_seqs=4, kv_memory=8 << 20, page_size=16)


def _run(engine: LLMEngine, submit: object) -> tuple[list[int], torch.Tensor]:
    held: dict[str, torch.Tensor] = {}

    def record(request: object) -> None:
        held["positions"] = engine.cache.entry_positions(request.request_id)[0].clone()  # type: ignore[attr-defined]

    engine.finish_hooks.append(record)
    try:
        rid = submit()  # type: ignore[operator]
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    out = o
    finally:
        engine.finish_hooks.remove(record)
    assert out is not None
    return out.output_token_ids, held["positions"]


def test_forked_requests_equal_whole_runs(engine: LLMEngine) -> None:
    prompt = torch.randint(3, engine.config.vocab_size, (TOTAL,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    policies = {name: make_policy(name, budgets_for(name, (0.25,))[0]) for name in POLICIES if name != "full"}
    policies["full"] = None
    snapshot = capture_prefix(engine, prompt[:PREFIX], merged_capture_spec(list(policies.values())), "prefix")
    assert snapshot.keys.shape[:3] == (engine.config.num_hidden_layers, engine.config.num_key_value_heads, PREFIX)
    for name, policy in policies.items():
        whole = _run(
            engine,
            lambda p=policy, n=name: engine.add_request(
                prompt, params, f"whole-{n}", policy=p or "full", compress_after=PREFIX
            ),
        )
        forked = _run(
            engine, lambda p=policy, n=name: add_forked_request(engine, snapshot, prompt, params, f"fork-{n}", p)
        )
        assert forked[0] == whole[0], name
        assert torch.equal(forked[1], whole[1]), name
        if policy is not None:
            assert (whole[1][..., :PREFIX] >= 0).sum() < engine.config.num_hidden_layers * 2 * PREFIX, name
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages  # every copy was freed


def test_fork_rejects_what_it_cannot_reproduce(engine: LLMEngine, tmp_path: Path) -> None:
    prompt = list(range(3, 3 + 40))
    snapshot = capture_prefix(engine, prompt[:32], merged_capture_spec([None]), "bare")
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="lacks what"):
        add_forked_request(engine, snapshot, prompt, params, "x", "snapkv")
    with pytest.raises(ValueError, match="must extend"):
        add_forked_request(engine, snapshot, prompt[:32], params, "y", None)
    with pytest.raises(ValueError, match="must extend"):
        add_forked_request(engine, snapshot, [0, *prompt[1:]], params, "z", None)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.add_request(prompt, params, "busy")
        capture_prefix(engine, prompt, merged_capture_spec([None]), "again")
    engine.abort("busy")


def test_forks_share_scores_and_still_equal_whole_runs(engine: LLMEngine) -> None:
    """Forks of one prefix compute the all-query (H2O) and window (SnapKV family) attention once; a second
    budget of the same policy reuses it and still equals its whole run."""
    prompt = torch.randint(3, engine.config.vocab_size, (TOTAL,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    policies = {f"{name}-{b}": make_policy(name, b) for name in ("h2o", "snapkv", "lava", "kvec") for b in (0.5, 0.2)}
    snapshot = capture_prefix(engine, prompt[:PREFIX], merged_capture_spec(list(policies.values())), "prefix-memo")
    shared = snapshot.layers[engine.config.layer_windows.index(None)].shared  # the first layer a policy sees
    assert shared == {}
    for label, policy in policies.items():
        whole = _run(
            engine,
            lambda p=policy, n=label: engine.add_request(prompt, params, f"whole-{n}", policy=p, compress_after=PREFIX),
        )
        forked = _run(
            engine, lambda p=policy, n=label: add_forked_request(engine, snapshot, prompt, params, f"fork-{n}", p)
        )
        assert forked[0] == whole[0], label
        assert torch.equal(forked[1], whole[1]), label
    assert shared is not None
    names = {key[0] for key in shared}
    # H2O's column sums, the SnapKV family's reduced votes, K-VEC's window probabilities (its focus term).
    assert names == {"h2o.accumulated_attention", "window_votes", "window_attention"}, names
