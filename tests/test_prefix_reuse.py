"""Compressed prefix reuse: a request attached to a cached compressed context equals the same request
run on a fresh engine, attached requests never see each other's tokens, and the store's pages are
conserved and given back before any running request is preempted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_utils import write_random_gates, write_suite_model
from tolerances import logprob_atol

from vllm_kvpress_ext.bench.accuracy import budgets_for, make_policy
from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache
from vllm_kvpress_ext.engine import LLM, LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.inputs import ContextQuestion
from vllm_kvpress_ext.engine.prefix_store import PrefixStore
from vllm_kvpress_ext.engine.request import Request
from vllm_kvpress_ext.policies import load_policy, policy_names

CONTEXT, QUESTION = 90, 7
# WG-KV gates writes during prefill and sizes its ring per request: not cached (PrefixStore.boundary).
POLICIES = [p for p in policy_names() if p not in ("wgkv", "full")]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_kept=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("prefix-model"), std=0.3)


def engine_for(path: Path, caching: bool, **kwargs: object) -> LLMEngine:
    """An engine whose store holds only what these tests count: compressed contexts and uncompressed requests'
    caches (`exact_prompt_reuse=True`, the default, also keeps every compressing request's exact prompt)."""
    settings: dict = {"dtype": torch.float32, "num_pages": 2048, "page_size": 4, "max_num_seqs": 8}
    settings.update({"exact_prompt_reuse": False, **kwargs})
    return LLMEngine(path, enable_prefix_caching=caching, **settings)


def tokens(engine: LLMEngine, seed: int, length: int) -> list[int]:
    return torch.randint(3, engine.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine: LLMEngine, ids: list[str]) -> dict[str, object]:
    outs: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return {i: outs[i] for i in ids}


@pytest.mark.parametrize("name", POLICIES)
def test_attached_requests_equal_fresh_runs(model_path: Path, name: str) -> None:
    cached, fresh = engine_for(model_path, True), engine_for(model_path, False)
    policy = make_policy(name, budgets_for(name, (0.3,))[0])
    context = tokens(cached, 0, CONTEXT)
    questions = [tokens(cached, 10 + q, QUESTION) for q in range(3)]
    first = cached.add_request(context + questions[0], GREEDY, "first", policy=policy, compress_after=CONTEXT)
    run_all(cached, [first])
    store = cached.runner.prefix_store
    assert store is not None and len(store.entries) == 1
    # Two requests attach at once: each writes its own question and answer on the shared context.
    ids = [
        cached.add_request(context + q, GREEDY, f"q{i}", policy=policy, compress_after=CONTEXT)
        for i, q in enumerate(questions[1:], 1)
    ]
    attached = run_all(cached, ids)
    assert store.hits == 2 and store.tokens_reused == 2 * CONTEXT
    for i, rid in enumerate(ids, 1):
        alone_id = fresh.add_request(context + questions[i], GREEDY, policy=policy, compress_after=CONTEXT)
        alone = run_all(fresh, [alone_id])[alone_id]
        got = attached[rid]
        assert got.cached_tokens == CONTEXT and alone.cached_tokens == 0  # type: ignore[attr-defined]
        assert got.output_token_ids == alone.output_token_ids, (name, i)  # type: ignore[attr-defined]
        assert torch.equal(got.kv.kept.positions, alone.kv.kept.positions), (name, i)  # type: ignore[attr-defined]
        at_compression = got.kv.kept_at_compression.positions  # type: ignore[attr-defined]
        assert torch.equal(at_compression, alone.kv.kept_at_compression.positions), (name, i)  # type: ignore[attr-defined]
    store.clear()
    assert cached.cache.pool.num_free == cached.cache.pool.num_pages


def test_offline_context_question_reuses_the_context(model_path: Path) -> None:
    llm = LLM(model_path, dtype=torch.float32, num_pages=2048, page_size=4, enable_prefix_caching=True)
    context = tokens(llm.engine, 3, 60)
    prompts = [ContextQuestion(context, tokens(llm.engine, 20 + i, 5)) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), policy="snapkv")
    assert outs[0].cached_tokens == 0  # the first compresses the context itself
    again = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), policy="snapkv")
    assert [o.cached_tokens for o in again] == [60, 60, 60]
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]
    # Another policy (or other parameters) is another key.
    other = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), policy="h2o")
    assert other[0].cached_tokens == 0


