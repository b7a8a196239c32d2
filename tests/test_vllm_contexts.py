"""Named contexts on vLLM's runner (`kv_prefix_tokens`, vllm_plugin/contexts.py): a context is compressed once,
without its question, and every request that starts with it reads its question from the compressed cache.

The reference is the embedded engine's run of the same (context, question) with the same policy
(`ContextQuestion`: its policy compresses at the context's end, then the question runs over the compressed
cache): the entries each (layer, KV head) keeps, the greedy tokens and the figures must be the same, whether
the context was built for this request or stored by an earlier one, and whichever requests share it.
"""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import held_sets, write_suite_gemma3, write_suite_model
from vllm import LLM as VllmLLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_utils import assert_no_page_leaked, in_process_engine, in_process_worker, vllm_runner_llm

from vllm_kvpress_ext.engine import LLM, ContextQuestion, SamplingParams
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.policies.base import PolicyConfigError
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY
from vllm_kvpress_ext.vllm_plugin.chat_context import context_policy_setting
from vllm_kvpress_ext.vllm_plugin.contexts import CONTEXT_FIELD, ContextError, check_context

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

PAGE_SIZE = 16
NEW_TOKENS = 6
CONTEXT = 90  # not a whole number of pages: the stored row's last pages are partly filled (copy-on-write)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("contexts"), hidden=64, std=0.3)


@pytest.fixture(scope="module")
def embedded(model: Path) -> LLM:
    return LLM(model, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE)


def native_llm(model: Path, num_pages: int = 2048) -> VllmLLM:
    return vllm_runner_llm(model, num_pages)  # prefix caching on, as by default: contexts are kept


@pytest.fixture(scope="module")
def native(model: Path) -> Iterator[VllmLLM]:
    llm = native_llm(model)
    yield llm
    del llm
    gc.collect()


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, len(VOCABULARY)) for _ in range(count)]


def vllm_params(spec: Any, boundary: int | None, **extra: Any) -> VllmSamplingParams:
    args: dict[str, Any] = {"kv_policy": json.dumps(spec) if isinstance(spec, dict) else spec}
    if boundary is not None:
        args[CONTEXT_FIELD] = boundary
    return VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args=args, **extra)


def embedded_runs(embedded: LLM, context: list[int], questions: list[list[int]], spec: Any) -> list[Any]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_kept=True)
    return embedded.generate([ContextQuestion(context, q) for q in questions], params, policy=spec)


@pytest.mark.parametrize(
    "spec",
    [{"name": "snapkv", "ratio": 0.25}, {"name": "kvzip", "ratio": 0.25}, {"name": "adakv", "ratio": 0.3}, "xkv"],
    ids=["snapkv", "kvzip", "adakv", "xkv"],
)
def test_each_question_reads_the_context_compressed_once_as_the_embedded_engine_does(
    embedded: LLM, native: VllmLLM, spec: Any
) -> None:
    """Three questions about one context, one after the other: the first builds the context, the others find it
    stored. Each keeps the embedded engine's entries and gives its tokens and figures; vLLM counts the context's
    tokens cached for the later two; one context is stored, and no page is leaked."""
    context = tokens(1, CONTEXT)
    questions = [tokens(10 + i, 7 + 5 * i) for i in range(3)]
    ours = embedded_runs(embedded, context, questions, spec)
    pool = in_process_worker(native).model_runner.pool
    assert pool.contexts is not None
    stored, hits = pool.contexts.stored, pool.contexts.hits
    pool.kept_at_compression = {}
    theirs = [
        native.generate([{"prompt_token_ids": context + q}], vllm_params(spec, CONTEXT), use_tqdm=False)[0]
        for q in questions
    ]
    (built,) = pool.kept_at_compression.values()  # one compression: the context's build
    for index, (mine, output) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.kv.kept_at_compression is not None
        assert held_sets(built) == held_sets(mine.kv.kept_at_compression)
        assert list(output.outputs[0].token_ids) == mine.output_token_ids
        assert output.num_cached_tokens == (CONTEXT if index else 0)  # the first computed it, through the build
        figures = output.kv_transfer_params["kvpress"]
        assert figures["kv_tokens_kept"] == mine.kv.tokens_kept and figures["kv_tokens_full"] == mine.kv.tokens_full
    assert pool.contexts.stored == stored + 1 and pool.contexts.hits == hits + 2  # the first waited for the build
    assert_no_page_leaked(pool)


def test_requests_sharing_a_context_in_one_batch_wait_for_one_build(embedded: LLM, native: VllmLLM) -> None:
    """Four requests naming the same context at once (and one naming another): one build per context, every
    request attached to its context, the embedded engine's tokens for each."""
    spec = {"name": "snapkv", "ratio": 0.25}
    context, other = tokens(2, CONTEXT), tokens(3, 70)
    questions = [tokens(20 + i, 5 + i) for i in range(4)]
    ours = embedded_runs(embedded, context, questions, spec) + embedded_runs(embedded, other, questions[:1], spec)
    pool = in_process_worker(native).model_runner.pool
    stored_before = pool.contexts.stored
    prompts = [{"prompt_token_ids": context + q} for q in questions] + [{"prompt_token_ids": other + questions[0]}]
    params = [vllm_params(spec, CONTEXT)] * 4 + [vllm_params(spec, 70)]
    theirs = native.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in theirs] == [m.output_token_ids for m in ours]
    assert [o.num_cached_tokens for o in theirs] == [0] * 5  # each waited for its context's build
    assert pool.contexts.stored - stored_before == 2
    scheduler = native.llm_engine.engine_core.engine_core.scheduler
    assert not scheduler.context_builds and not pool.context_builds and not pool.held_contexts
    assert_no_page_leaked(pool)


