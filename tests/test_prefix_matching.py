"""Automatic prefix matching and multi-turn attach (`prefix_matching="auto"`).

Exactness: a request that names no context and attaches to a stored prefix produces the tokens of the
same prompt run fresh with that prefix's boundary named; turn k+1 attached to what turn k left produces
the tokens of a fresh run that builds the same cache (docs/prefix_reuse.md, "Multi-turn"). Safety: no
match across policies or parameters, inside a first page, on a prompt equal to a stored entry, or on a
hash collision; pages are conserved over many turns; an entry in use is never evicted.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine import prefix_store as prefix_store_module
from vllm_kvpress_ext.engine.model_runner import Schedule, ScheduledChunk
from vllm_kvpress_ext.engine.request import RequestOutput

PAGE = 4
CONTEXT, QUESTION = 40, 6
SNAPKV = {"name": "snapkv", "ratio": 0.3}
H2O = {"name": "h2o", "ratio": 0.3}
TURN_POLICIES: list[Any] = ["full", SNAPKV, H2O]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("matching-model"), std=0.3)


def engine_for(path: Path, matching: str | None, **kwargs: Any) -> LLMEngine:
    # Without the exact prompts of compressing requests (`exact_prompt_reuse`, tests/test_prefix_reuse.py), so
    # that every attach here is one of automatic matching's.
    settings: dict[str, Any] = {"dtype": torch.float32, "num_pages": 1024, "page_size": PAGE, "max_num_seqs": 4}
    settings.update({"exact_prompt_reuse": False, **kwargs})
    if matching is None:
        return LLMEngine(path, enable_prefix_caching=False, **settings)
    return LLMEngine(path, enable_prefix_caching=True, prefix_matching=matching, **settings)


def tokens(engine: LLMEngine, seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.config.vocab_size, (length,), generator=g).tolist()


def run(engine: LLMEngine, prompt: list[int], policy: Any, **kwargs: Any) -> RequestOutput:
    request_id = engine.add_request(prompt, GREEDY, policy=policy, **kwargs)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                final = out
    assert final is not None and final.finish_reason == "length"
    return final


def check_conservation(engine: LLMEngine) -> None:
    """Every page's reference count equals the table cells (global and ring) that point at it."""
    cache = engine.cache
    tables = cache.block_tables
    held = torch.arange(tables.shape[-1]) < ((cache.seq_lens.to(torch.int64) + PAGE - 1) // PAGE).unsqueeze(-1)
    cells = torch.cat([tables[held], cache.rings.tables[cache.rings.tables >= 0]]).to(torch.int64)
    refs = torch.bincount(cells, minlength=cache.pool.num_pages).to(torch.int32)
    assert torch.equal(cache.pool.refcounts(), refs)


# ---------------------------------------------------------------------- automatic longest-prefix matching


@pytest.mark.parametrize("policy", [SNAPKV, H2O, {"name": "streaming_llm", "tokens": 12, "sink_tokens": 4}])
def test_unnamed_request_equals_naming_the_stored_boundary(model_path: Path, policy: Any) -> None:
    auto, fresh = engine_for(model_path, "auto"), engine_for(model_path, None)
    context = tokens(auto, 0, CONTEXT)
    run(auto, context + tokens(auto, 1, QUESTION), policy, compress_after=CONTEXT)  # stores the context
    prompt = context + tokens(auto, 2, QUESTION)
    attached = run(auto, prompt, policy)  # names nothing
    named = run(fresh, prompt, policy, compress_after=CONTEXT)
    assert attached.cached_tokens == CONTEXT
    assert attached.output_token_ids == named.output_token_ids
    # Without the stored context the same unnamed prompt compresses whole, as it always did.
    alone = run(fresh, prompt, policy)
    assert alone.cached_tokens == 0


def test_named_mode_never_matches_unnamed_prompts(model_path: Path) -> None:
    engine = engine_for(model_path, "named")
    context = tokens(engine, 0, CONTEXT)
    run(engine, context + tokens(engine, 1, QUESTION), SNAPKV, compress_after=CONTEXT)
    assert run(engine, context + tokens(engine, 2, QUESTION), SNAPKV).cached_tokens == 0
    assert run(engine, context + tokens(engine, 3, QUESTION), SNAPKV, compress_after=CONTEXT).cached_tokens == CONTEXT
    store = engine.runner.prefix_store
    assert store is not None and len(store.entries) == 1 and not store.index  # no finished-request entries


def test_no_match_across_policies_or_parameters(model_path: Path) -> None:
    engine = engine_for(model_path, "auto")
    context = tokens(engine, 0, CONTEXT)
    run(engine, context + tokens(engine, 1, QUESTION), SNAPKV, compress_after=CONTEXT)
    prompt = context + tokens(engine, 2, QUESTION)
    for other in ({"name": "snapkv", "ratio": 0.5}, {"name": "snapkv", "ratio": 0.3, "window": 8}, H2O, "full"):
        assert run(engine, prompt, other).cached_tokens == 0, other
    assert run(engine, prompt, SNAPKV).cached_tokens == CONTEXT


def test_equal_or_early_diverging_prompts_do_not_attach(model_path: Path) -> None:
    engine = engine_for(model_path, "auto")
    context = tokens(engine, 0, CONTEXT)
    run(engine, context + tokens(engine, 1, QUESTION), SNAPKV, compress_after=CONTEXT)
    assert run(engine, list(context), SNAPKV).cached_tokens == 0  # nothing left to run after it
    early = list(context)
    early[PAGE - 2] = (early[PAGE - 2] + 1) % engine.config.vocab_size or 3  # inside the first page
    assert run(engine, early + tokens(engine, 2, QUESTION), SNAPKV).cached_tokens == 0
    late = list(context)
    late[CONTEXT - 1] = (late[CONTEXT - 1] + 1) % engine.config.vocab_size or 3  # the context is used whole
    assert run(engine, late + tokens(engine, 3, QUESTION), SNAPKV).cached_tokens == 0
    # A request naming another boundary does not attach to this one.
    assert run(engine, context + tokens(engine, 4, QUESTION), SNAPKV, compress_after=CONTEXT - PAGE).cached_tokens == 0


def test_hash_collisions_cannot_attach_wrong_tokens(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every page of every prompt hashes alike: the index then offers every entry, the tokens decide.
    monkeypatch.setattr(
        prefix_store_module,
        "page_hashes",
        lambda namespace, ids, size: [bytes([i % 256]) for i in range(len(ids) // size)],
    )
    engine, fresh = engine_for(model_path, "auto"), engine_for(model_path, None)
    context, other = tokens(engine, 0, CONTEXT), tokens(engine, 9, CONTEXT)
    run(engine, context + tokens(engine, 1, QUESTION), SNAPKV, compress_after=CONTEXT)
    prompt = other + tokens(engine, 2, QUESTION)
    got = run(engine, prompt, SNAPKV)
    assert got.cached_tokens == 0
    assert got.output_token_ids == run(fresh, prompt, SNAPKV).output_token_ids
    assert run(engine, context + tokens(engine, 3, QUESTION), SNAPKV).cached_tokens == CONTEXT


def test_bad_matching_mode_is_refused(model_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix matching must be one of named, auto"):
        engine_for(model_path, "longest")


# ---------------------------------------------------------------------- multi-turn


def fresh_turn(engine: LLMEngine, prompt: list[int], policy: Any, prefilled: int) -> list[int]:
    """A fresh run that builds the cache an attached turn reads: tokens [0, prefilled) as one prefill
    (the policy compresses there), every later prompt token as a decode step, then greedy tokens.

    For a compressing policy this is the engine's own `compress_after=prefilled`; for `full`, whose
    engine prefills the whole prompt, the runner is driven with that schedule by hand."""
    if policy != "full":
        return run(engine, prompt, policy, compress_after=prefilled).output_token_ids
    runner = engine.runner
    request = runner.new_request("fresh", prompt, GREEDY, None, max_model_len=engine.max_model_len)
    runner.start(request)
    result = runner.execute(Schedule(prefill=[ScheduledChunk(request, 0, prefilled)]))
    runner.complete_prefill(request)  # what a chunk ending at the boundary does for a compressing policy
    while len(request.output_token_ids) < GREEDY.max_tokens:
        if result.logits is not None:
            request.output_token_ids.append(int(result.logits[0].argmax()))
            if len(request.output_token_ids) == GREEDY.max_tokens:
                break
        result = runner.execute(Schedule(decode=[request]))
    runner.release(request)
    return request.output_token_ids


@pytest.mark.parametrize("policy", TURN_POLICIES, ids=["full", "snapkv", "h2o"])
def test_each_turn_equals_the_fresh_run_that_builds_its_cache(model_path: Path, policy: Any) -> None:
    auto, fresh = engine_for(model_path, "auto"), engine_for(model_path, None)
    context = tokens(auto, 0, CONTEXT)
    prompt = context + tokens(auto, 1, QUESTION)
    named = None if policy == "full" else CONTEXT
    first = run(auto, prompt, policy, compress_after=named)
    boundary = CONTEXT if named else len(prompt)  # where turn 1's policy compressed (full: its whole prompt)
    for turn in range(2, 5):
        written = len(prompt) + len(first.output_token_ids) - 1  # the last sampled token never enters the cache
        prompt = prompt + first.output_token_ids + tokens(auto, 10 + turn, QUESTION)
        got = run(auto, prompt, policy)
        assert got.cached_tokens == written, (turn, got.cached_tokens)
        assert got.output_token_ids == fresh_turn(fresh, prompt, policy, boundary), turn
        first = got
    check_conservation(auto)


@pytest.mark.parametrize("policy", TURN_POLICIES, ids=["full", "snapkv", "h2o"])
def test_a_rewritten_answer_attaches_to_the_common_prefix_only(model_path: Path, policy: Any) -> None:
    """A chat template re-renders the answer: its tokens may differ from those generated. The next turn
    attaches to the tokens both share; a policy that evicts during decode (H2O) cannot cut its session
    cache and attaches to the stored context instead."""
    auto, fresh = engine_for(model_path, "auto"), engine_for(model_path, None)
    context = tokens(auto, 0, CONTEXT)
    prompt = context + tokens(auto, 1, QUESTION)
    named = None if policy == "full" else CONTEXT
    answer = run(auto, prompt, policy, compress_after=named).output_token_ids
    kept = 2
    rewritten = [*answer[:kept], (answer[kept] + 1) % auto.config.vocab_size or 3]
    follow = prompt + rewritten + tokens(auto, 20, QUESTION)
    got = run(auto, follow, policy)
    if policy == H2O:
        assert got.cached_tokens == CONTEXT
    else:
        assert got.cached_tokens == len(prompt) + kept
    boundary = CONTEXT if named else len(prompt)
    assert got.output_token_ids == fresh_turn(fresh, follow, policy, boundary)
    check_conservation(auto)


def test_pages_are_conserved_over_many_random_turns(model_path: Path) -> None:
    """Random sessions, turns, rewritten answers, policies and a small pool (eviction and preemption)."""
    rng = random.Random(0)
    engine = engine_for(model_path, "auto", num_pages=700, max_num_seqs=3, max_cached_prefixes=5)
    store = engine.runner.prefix_store
    assert store is not None
    sessions: list[tuple[Any, list[int]]] = []
    for step in range(40):
        if not sessions or rng.random() < 0.3:
            policy = rng.choice(TURN_POLICIES)
            sessions.append((policy, tokens(engine, 100 + step, rng.randint(8, 30))))
        index = rng.randrange(len(sessions))
        policy, history = sessions[index]
        prompt = history + tokens(engine, 200 + step, rng.randint(1, 6))
        request_id = engine.add_request(prompt, GREEDY, policy=policy)
        out = None
        while engine.has_unfinished_requests():
            for update in engine.step():
                if update.finished and update.request_id == request_id:
                    out = update
            check_conservation(engine)
            assert all(e.users >= 0 for e in store.entries.values())
        assert out is not None
        answer = out.output_token_ids
        if rng.random() < 0.3:  # the client's rendering of the answer differs from the tokens generated
            answer = answer[: rng.randrange(len(answer))]
        sessions[index] = (policy, prompt + answer)
    assert store.hits > 0 and store.evicted > 0
    assert not any(e.users for e in store.entries.values())
    store.clear()
    assert not store.entries and not store.index
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_finished_sessions_go_least_recently_used_first_and_never_while_in_use(model_path: Path) -> None:
    engine = engine_for(model_path, "auto", max_cached_prefixes=2)
    store = engine.runner.prefix_store
    assert store is not None
    a, b = tokens(engine, 1, 20), tokens(engine, 2, 20)
    out_a = run(engine, a, "full")
    run(engine, b, "full")
    keys = list(store.entries)
    assert len(keys) == 2
    # Session a's next turn attaches: a is then the most recently used, and in use while it runs.
    follow = a + out_a.output_token_ids + tokens(engine, 3, 3)
    request_id = engine.add_request(follow, GREEDY, policy="full")
    engine.step()
    in_use = [e for e in store.entries.values() if e.users]
    assert len(in_use) == 1 and in_use[0].key == keys[0]
    assert store.evict_one() is not None  # b goes, a stays
    assert list(store.entries) == [keys[0]]
    assert store.evict_one() is None  # a is in use: nothing can go
    while engine.has_unfinished_requests():
        engine.step()
    assert request_id not in engine.requests
    assert len(store.entries) == 2  # a, and the turn that just finished


def test_truncation_by_position_refuses_a_non_tail_and_changes_nothing() -> None:
    from vllm_kvpress_ext.cache import InvalidPlanError, PagedKVCache

    cache = PagedKVCache(2, 2, 4, num_pages=64, page_size=PAGE, max_requests=4, dtype=torch.float32)
    row = cache.add_request("a")
    cache.append_slots([row], torch.arange(10).view(1, -1))
    child = cache.fork_request("a", "b")
    assert cache.truncate_request("b", 6) == 2 * 2 * 1  # page 2 (positions 8, 9) of each (layer, head)
    assert cache.seq_lens[:, child].eq(6).all() and cache.seq_lens[:, row].eq(10).all()
    cache.evict([row], [0], [0], [2])  # position 9 moves into entry 2: positions >= 5 are no longer a tail
    before = (cache.seq_lens.clone(), cache.block_tables.clone(), cache.pool.refcounts().clone())
    with pytest.raises(InvalidPlanError, match="not the tail"):
        cache.truncate_request("a", 5)
    assert torch.equal(cache.seq_lens, before[0]) and torch.equal(cache.block_tables, before[1])
    assert torch.equal(cache.pool.refcounts(), before[2])
    cache.free_request("a")
    cache.free_request("b")
    assert cache.pool.num_free == cache.pool.num_pages


def test_evictable_pages_are_what_dropping_the_unused_entries_frees(model_path: Path) -> None:
    engine = engine_for(model_path, "auto")
    store = engine.runner.prefix_store
    assert store is not None
    context = tokens(engine, 0, CONTEXT)
    first = run(engine, context, SNAPKV)  # sessions of two turns share the first turn's pages
    second = context + first.output_token_ids + tokens(engine, 1, QUESTION)
    run(engine, second, SNAPKV)
    run(engine, tokens(engine, 2, CONTEXT), "full")
    assert len(store.entries) == 3
    # A running request attached to the second turn: its entry (and the pages it reads) cannot go.
    engine.add_request([*second, *tokens(engine, 3, QUESTION)], GREEDY, policy=SNAPKV)
    engine.step()
    assert sum(e.users for e in store.entries.values()) == 1
    evictable, before = store.evictable_pages(), engine.cache.pool.num_free
    store.evict_until(engine.cache.pool.num_pages)  # drops every unused entry
    assert len(store.entries) == 1 and engine.cache.pool.num_free - before == evictable > 0
