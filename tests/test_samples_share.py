"""n samples of one prompt: one prefill and compression, then forks that share the compressed pages.

Each sample must produce exactly what it produces alone (same seed), and the pool must hold one
compressed prompt plus n tails, measured on the pool's own pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.bench.accuracy import make_policy
from vllm_kvpress_ext.engine import LLM, LLMEngine, SamplingParams

PAGE = 4
N = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("samples-model"), std=0.3)


def make_engine(path: Path) -> LLMEngine:
    return LLMEngine(path, dtype=torch.float32, num_pages=2048, page_size=PAGE, max_num_batched_tokens=256)


def prompt_of(engine: LLMEngine, seed: int = 0, length: int = 61) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.config.vocab_size, (length,), generator=gen).tolist()


def run(engine: LLMEngine, ids: list[str]) -> tuple[dict[str, list[int]], list[int]]:
    """Step to the end; the tokens of each id, and the pool's used pages after every step."""
    outputs: dict[str, list[int]] = {}
    used: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        used.append(engine.cache.pool.num_used)
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages
    return {i: outputs[i] for i in ids}, used


def sample_params(j: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=9, temperature=0.9, seed=11 + j, ignore_eos=True)


@pytest.mark.parametrize(
    ("policy", "greedy"),
    [("snapkv", False), ("streaming_llm", True), ("h2o", False), ("full", False)],
)
def test_samples_equal_their_solo_runs_and_share_the_prompt(model_path: Path, policy: str, greedy: bool) -> None:
    engine = make_engine(model_path)
    resolved = make_policy(policy, None if policy in ("full", "streaming_llm") else 0.5)
    prompt = prompt_of(engine)
    solo: list[list[int]] = []
    solo_used: list[int] = []
    for j in range(N):
        rid = engine.add_request(prompt, sample_params(j, greedy), f"solo-{j}", policy=resolved)
        tokens, solo_used = run(engine, [rid])
        solo.append(tokens[rid])
    # The compressed prompt alone: what a one-token request keeps (its sampled token is never written).
    probe = engine.add_request(prompt, SamplingParams(max_tokens=1), "probe", policy=resolved)
    held: dict[str, torch.Tensor] = {}
    engine.finish_hooks.append(lambda r: held.setdefault("lens", engine.cache.seq_lens[:, r.row].clone()))
    run(engine, [probe])
    engine.finish_hooks.clear()
    full_prompt_pages = int((held["lens"].to(torch.int64) // PAGE).sum())

    ids = [engine.add_request(prompt, sample_params(0, greedy), "s-0", policy=resolved)]
    ids += [
        engine.add_request(prompt, sample_params(j, greedy), f"s-{j}", policy=resolved, sample_of=ids[0])
        for j in range(1, N)
    ]
    together, used = run(engine, ids)
    assert [together[i] for i in ids] == solo
    assert engine.samples_forked == N - 1
    assert len(used) == len(solo_used)
    if not resolved.wants_decode_steps:  # without decode-time eviction, pages follow the solo run exactly
        # After the prefill step the pool holds one compressed prompt (the forks copied nothing) ...
        assert used[0] == solo_used[0]
        # ... then each sample its private tail: the shared whole pages once, everything else n times.
        for step in range(1, len(used) - 1):
            assert used[step] == full_prompt_pages + N * (solo_used[step] - full_prompt_pages), step
        assert used[-2] < N * solo_used[-2]
    else:  # eviction moves entries into shared pages: copies-on-write, still far below n prompts
        assert max(used) < N * max(solo_used)


def test_offline_generate_n(model_path: Path) -> None:
    llm = LLM(model_path, dtype=torch.float32, num_pages=2048, page_size=PAGE)
    prompts = [prompt_of(llm.engine, 1), prompt_of(llm.engine, 2, 40)]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    outs = llm.generate(prompts, params, n=N, policy="snapkv")
    assert len(outs) == 2 * N and llm.engine.samples_forked == 2 * (N - 1)
    for p, prompt in enumerate(prompts):
        for j in range(N):
            seeded = SamplingParams(max_tokens=5, temperature=1.0, seed=3 + j, ignore_eos=True)
            alone = llm.generate([prompt], seeded, policy="snapkv")[0]
            assert outs[p * N + j].prompt_token_ids == prompt
            assert outs[p * N + j].output_token_ids == alone.output_token_ids
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        llm.generate(prompts, params, n=0)


def test_samples_run_alone_when_their_first_sample_is_gone(model_path: Path) -> None:
    engine = make_engine(model_path)
    prompt = prompt_of(engine, 4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected, _ = run(engine, [engine.add_request(prompt, params, "alone", policy="snapkv")])
    lead = engine.add_request(prompt, params, "lead", policy="snapkv")
    engine.add_request(prompt, params, "follow", policy="snapkv", sample_of=lead)
    engine.abort(lead)
    got, _ = run(engine, ["follow"])
    assert got["follow"] == expected["alone"] and engine.samples_forked == 0
    # A sample of a request that already sampled runs alone too.
    lead = engine.add_request(prompt, params, "lead-2", policy="snapkv")
    engine.step()
    engine.add_request(prompt, params, "late", policy="snapkv", sample_of=lead)
    got, _ = run(engine, [lead, "late"])
    assert got["late"] == expected["alone"] and engine.samples_forked == 0
    # An aborted pending sample leaves no trace.
    lead = engine.add_request(prompt, params, "lead-3", policy="snapkv")
    engine.add_request(prompt, params, "gone", policy="snapkv", sample_of=lead)
    engine.abort("gone")
    got, _ = run(engine, [lead])
    assert got[lead] == expected["alone"] and engine.samples_forked == 0


def test_sample_of_must_name_the_same_prompt(model_path: Path) -> None:
    engine = make_engine(model_path)
    prompt = prompt_of(engine, 5)
    lead = engine.add_request(prompt, SamplingParams(max_tokens=2), "lead", policy="snapkv")
    with pytest.raises(ValueError, match="another prompt"):
        engine.add_request(prompt[:-1], SamplingParams(max_tokens=2), "x", policy="snapkv", sample_of=lead)
    with pytest.raises(ValueError, match="another prompt or compress_after"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), "y", policy="snapkv", sample_of=lead, compress_after=9)
    with pytest.raises(ValueError, match="another policy"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), "z", policy="h2o", sample_of=lead)
    engine.abort(lead)