def test_a_context_is_never_read_under_other_policy_parameters(native: VllmLLM) -> None:
    """The same context under SnapKV at 0.25 and at 0.5: two contexts built, neither read by the other."""
    pool = in_process_worker(native).model_runner.pool
    stored = pool.contexts.stored
    context = tokens(7, CONTEXT)
    cached = []
    for index, ratio in enumerate((0.25, 0.5, 0.25, 0.5)):
        params = vllm_params({"name": "snapkv", "ratio": ratio}, CONTEXT)
        output = native.generate([{"prompt_token_ids": context + tokens(40 + index, 6)}], params, use_tqdm=False)
        cached.append(output[0].num_cached_tokens)
    assert cached == [0, 0, CONTEXT, CONTEXT]
    assert pool.contexts.stored == stored + 2


def test_a_request_without_a_policy_ignores_its_context(native: VllmLLM) -> None:
    """`full` has nothing to compress: the boundary changes nothing (as in `kvpress serve`), and no context is
    built."""
    pool = in_process_worker(native).model_runner.pool
    stored = pool.contexts.stored
    prompt = tokens(4, 60)
    plain = native.generate([{"prompt_token_ids": prompt}], vllm_params("full", None), use_tqdm=False)[0]
    named = native.generate([{"prompt_token_ids": prompt}], vllm_params("full", 40), use_tqdm=False)[0]
    assert list(named.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert pool.contexts.stored == stored


@pytest.mark.parametrize(
    ("boundary", "spec", "extra", "message"),
    [
        (96, "snapkv", {}, "must be in \\[1, 95\\]"),
        (0, "snapkv", {}, "must be in \\[1, 95\\]"),
        (-3, "snapkv", {}, "must be in \\[1, 95\\]"),
        ("40", "snapkv", {}, "must be an integer"),
        (True, "snapkv", {}, "must be an integer"),
        (40, "h2o", {}, "decode steps"),
        (40, "snapkv", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_a_context_the_server_cannot_serve_is_refused_by_name(
    native: VllmLLM, boundary: Any, spec: str, extra: dict[str, Any], message: str
) -> None:
    params = vllm_params(spec, None, **extra)
    assert params.extra_args is not None
    params.extra_args[CONTEXT_FIELD] = boundary
    with pytest.raises(VLLMValidationError, match=message) as refused:
        native.generate([{"prompt_token_ids": tokens(5, 96)}], params, use_tqdm=False)
    assert refused.value.parameter == CONTEXT_FIELD


def test_contexts_need_prefix_caching_and_a_policy_each_runner_serves() -> None:
    """Both runners keep named contexts with prefix caching on; vLLM's runner cannot run a question as decode
    steps (H2O), the plugin's own can; a write gate's context is never kept."""
    snapkv, h2o = load_policy("snapkv"), load_policy("h2o")
    args = {CONTEXT_FIELD: 10}
    common = {"prompt_logprobs": False}
    with pytest.raises(ContextError, match="prefix caching"):
        check_context(args, 20, snapkv, runner="vllm", enabled=False, **common)
    with pytest.raises(ContextError, match="decode steps"):
        check_context(args, 20, h2o, runner="vllm", enabled=True, **common)
    for runner in ("vllm", "project"):
        with pytest.raises(ContextError, match="write gate"):
            check_context(args, 20, load_policy("wgkv"), runner=runner, enabled=True, **common)
        check_context(args, 20, snapkv, runner=runner, enabled=True, **common)
    check_context(args, 20, h2o, runner="project", enabled=True, **common)
    check_context(args, 20, None, runner="vllm", enabled=False, **common)  # full: nothing to compress


def test_stored_contexts_give_their_pages_up_before_a_request_fails(model: Path) -> None:
    """A pool with room for about two uncompressed prompts: contexts stored by earlier requests are dropped,
    least recently used first, for later requests, which all finish."""
    llm = native_llm(model, num_pages=2 * 2 * 2 * 16)  # 2 layers x 2 KV heads x 16 pages: 256 tokens each
    try:
        pool = in_process_worker(llm).model_runner.pool
        spec = {"name": "snapkv", "ratio": 0.25}
        for seed in range(6):
            output = llm.generate(
                [{"prompt_token_ids": tokens(100 + seed, 200) + tokens(seed, 8)}],
                vllm_params(spec, 200),
                use_tqdm=False,
            )[0]
            assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == NEW_TOKENS
        assert pool.contexts.evicted > 0
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_a_full_store_drops_a_context_only_waiting_requests_want_and_builds_it_again(
    embedded: LLM, model: Path
) -> None:
    """One request at a time and room for two stored contexts; three requests naming three contexts at once. The
    third build finds both stored contexts held for requests still waiting: the older is dropped for it, and its
    request has it built again. Every request gets the embedded engine's tokens, and no page is leaked."""
    spec = {"name": "snapkv", "ratio": 0.25}
    contexts = [tokens(200 + i, CONTEXT) for i in range(3)]
    questions = [tokens(210 + i, 6) for i in range(3)]
    ours = [embedded_runs(embedded, c, [q], spec)[0] for c, q in zip(contexts, questions, strict=True)]
    llm = vllm_runner_llm(model, 2048, {"kv_max_cached_prefixes": 1}, max_num_seqs=1)
    try:
        pool = in_process_worker(llm).model_runner.pool
        assert pool.contexts.capacity == 2  # max_num_seqs + 1
        drops: list[int] = []
        drop = pool._drop_a_held_context

        def counted_drop() -> None:
            drops.append(len(pool.held_contexts))
            drop()

        pool._drop_a_held_context = counted_drop
        theirs = llm.generate(
            [{"prompt_token_ids": c + q} for c, q in zip(contexts, questions, strict=True)],
            [vllm_params(spec, CONTEXT)] * 3,
            use_tqdm=False,
        )
        assert [list(o.outputs[0].token_ids) for o in theirs] == [m.output_token_ids for m in ours]
        assert drops and all(held == 2 for held in drops)  # both stored contexts held, none seated
        assert pool.contexts.stored == 3 + len(drops)  # each dropped context was built again
        assert not pool.held_contexts and not pool.context_builds
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_requests_held_for_a_build_that_stores_nothing_fail_and_the_server_goes_on(model: Path) -> None:
    """A build whose compressed context is not stored (here: the store refuses it): the two requests held for
    it end with an error instead of waiting forever, nothing they held is leaked, and the next request runs."""
    llm = native_llm(model)
    try:
        pool = in_process_worker(llm).model_runner.pool
        pool._keep_context = lambda request_id, seat: None
        spec = {"name": "snapkv", "ratio": 0.25}
        context = tokens(300, CONTEXT)
        held = llm.generate(
            [{"prompt_token_ids": context + tokens(301 + i, 5)} for i in range(2)],
            [vllm_params(spec, CONTEXT)] * 2,
            use_tqdm=False,
        )
        assert [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in held] == [("error", [])] * 2
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert not scheduler.context_builds and scheduler.get_num_unfinished_requests() == 0
        (after,) = llm.generate([{"prompt_token_ids": tokens(302, 40)}], vllm_params(spec, None), use_tqdm=False)
        assert after.outputs[0].finish_reason == "length" and len(after.outputs[0].token_ids) == NEW_TOKENS
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_the_context_policy_setting_is_checked_as_kvpress_serves() -> None:
    """`additional_config["kv_context_policy"]` takes what `kvpress serve --context-policy` takes; anything else
    stops `vllm serve` at start (`apply_native_config` turns the error into an UnsupportedConfigError)."""
    assert context_policy_setting({}) == "kvzip"
    assert context_policy_setting({"kv_context_policy": "none"}) == "none"
    assert context_policy_setting({"kv_context_policy": {"name": "expected_attention", "ratio": 0.5}}) == {
        "name": "expected_attention",
        "ratio": 0.5,
    }
    for bad in ("nonexistent", "wgkv", "full"):
        with pytest.raises(PolicyConfigError):
            context_policy_setting({"kv_context_policy": bad})


@pytest.mark.parametrize("spec", [{"name": "snapkv", "ratio": 0.25}, {"name": "kvzip", "ratio": 0.25}])
def test_a_context_on_gemma3_forks_its_rings_too(tmp_path: Path, spec: Any) -> None:
    """A random Gemma 3 whose sliding-window layers (window 8) are rings: the stored context holds the rings of
    its last 8 positions, and each question continues its own copy of them (copy-on-write), giving the embedded
    engine's tokens and kept entries for (context, question)."""
    _, gemma3 = write_suite_gemma3(tmp_path / "gemma3")
    context = tokens(6, CONTEXT)
    questions = [tokens(30 + i, 9 + 4 * i) for i in range(3)]
    embedded = LLM(gemma3, dtype=torch.float32, num_pages=2048, page_size=PAGE_SIZE)
    ours = embedded_runs(embedded, context, questions, spec)
    llm = native_llm(gemma3)
    try:
        pool = in_process_worker(llm).model_runner.pool
        pool.kept_at_compression = {}
        theirs = [
            llm.generate([{"prompt_token_ids": context + q}], vllm_params(spec, CONTEXT), use_tqdm=False)[0]
            for q in questions
        ]
        (built,) = pool.kept_at_compression.values()
        for mine, output in zip(ours, theirs, strict=True):
            assert mine.kv.kept_at_compression is not None
            assert held_sets(built) == held_sets(mine.kv.kept_at_compression)
            assert list(output.outputs[0].token_ids) == mine.output_token_ids
        assert [o.num_cached_tokens for o in theirs] == [0, CONTEXT, CONTEXT]
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()
