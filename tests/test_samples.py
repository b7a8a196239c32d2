"""The samples of one prompt share its compressed pages: one prefill, one compressed prompt, n tails.

Exactness: each sample's tokens equal the same request run alone. Memory: measured on the pool, the n
samples hold one compressed prompt plus one page per (layer, KV head) and sample beyond a single
request. Copy-on-write: no sample's writes reach another's cache, and nothing leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_utils import write_suite_model

from vllm_kvpress_ext.bench.models import write_untrained_gates
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams

POLICIES = ["full", {"name": "snapkv", "ratio": 0.3}, {"name": "h2o", "ratio": 0.3}, "streaming_llm", "wgkv"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_suite_model(tmp_path_factory.mktemp("suite-model"), std=0.3)
    write_untrained_gates(path)
    return path


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, max_num_seqs=8, kv_memory=8 << 20, page_size=16)


def _prompt(engine: LLMEngine, n: int = 150, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.config.vocab_size, (n,), generator=g).tolist()


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=seed, ignore_eos=True)


def _finish(engine: LLMEngine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    assert engine.cache.pool.num_used == 0, "pages leaked"
    return outputs


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p if isinstance(p, str) else p["name"])
def test_samples_of_one_prompt_equal_separate_runs(model_dir: Path, policy: object) -> None:
    engine = _engine(model_dir)
    prompt = _prompt(engine)
    engine.add_request(prompt, _params(0), "s0", policy=policy)  # type: ignore[arg-type]
    for j in (1, 2):
        engine.add_request(prompt, _params(j), f"s{j}", policy=policy, sample_of="s0")  # type: ignore[arg-type]
    shared = _finish(engine)
    alone = {}
    for j in range(3):
        engine.add_request(prompt, _params(j), f"alone{j}", policy=policy)  # type: ignore[arg-type]
        alone.update(_finish(engine))
    assert [shared[f"s{j}"] for j in range(3)] == [alone[f"alone{j}"] for j in range(3)]
    assert len({tuple(t) for t in shared.values()}) > 1  # the seeds did make the samples differ


def _pages_after_first_decode(engine: LLMEngine, prompt: list[int], samples: int, share: bool) -> int:
    engine.add_request(prompt, _params(0), "p0", policy={"name": "snapkv", "ratio": 0.3})
    for j in range(1, samples):
        engine.add_request(
            prompt, _params(j), f"p{j}", policy={"name": "snapkv", "ratio": 0.3}, sample_of="p0" if share else None
        )
    while not all(len(engine.requests[f"p{j}"].output_token_ids) >= 2 for j in range(samples)):
        engine.step()
    used = engine.cache.pool.num_used
    for j in range(samples):
        engine.abort(f"p{j}")
    assert engine.cache.pool.num_used == 0
    return used


def test_n_samples_hold_one_compressed_prompt_plus_n_tails(model_dir: Path) -> None:
    engine = _engine(model_dir)
    prompt = _prompt(engine)
    one = _pages_after_first_decode(engine, prompt, 1, share=True)
    shared = _pages_after_first_decode(engine, prompt, 3, share=True)
    separate = _pages_after_first_decode(engine, prompt, 3, share=False)
    cells = engine.config.num_hidden_layers * engine.config.num_key_value_heads
    # Each further sample adds exactly one page per (layer, KV head): its copy of the partial last page
    # (copy-on-write at its first token), or the fresh page its first token opens.
    assert shared == one + 2 * cells
    assert separate == 3 * one
    print(f"pages after the first decode step: 1 request {one}, 3 samples shared {shared}, separate {separate}")


def test_a_sample_runs_alone_when_its_prompt_already_answered(model_dir: Path) -> None:
    engine = _engine(model_dir)
    prompt = _prompt(engine)
    engine.add_request(prompt, _params(0), "first")
    while not engine.requests["first"].output_token_ids:
        engine.step()
    engine.add_request(prompt, _params(1), "late", sample_of="first")  # too late to share: runs whole
    engine.add_request(prompt, _params(2), "orphan", sample_of="nobody")
    assert {r.request_id for r in engine.scheduler.waiting} >= {"late", "orphan"}  # queued to prefill
    outputs = _finish(engine)
    assert set(outputs) == {"first", "late", "orphan"}
    engine.add_request(prompt, _params(1), "late-alone")
    assert _finish(engine)["late-alone"] == outputs["late"]


def test_aborting_the_first_sample_lets_the_others_run(model_dir: Path) -> None:
    engine = _engine(model_dir)
    prompt = _prompt(engine)
    engine.add_request(prompt, _params(0), "a")
    engine.add_request(prompt, _params(1), "b", sample_of="a")
    engine.add_request(prompt, _params(2), "c", sample_of="a")
    engine.abort("c")  # a waiting sample goes quietly
    engine.abort("a")  # before its first token: "b" prefills on its own
    outputs = _finish(engine)
    assert set(outputs) == {"b"}
    engine.add_request(prompt, _params(1), "b-alone")
    assert _finish(engine)["b-alone"] == outputs["b"]


# --------------------------------------------------------------------------- the cache alone


def _filled(cache: PagedKVCache, rid: str, n: int) -> None:
    row = cache.add_request(rid)
    slots = cache.append_slots([row], torch.arange(n).view(1, -1))
    values = torch.randn(*slots.shape, cache.head_dim)
    cache.write(slots, values, -values)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["fork", "append", "compact", "evict", "free"]), st.integers(0, 10**6)), max_size=30
    )
)
def test_forks_copy_on_write_and_conserve_pages(ops: list[tuple[str, int]]) -> None:
    """Random forks, appends, compactions, evictions and frees: every row reads exactly what it would
    read had it never shared a page, and the pool's holder counts match the tables at every step."""
    cache = PagedKVCache(2, 2, 4, num_pages=400, page_size=4, max_requests=8, dtype=torch.float32)
    _filled(cache, "r0", 9)
    expected = {"r0": _contents(cache, "r0")}
    for i, (op, pick) in enumerate(ops):
        names = sorted(expected)
        if not names:
            break
        rid = names[pick % len(names)]
        row = cache.row_of(rid)
        if op == "fork" and len(names) < 8:
            cache.fork_request(rid, f"f{i}")
            expected[f"f{i}"] = _contents(cache, rid)
        elif op == "append":
            lens = cache.seq_lens[:, row].clone()
            slots = cache.append_slots([row], torch.tensor([[100 + i]]))
            values = torch.full((*slots.shape, cache.head_dim), float(i))
            cache.write(slots, values, -values)
            assert bool((cache.seq_lens[:, row] == lens + 1).all())
        elif op == "compact":
            lens = cache.seq_lens[:, row].to(torch.int64)
            n = int(lens.max())
            keep = (torch.arange(n) % 2 == pick % 2) & (torch.arange(n) < lens.unsqueeze(-1))
            cache.apply_keep_plan(rid, KeepPlan.from_mask(keep))
        elif op == "evict":
            lens = cache.seq_lens[:, row].to(torch.int64)
            if int(lens.min()) > 1:
                victims = torch.full_like(lens, pick) % lens
                l_idx, h_idx = torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij")
                cache.evict(torch.full((4,), row), l_idx.flatten(), h_idx.flatten(), victims.flatten())
        elif op == "free":
            cache.free_request(rid)
            del expected[rid]
            _check_counts(cache)
            continue
        if op != "fork":
            expected[rid] = _contents(cache, rid)
        for other, contents in expected.items():  # nobody else's cache moved
            assert _same(_contents(cache, other), contents), f"{op} on {rid} changed {other}"
        _check_counts(cache)
    for rid in list(expected):
        cache.free_request(rid)
    assert cache.pool.num_used == 0


