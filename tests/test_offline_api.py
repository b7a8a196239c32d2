"""The offline API compresses after a prefix and returns what each (layer, KV head) kept, as the benches do."""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_utils import tiny_model, write_gguf
from model_utils import held_sets, run_recording, write_suite_model

from vllm_kvpress_ext.engine import LLM, ContextQuestion, RequestRejectedError, SamplingParams
from vllm_kvpress_ext.hub import catalog
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.models.write_gate import WriteGates
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY

CONTEXT, QUESTION = 60, 12
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
KEPT = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_kept=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = write_suite_model(tmp_path_factory.mktemp("offline-api"), std=0.3)
    return LLM(path, dtype=torch.float32, num_pages=1024, page_size=4, max_num_batched_tokens=32)


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, len(VOCABULARY)) for _ in range(n)]


@pytest.mark.parametrize(
    ("policy", "evicts_in_decode"),
    [("snapkv", False), ("pyramidkv", False), ({"name": "streaming_llm", "ratio": 0.3}, True)],
    ids=str,
)
def test_context_question_keeps_what_the_bench_route_keeps(llm: LLM, policy: Any, evicts_in_decode: bool) -> None:
    pairs = [(token_ids(CONTEXT, s), token_ids(QUESTION, 100 + s)) for s in range(2)]
    outputs = llm.generate([ContextQuestion(c, q) for c, q in pairs], KEPT, policy=policy)
    # The benches' route: the step API with `compress_after`, positions read by a finish hook.
    for (context, question), out in zip(pairs, outputs, strict=True):
        (bench,) = run_recording(llm.engine, [context + question], GREEDY, policy=policy, compress_after=CONTEXT)
        assert out.kv.kept is not None
        assert out.output_token_ids == bench.output.output_token_ids
        assert held_sets(out.kv.kept) == bench.held
        assert not out.kv.kept.mask(CONTEXT).all()
        if not evicts_in_decode:  # compressed once, the context only: every question token is still held
            assert out.kv.kept.mask(CONTEXT + QUESTION)[..., CONTEXT:].all()
        # Right after compression the cache held the compressed context only: what a request whose prompt
        # is the context alone holds when it finishes after one token (that token is never written).
        at_compression = out.kv.kept_at_compression
        assert at_compression is not None
        (alone,) = run_recording(llm.engine, [context], SamplingParams(max_tokens=1), policy=policy)
        assert held_sets(at_compression) == alone.held
        if not evicts_in_decode:
            assert torch.equal(at_compression.mask(CONTEXT), out.kv.kept.mask(CONTEXT))
    # A per-prompt `compress_after` on plain token ids is the same request.
    plain = llm.generate([c + q for c, q in pairs], KEPT, compress_after=[CONTEXT, CONTEXT], policy=policy)
    for a, b in zip(outputs, plain, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.kv.kept is not None and b.kv.kept is not None
        assert torch.equal(a.kv.kept.positions, b.kv.kept.positions)
    assert llm.engine.cache.pool.num_used == 0


def test_text_parts_are_tokenised_separately(llm: LLM) -> None:
    words = [w for w in VOCABULARY if w.isalpha()]
    context = " ".join(random.Random(0).choice(words) for _ in range(40))
    question = " " + " ".join(random.Random(1).choice(words) for _ in range(8))
    tokenizer = llm.tokenizer
    context_ids = list(tokenizer(context)["input_ids"])
    question_ids = list(tokenizer(question, add_special_tokens=False)["input_ids"])
    (text,) = llm.generate(ContextQuestion(context, question), KEPT, policy="snapkv")
    (ids,) = llm.generate(context_ids + question_ids, KEPT, compress_after=len(context_ids), policy="snapkv")
    assert text.prompt_token_ids == context_ids + question_ids
    assert text.output_token_ids == ids.output_token_ids
    assert text.kv.kept is not None and ids.kv.kept is not None
    assert torch.equal(text.kv.kept.positions, ids.kv.kept.positions)


def test_an_empty_question_compresses_after_the_whole_prompt(llm: LLM) -> None:
    prompt = token_ids(CONTEXT, 7)
    (pair,) = llm.generate(ContextQuestion(prompt), KEPT, policy="snapkv")
    (plain,) = llm.generate(prompt, KEPT, policy="snapkv")
    assert pair.output_token_ids == plain.output_token_ids
    assert pair.kv.kept is not None and plain.kv.kept is not None
    assert torch.equal(pair.kv.kept.positions, plain.kv.kept.positions)


def test_kept_entries_are_the_cache_positions_at_finish_and_counts_add_up(llm: LLM) -> None:
    engine = llm.engine
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(request: Any) -> None:
        seen[request.request_id] = engine.cache.entry_positions(request.request_id)

    engine.finish_hooks.append(record)
    try:
        outputs = llm.generate([token_ids(n, n) for n in (30, 70)], KEPT, policy="adakv")
    finally:
        engine.finish_hooks.remove(record)
    for out in outputs:
        kept = out.kv.kept
        assert kept is not None
        positions, lengths = seen[out.request_id]
        assert torch.equal(kept.positions, positions) and torch.equal(kept.lengths, lengths)
        assert kept.ring_positions.shape[-1] == 0
        assert kept.counts.tolist() == out.kv.kept_per_head
        assert kept.per_layer == [sum(heads) for heads in out.kv.kept_per_head]
        assert kept.total == sum(kept.per_layer) == out.kv.tokens_kept
        assert all(len(kept.head(l, h)) == kept.counts[l, h] for l in range(2) for h in range(2))  # noqa: E741


def test_kept_entries_include_the_local_ring(llm: LLM, tmp_path: Path) -> None:
    config = load_config(llm.engine.model_dir)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    with torch.no_grad():  # admit nothing: only the ring's last 8 tokens stay
        gates.w2.zero_()
        gates.b2.fill_(-20.0)
    path = gates.save(tmp_path / "closed.wgkv.safetensors", {"local_window": 8})
    n = 40
    (out,) = llm.generate(token_ids(n, 3), KEPT, policy={"name": "wgkv", "gates": str(path)})
    kept = out.kv.kept
    assert kept is not None
    decoded = KEPT.max_tokens - 1  # the last sampled token is never written
    assert kept.ring_positions.shape == (2, 2, 8)
    assert kept.head(0, 0) == list(range(n + decoded - 8, n + decoded))
    assert kept.counts.tolist() == out.kv.kept_per_head and kept.total == out.kv.tokens_kept


def test_positions_are_only_returned_when_asked(llm: LLM) -> None:
    (out,) = llm.generate(token_ids(20, 1), GREEDY, policy="snapkv")
    assert out.kv.kept is None and out.kv.kept_at_compression is None
    (full,) = llm.generate(token_ids(20, 1), KEPT, policy="full")  # nothing compressed: no compression snapshot
    assert full.kv.kept is not None and full.kv.kept_at_compression is None
    assert full.kv.kept.total == full.kv.tokens_full


@pytest.mark.parametrize(
    ("prompts", "compress_after", "error", "message"),
    [
        ([1, 2, 3], 4, RequestRejectedError, r"compress_after must lie in \[1, 3\], got 4"),
        ([1, 2, 3], 0, RequestRejectedError, r"compress_after must lie in \[1, 3\], got 0"),
        ([1, 2, 3], -1, RequestRejectedError, r"compress_after must lie in \[1, 3\], got -1"),
        ([1, 2, 3], 2.5, TypeError, "compress_after must be an integer, None or a sequence of them, got 2.5"),
        ([[1, 2, 3]], [2.5], TypeError, "compress_after must be an integer or None, got 2.5"),
        ([1, 2, 3], True, TypeError, "compress_after must be an integer or None, got True"),
        ([1, 2, 3], "2", TypeError, "compress_after must be an integer, None or a sequence of them"),
        ([[1, 2], [3, 4]], [1], ValueError, "1 compress_after values for 2 prompts"),
        (ContextQuestion([1, 2], [3]), 1, ValueError, "a ContextQuestion sets its own compression point"),
        ([[1, 2], 3.5], None, TypeError, "a prompt must be a string, a list of token ids or a ContextQuestion"),
        ([[1, 2], [True]], None, TypeError, "a prompt must be a string, a list of token ids or a ContextQuestion"),
    ],
)
def test_bad_inputs_are_rejected_before_anything_runs(
    llm: LLM, prompts: Any, compress_after: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, compress_after=compress_after, policy="snapkv")
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_a_rejected_prompt_takes_the_batch_back(llm: LLM) -> None:
    with pytest.raises(RequestRejectedError, match="compress_after must lie in"):
        llm.generate([[5, 6, 7], [5, 6]], GREEDY, compress_after=[2, 3], policy="snapkv")
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.cache.pool.num_used == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"context": []}, ValueError, "the context is empty"),
        ({"context": ""}, ValueError, "the context is empty"),
        ({"context": 3}, TypeError, "context must be a string or a list of token ids, got int"),
        ({"context": [1, "a"]}, TypeError, "context must be a string or a list of token ids, got list"),
        ({"context": [1], "question": None}, TypeError, "question must be a string or a list of token ids"),
    ],
)
def test_context_question_checks_its_parts(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ContextQuestion(**kwargs)


def test_return_kept_and_mask_check_their_arguments(llm: LLM) -> None:
    with pytest.raises(ValueError, match="return_kept must be True or False, got 'yes'"):
        SamplingParams(return_kept="yes")  # type: ignore[arg-type]
    (out,) = llm.generate(token_ids(10, 2), KEPT)
    assert out.kv.kept is not None
    with pytest.raises(ValueError, match="length must be an integer >= 0, got -1"):
        out.kv.kept.mask(-1)


def test_a_catalog_name_works_where_a_model_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM("smollm2-135m")` as the README promises: a catalog entry resolves to its cached GGUF file
    (here a tiny one registered for the test, already in the cache, so nothing is downloaded)."""
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    source = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", seed=5), "llama")
    data = source.read_bytes()
    entry = catalog.CatalogModel(
        name="tiny-catalog-test",
        file_name="tiny.gguf",
        parts=(catalog.WheelFile("llm-tiny-catalog-test", "0.0.0", "llm_tiny_catalog_test/tiny.gguf"),),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        description="test model",
        license="none",
    )
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    cached = catalog.cached_path(entry)
    cached.parent.mkdir(parents=True)
    shutil.copyfile(source, cached)
    by_name = LLM(entry.name, dtype=torch.float32, num_pages=256)
    by_path = LLM(cached, dtype=torch.float32, num_pages=256)
    assert by_name.engine.model_dir == cached
    prompt = [[1, 5, 9, 13, 17, 21]]
    assert by_name.generate(prompt, GREEDY)[0].output_token_ids == by_path.generate(prompt, GREEDY)[0].output_token_ids