def test_no_boundary_no_cache(model_path: Path) -> None:
    engine = engine_for(model_path, True)
    prompt = tokens(engine, 4, 40)
    for compress_after in (None, 40):  # no question after the context: nothing compressed to share
        run_all(engine, [engine.add_request(prompt, GREEDY, policy="snapkv", compress_after=compress_after)])
    store = engine.runner.prefix_store
    assert store is not None and not store.entries
    # Without a policy nothing is compressed: the finished request stays whole, reusable from position 0 on.
    run_all(engine, [engine.add_request(prompt, GREEDY, policy="full", compress_after=20)])
    [entry] = store.entries.values()
    assert entry.boundary == 0 and entry.truncatable and entry.length == len(prompt) + GREEDY.max_tokens - 1
    with pytest.raises(ValueError, match="max_cached_prefixes"):
        engine_for(model_path, True, max_cached_prefixes=0)


def test_cached_prefixes_go_before_any_preemption(model_path: Path) -> None:
    engine = engine_for(model_path, True, num_pages=260)
    store = engine.runner.prefix_store
    assert store is not None
    for c in range(6):  # six contexts, each cached after its request finished
        context = tokens(engine, 100 + c, 48)
        run_all(engine, [engine.add_request([*context, 5, 6], GREEDY, policy="snapkv", compress_after=48)])
    held = store.pages_held()
    assert len(store.entries) == 6 and held == engine.cache.pool.num_used
    # A long uncompressed request needs more than is free: the store gives pages back, nobody is preempted.
    big = engine.add_request(tokens(engine, 7, 200), SamplingParams(max_tokens=30, ignore_eos=True), policy="full")
    out = run_all(engine, [big])[big]
    assert out.num_preemptions == 0 and store.evicted > 0  # type: ignore[attr-defined]
    assert engine.cache.pool.num_used == store.pages_held()