def _contents(cache: PagedKVCache, rid: str) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in cache.gather(rid, layer, head)) for layer in range(2) for head in range(2)]


def _same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def _check_counts(cache: PagedKVCache) -> None:
    tables = torch.cat([cache.block_tables.reshape(-1), cache.rings.tables.reshape(-1)])
    held = torch.bincount(tables[tables >= 0].to(torch.int64), minlength=cache.pool.num_pages)
    assert torch.equal(held.to(torch.int32), cache.pool.refcounts())
    assert cache.pool.num_used == int((held > 0).sum())
    assert cache.pool.num_shared == int((held > 1).sum())


def test_a_sample_with_another_ring_or_recording_runs_alone(model_dir: Path) -> None:
    """What the first sample's prefill built must be what the sample would build: WG-KV's ring is sized by
    max_tokens, and prompt log-probabilities are recorded during the prefill."""
    engine = _engine(model_dir)
    short = _prompt(engine, n=20)  # the ring (64 tokens by default) is cut to prompt + max_tokens, in pages
    engine.add_request(short, _params(0), "lead", policy="wgkv")
    longer = SamplingParams(max_tokens=100, temperature=0.9, seed=1, ignore_eos=True)
    engine.add_request(short, longer, "longer", policy="wgkv", sample_of="lead")
    assert engine.requests["lead"].seat.admission.window != engine.requests["longer"].seat.admission.window
    prompt = _prompt(engine)
    engine.add_request(prompt, _params(0), "plain")
    scoring = SamplingParams(max_tokens=12, temperature=0.9, seed=2, ignore_eos=True, prompt_logprobs=1)
    engine.add_request(prompt, scoring, "scoring", sample_of="plain")
    assert {r.request_id for r in engine.scheduler.waiting} == {"lead", "longer", "plain", "scoring"}
    _finish(engine)


def test_the_offline_api_returns_n_samples_per_prompt(model_dir: Path) -> None:
    from vllm_kvpress_ext.engine import LLM

    llm = LLM(model_dir, max_num_seqs=8, kv_memory=8 << 20, page_size=16)
    prompt = _prompt(llm.engine)
    outs = llm.generate([prompt], _params(5), n=3, policy="snapkv")
    alone = [llm.generate([prompt], _params(5 + j), policy="snapkv")[0] for j in range(3)]
    assert [o.output_token_ids for o in outs] == [a.output_token_ids for a in alone]
    with pytest.raises(ValueError, match="n must be"):
        llm.generate([prompt], _params(0), n=0)