def test_thousands_of_attach_and_evict_cycles_conserve_pages() -> None:
    """Store / attach / write / finish / evict at random on the cache alone; conservation after each."""
    rng = random.Random(0)
    layers, heads, page = 2, 2, 4
    cache = PagedKVCache(layers, heads, 4, num_pages=400, page_size=page, max_requests=12, dtype=torch.float32)
    store = PrefixStore(cache, "model", capacity=4)
    policy = make_policy("snapkv", 0.5)
    contexts = [[rng.randrange(3, 50) for _ in range(rng.randint(4, 20))] for _ in range(6)]
    live: dict[str, Request] = {}
    for step in range(2000):
        op = rng.choice(["new", "new", "write", "finish", "evict"])
        if op == "new" and len(live) < 8:
            ctx = rng.choice(contexts)
            req = Request(f"r{step}", [*ctx, 1, 2], SamplingParams(), compress_after=len(ctx), policy=policy)
            attachment = store.attach(req)
            if attachment is not None:  # seated as the runner seats it
                req.seat.row, req.seat.prefix_lease, req.seat.num_processed = (
                    attachment.row,
                    attachment.lease,
                    attachment.length,
                )
            else:
                req.seat.row = cache.add_request(req.request_id)
                cache.append_slots([req.seat.row], torch.arange(len(ctx)).view(1, -1))
                if rng.random() < 0.5:  # a compression: drop a random subset
                    keep = torch.rand(layers, heads, len(ctx)) < 0.6
                    cache.apply_keep_plan(req.request_id, KeepPlan.from_mask(keep))
                req.seat.num_processed = len(ctx)
                store.store(req)
            live[req.request_id] = req
        elif op == "write" and live:
            req = live[rng.choice(sorted(live))]
            cache.append_slots([req.seat.row], torch.tensor([[req.seat.num_processed]]))
            req.seat.num_processed += 1
        elif op == "finish" and live:
            req = live.pop(rng.choice(sorted(live)))
            cache.free_request(req.request_id)
            if req.seat.prefix_lease is not None:
                req.seat.prefix_lease.release()
        elif op == "evict":
            in_use = {k for k, e in store.entries.items() if e.users}
            store.evict_one()
            assert in_use <= set(store.entries), "an entry in use was evicted"
        users = {}
        for req in live.values():
            if req.seat.prefix_lease is not None:
                users[req.seat.prefix_lease.key] = users.get(req.seat.prefix_lease.key, 0) + 1
        assert {k: e.users for k, e in store.entries.items() if e.users} == users
        tables = cache.block_tables
        held = torch.arange(tables.shape[-1]) < ((cache.seq_lens.to(torch.int64) + page - 1) // page).unsqueeze(-1)
        refs = torch.bincount(tables[held].to(torch.int64), minlength=cache.pool.num_pages).to(torch.int32)
        assert torch.equal(cache.pool.refcounts(), refs)
    for req in live.values():
        cache.free_request(req.request_id)
        if req.seat.prefix_lease is not None:
            req.seat.prefix_lease.release()
    store.clear()
    assert not store.entries and cache.pool.num_free == cache.pool.num_pages


@pytest.mark.parametrize("name", ["snapkv", "kvzip", "h2o"])
def test_a_question_after_its_compressed_context_runs_as_one_chunk(
    model_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question tokens after compression take one prefill chunk over the compressed cache, not one decode
    step each, with the same tokens and log-probabilities; a policy that acts at every decode step (H2O) keeps
    the steps."""
    policy = make_policy(name, budgets_for(name, (0.3,))[0])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)

    config = engine_for(model_path, False).config

    def run(chunked: bool) -> tuple[object, int]:
        engine = engine_for(model_path, False)
        if not chunked:
            monkeypatch.setattr(engine.runner, "runs_tail_as_chunk", lambda request: False)
        prompt = tokens(engine, 1, CONTEXT) + tokens(engine, 2, 30)
        request_id = engine.add_request(prompt, params, policy=policy, compress_after=CONTEXT)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished and out.request_id == request_id:
                    result = out
        return result, steps

    chunked, chunked_steps = run(True)
    stepped, stepped_steps = run(False)
    assert chunked.output_token_ids == stepped.output_token_ids  # type: ignore[attr-defined]
    for got, want in zip(chunked.logprobs, stepped.logprobs, strict=True):  # type: ignore[attr-defined]
        assert got.logprob == pytest.approx(want.logprob, abs=logprob_atol(torch.float32, config, want.logprob))
    if name == "h2o":
        assert chunked_steps == stepped_steps
    else:
        assert stepped_steps - chunked_steps == 30 - 1  # 30 question tokens: 30 decode steps became one chunk


# ------------------------------------------------------------------------ exact reuse of uncompressed caches


def test_uncompressed_prompts_reuse_every_shared_token_by_default(model_path: Path) -> None:
    """Without a policy nothing is compressed, so a finished request's cache is exact for any later prompt
    that shares a page or more of its tokens: in the default (named) matching mode, with no context named.
    The outputs and log-probabilities equal a run without the cache; the reuse shows in `cached_tokens`."""
    cached, fresh = engine_for(model_path, True), engine_for(model_path, False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    system = tokens(cached, 0, 50)  # a shared system prompt of 12.5 pages of 4 tokens
    prompts = [
        system + tokens(cached, 1, 9),
        system + tokens(cached, 2, 9),  # diverges after the system prompt: attaches at 50, mid-page
        system + tokens(cached, 1, 9)[:5] + tokens(cached, 3, 4),  # shares 55 tokens with the first
        tokens(cached, 4, 30),  # shares nothing
    ]
    got, alone = [], []
    for prompt in prompts:  # one after the other: each finds the caches of those before it
        got.append(run_all(cached, [rid := cached.add_request(prompt, params)])[rid])
        alone.append(run_all(fresh, [rid := fresh.add_request(prompt, params)])[rid])
    assert [o.cached_tokens for o in got] == [0, 50, 55, 0]  # type: ignore[attr-defined]
    for g, a in zip(got, alone, strict=True):
        assert g.output_token_ids == a.output_token_ids  # type: ignore[attr-defined]
        for g_step, a_step in zip(g.logprobs, a.logprobs, strict=True):  # type: ignore[attr-defined]
            tolerance = logprob_atol(torch.float32, cached.config, a_step.logprob)
            assert g_step.logprob == pytest.approx(a_step.logprob, abs=tolerance)
    # A compressing request never starts from an uncompressed entry (another policy is another namespace).
    snap = run_all(cached, [rid := cached.add_request(prompts[0], params, policy="snapkv")])[rid]
    assert snap.cached_tokens == 0  # type: ignore[attr-defined]
    # Prompt log-probabilities come from the prefill: such a request computes its prompt.
    with_prompt_logprobs = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    out = run_all(cached, [rid := cached.add_request(prompts[0], with_prompt_logprobs)])[rid]
    assert out.cached_tokens == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", [*POLICIES, "wgkv"])
def test_compressing_requests_read_the_exact_prefix_their_policy_does_not_need(model_path: Path, name: str) -> None:
    """A compressing request keeps its exact prompt just before it compresses, and a later compressing request
    sharing a system prompt reads those tokens up to the first position its policy needs its own prefill to
    compute (`KVPolicy.reusable_prefix`: the observation window's start; 0 for statistics over every token).
    Its tokens and kept entries then equal a fresh engine's whose prefill is cut into chunks at the same token."""
    if name == "wgkv":
        write_random_gates(model_path)  # beside the model, where the engine looks
    policy = make_policy(name, budgets_for(name, (0.3,))[0])
    cached = engine_for(model_path, True, exact_prompt_reuse=True)
    system = tokens(cached, 0, 50)  # a shared system prompt of 12.5 pages of 4 tokens
    first, second = system + tokens(cached, 1, 20), system + tokens(cached, 2, 20)
    run_all(cached, [rid := cached.add_request(first, GREEDY, policy=policy)])
    store = cached.runner.prefix_store
    assert store is not None
    resolved = load_policy(policy)
    assert resolved is not None
    reads = min(50, resolved.reusable_prefix(len(second)))
    if name == "wgkv":  # its gates decide admission as the prefill writes: nothing exact to keep or read
        assert not store.entries and reads == 0
    else:
        [exact] = [e for e in store.entries.values() if e.boundary == 0]
        assert exact.length == len(first)  # the prompt as the prefill left it, before the compaction
    got = run_all(cached, [rid := cached.add_request(second, GREEDY, policy=policy)])[rid]
    expected_reads = reads if reads >= 4 else 0  # a page at least
    assert got.cached_tokens == expected_reads, name  # type: ignore[attr-defined]
    fresh = engine_for(model_path, False, max_num_batched_tokens=expected_reads or 2048)
    alone = run_all(fresh, [rid := fresh.add_request(second, GREEDY, policy=policy)])[rid]
    assert got.output_token_ids == alone.output_token_ids, name  # type: ignore[attr-defined]
    at_compression = got.kv.kept_at_compression.positions  # type: ignore[attr-defined]
    assert torch.equal(at_compression, alone.kv.kept_at_compression.positions), name  # type: ignore[attr-defined]
    store.clear()
    assert cached.cache.pool.num_free == cached.cache.pool.num_pages


def test_exact_prompts_of_compressing_requests_never_make_a_request_wait_or_fail(model_path: Path) -> None:
    """Keeping each compressing request's exact prompt costs the pages its compaction copies; in a pool that
    holds two prompts, unrelated and related prompts run one after the other with no preemption and no failure
    (entries are evicted instead, also in the middle of a compaction), and every page comes back."""
    engine = engine_for(model_path, True, exact_prompt_reuse=True, num_pages=160, max_cached_prefixes=8)
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    per_request = layers * heads * -(-(60 + 6) // 4)
    assert 2 * per_request <= engine.cache.pool.num_pages < 3 * per_request
    system = tokens(engine, 200, 40)
    prompts = [tokens(engine, 100 + seed, 60) for seed in range(3)] + [
        system + tokens(engine, 300 + seed, 36) for seed in range(3)
    ]
    store = engine.runner.prefix_store
    assert store is not None
    reused = []
    for prompt in prompts:
        out = run_all(engine, [rid := engine.add_request(prompt, GREEDY, policy="snapkv")])[rid]
        assert out.finish_reason == "length" and out.num_preemptions == 0  # type: ignore[attr-defined]
        reused.append(out.cached_tokens)  # type: ignore[attr-defined]
    assert reused[:4] == [0, 0, 0, 0] and reused[4:] == [40, 40]  # the system prompt, a multiple of the page
    assert store.evicted >= 2
    ids = [engine.add_request(prompt, GREEDY, policy="snapkv") for prompt in prompts[3:]]  # at once, under pressure
    outs = run_all(engine, ids)
    assert all(o.finish_reason == "length" for o in outs.values())  # type: ignore[attr-defined]
    store.clear()
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_a_compaction_without_room_for_its_copies_drops_the_exact_prompt_it_shares(model_path: Path) -> None:
    """In a pool with room for one prompt and little more, the exact prompt kept just before compression leaves
    no room for the pages the compaction copies; the entry is dropped instead and the request compresses in
    place, as it would without the store."""
    engine = engine_for(model_path, True, exact_prompt_reuse=True, num_pages=64)  # the prompt takes 60
    out = run_all(engine, [rid := engine.add_request(tokens(engine, 9, 60), GREEDY, policy="snapkv")])[rid]
    assert out.finish_reason == "length"  # type: ignore[attr-defined]
    store = engine.runner.prefix_store
    assert store is not None and store.stored == 1 and store.evicted == 1 and not store.entries
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_a_lease_holds_its_entry_until_it_is_released_once(model_path: Path) -> None:
    """An entry with a live lease is never evicted; a lease ends once however often it is released, and an
    attach that cannot be made releases the lease it was given."""
    engine = engine_for(model_path, True)
    run_all(engine, [engine.add_request(tokens(engine, 5, 40), GREEDY)])  # `full`: its cache stays as an entry
    store = engine.runner.prefix_store
    assert store is not None and store.lease("no such key") is None
    [entry] = store.entries.values()
    lease = store.lease(entry.key)
    assert lease is not None and entry.users == 1
    assert store.evict_one() is None  # leased
    lease.release()
    lease.release()
    assert entry.users == 0 and not lease.live
    lease = store.lease(entry.key)
    assert lease is not None
    other = engine.runner.new_request("other", tokens(engine, 6, 40), GREEDY, None, max_model_len=512)
    assert store.attach_at(other, lease, 20) is None  # the entry does not hold its tokens
    assert not lease.live and entry.users == 0 and other.seat.prefix_lease is None
    assert store.evict_one() is not None and engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_uncompressed_sessions_give_their_pages_back_before_a_request_waits(model_path: Path) -> None:
    """Finished requests' caches are memory nobody needs: a request that would not fit beside them evicts
    them, least recently used first, instead of waiting; the pool's pages are conserved throughout."""
    engine = engine_for(model_path, True, num_pages=160, max_cached_prefixes=8)
    layers, heads = engine.config.num_hidden_layers, engine.config.num_key_value_heads
    per_request = layers * heads * -(-(60 + 6) // 4)  # pages a 60-token prompt and 6 tokens hold uncompressed
    assert 2 * per_request <= engine.cache.pool.num_pages < 3 * per_request
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for seed in range(4):  # four unrelated prompts, one after the other: each needs the pages of the oldest
        out = run_all(engine, [rid := engine.add_request(tokens(engine, 100 + seed, 60), params)])[rid]
        assert out.finish_reason == "length" and out.num_preemptions == 0  # type: ignore[attr-defined]
    store = engine.runner.prefix_store
    assert store is not None and store.evicted >= 2 and len(store.entries) <= 2
    store.clear()
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_a_request_that_outgrows_the_pool_beside_its_entry_ends_with_length(model_path: Path) -> None:
    """A request attached to a finished request's cache that alone outgrows the pool is preempted; it
    recomputes instead of attaching again (which would pin the entry beside it, and preempt it again, with
    no end), so it ends with "length" and every page comes back."""
    engine = engine_for(model_path, True, num_pages=160)  # 40 pages of 4 tokens per (layer, KV head)
    prompt = tokens(engine, 7, 60)
    run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    rid = engine.add_request([*prompt, 5], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    finished = None
    for _ in range(2000):  # far more steps than 160 tokens take; a livelock would run out of them
        finished = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
        if finished is not None:
            break
    assert finished is not None and finished.finish_reason == "length"
    assert finished.num_preemptions >= 1  # type: ignore[attr-defined]
    assert 61 + len(finished.output_token_ids) - 1 <= 160
    engine.runner.prefix_store.clear()  # type: ignore[union-attr]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages
