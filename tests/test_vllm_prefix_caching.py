"""The vLLM plugin's compressed prefix store (`--enable-prefix-caching` given explicitly, on the plugin's own
runner, `kv_runner: project`), vLLM really installed. (On vLLM's runner, the default, prefix caching is vLLM's
own over the pool's kept blocks: test_vllm_native_runner.py.)

Each turn of a conversation attaches to what the previous turn left, as `kvpress serve
--prefix-matching auto` does: the plugin's scheduler tells vLLM the attached tokens are computed
(`num_cached_tokens`), the worker forks the stored row, and the tokens equal the embedded engine's
turn for turn (whose own tests prove them equal to the fresh run that builds the same cache). vLLM's
default (prefix caching on without asking) reuses only uncompressed caches, which is exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm_utils import MODEL_DIR, PAGE_SIZE, in_process_engine, vllm_server

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.vllm_plugin.config import (
    UnsupportedConfigError,
    check_prefix_caching_settings,
    prefix_matching_mode,
)
from vllm_kvpress_ext.vllm_plugin.scheduler import KVPressScheduler

# vLLM's engine core in this process, so the tests can read its scheduler and worker.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

POOL = 2000
TURNS = 4
MAX_TOKENS = 5
POLICIES: list[Any] = ["full", {"name": "snapkv", "ratio": 0.3}, {"name": "h2o", "ratio": 0.3}]


def make_llm(**kwargs: Any) -> LLM:
    return LLM(
        str(MODEL_DIR),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        additional_config={"kv_policy": "snapkv", "kv_num_pages": POOL, "kv_runner": "project"},
        **kwargs,
    )


@pytest.fixture(scope="module")
def caching_llm() -> LLM:
    return make_llm(enable_prefix_caching=True)


def scheduler_of(llm: LLM) -> KVPressScheduler:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, KVPressScheduler)
    return scheduler


def conversation(policy: Any, seed: int) -> list[list[int]]:
    """Per turn, the new tokens the user adds (the first turn's are the opening context)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (80 if t == 0 else 9,), generator=g).tolist() for t in range(TURNS)]


def vllm_turns(llm: LLM, policy: Any, messages: list[list[int]]) -> list[tuple[list[int], int]]:
    params = VllmSamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": policy}
    )
    history: list[int] = []
    turns = []
    for message in messages:
        history = history + message
        out = llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)[0]
        answer = list(out.outputs[0].token_ids)
        turns.append((answer, int(out.num_cached_tokens or 0)))
        history = history + answer
    return turns


def embedded_turns(policy: Any, messages: list[list[int]]) -> list[tuple[list[int], int]]:
    engine = LLMEngine(
        MODEL_DIR,
        dtype=torch.float32,
        num_pages=POOL,
        page_size=PAGE_SIZE,
        max_num_seqs=4,
        enable_prefix_caching=True,
        prefix_matching="auto",
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    history: list[int] = []
    turns = []
    for message in messages:
        history = history + message
        request_id = engine.add_request(history, params, policy=policy)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == request_id:
                    final = out
        assert final is not None
        turns.append((final.output_token_ids, final.cached_tokens))
        history = history + final.output_token_ids
    return turns


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "snapkv", "h2o"])
def test_turns_attach_and_equal_the_embedded_engine(caching_llm: LLM, policy: Any) -> None:
    messages = conversation(policy, seed=len(str(policy)))
    got = vllm_turns(caching_llm, policy, messages)
    assert got == embedded_turns(policy, messages)
    assert got[0][1] == 0 and all(cached > 0 for _, cached in got[1:])
    # Turn t+1 reads every token turn t wrote: its prompt and its answer but the last sampled token.
    assert got[1][1] == len(messages[0]) + MAX_TOKENS - 1
    # The engine core's metrics follow the worker's store (cumulative over the module's conversations).
    metrics = scheduler_of(caching_llm).metrics
    assert metrics.prefix_counters["hits"] >= len(got) - 1
    assert metrics.prefix_counters["tokens_reused"] >= sum(cached for _, cached in got)
    assert metrics.gauges["kvpress_prefix_cache_entries"] >= 1 and metrics.gauges["kvpress_prefix_cache_pages"] > 0


def test_vllm_default_reuses_uncompressed_caches_only() -> None:
    """vLLM's default (prefix caching on, not asked for) is exact reuse: a full request's turns attach and
    equal the embedded engine's, a compressing request's never do (that changes what its policy sees)."""
    llm = make_llm()
    snap = conversation("snapkv", seed=3)
    assert all(cached == 0 for _, cached in vllm_turns(llm, "snapkv", snap[:2]))
    messages = conversation("full", seed=4)
    got = vllm_turns(llm, "full", messages)
    assert got == embedded_turns("full", messages)
    assert got[0][1] == 0 and got[1][1] == len(messages[0]) + MAX_TOKENS - 1
    mirror = scheduler_of(llm).prefix_mirror
    assert mirror is not None and mirror.matching == "named"


def test_the_mirror_follows_the_workers_store(caching_llm: LLM) -> None:
    scheduler = scheduler_of(caching_llm)
    worker = caching_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    store = worker.runner.prefix_store
    vllm_turns(caching_llm, "snapkv", conversation("snapkv", seed=11)[:2])
    assert store is not None and scheduler.prefix_mirror is not None
    caching_llm.generate([{"prompt_token_ids": [5] * 20}], VllmSamplingParams(max_tokens=1), use_tqdm=False)
    # The request that just finished is in the mirror already; the worker stores it at its next step.
    pending = set(scheduler.prefix_mirror.entries) - set(store.entries)
    assert len(pending) == 1 and set(store.entries) <= set(scheduler.prefix_mirror.entries)
    caching_llm.generate([{"prompt_token_ids": [6] * 8}], VllmSamplingParams(max_tokens=1), use_tqdm=False)
    assert pending <= set(store.entries)  # stored; the 8-token request had no whole page to keep
    assert set(scheduler.prefix_mirror.entries) == set(store.entries)
    assert not any(entry.users for entry in store.entries.values())
    store.clear()
    # What is left is the last request's row, which the worker frees when the next step tells it it finished.
    cache = worker.runner.cache
    live = sum(int(cache.pages_per_head(rid).sum()) for rid, r in worker.requests.items() if r.seat.row is not None)
    assert list(worker.requests) == [] or live > 0
    assert cache.pool.num_free + live == cache.pool.num_pages


def test_prefix_caching_settings_are_checked() -> None:
    assert check_prefix_caching_settings({}) is False
    assert check_prefix_caching_settings({"kv_prefix_caching": True, "kv_max_cached_prefixes": 4}) is True
    # Unset: exact reuse of uncompressed caches; asked for: compressed ones too; turned off: none.
    assert prefix_matching_mode({}) == "named"
    assert prefix_matching_mode({"kv_prefix_caching": True}) == "auto"
    assert prefix_matching_mode({"kv_prefix_caching": False}) is None
    with pytest.raises(UnsupportedConfigError):
        prefix_matching_mode({"kv_max_cached_prefixes": 0})
    for bad in ({"kv_prefix_caching": "yes"}, {"kv_max_cached_prefixes": 0}, {"kv_max_cached_prefixes": True}):
        with pytest.raises(UnsupportedConfigError):
            check_prefix_caching_settings(bad)


def test_vllm_serve_with_prefix_caching_attaches_each_turn(tmp_path: Path) -> None:
    """The same over `vllm serve` (its own API and engine-core processes: the promise to the worker crosses
    the process boundary), with `usage.prompt_tokens_details.cached_tokens` from vLLM itself."""
    args = [str(MODEL_DIR), "--kv-policy", "snapkv", "--served-model-name", "bundled", "--dtype", "float32"]
    args += [
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--additional-config",
        json.dumps({"kv_num_pages": POOL, "kv_runner": "project"}),  # the compressed store: the own runner's
    ]
    args += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    messages = conversation("snapkv", seed=21)
    expected = embedded_turns("snapkv", messages)
    with vllm_server(args, tmp_path / "serve.log") as url, httpx.Client(base_url=url, timeout=120) as http:
        history: list[int] = []
        for turn, message in enumerate(messages):
            history = history + message
            body = {"model": "bundled", "prompt": history, "max_tokens": MAX_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            reply = http.post("/v1/completions", json=body).json()
            answer = reply["choices"][0]["token_ids"]
            cached = (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert (answer, cached) == expected[turn], turn
            history = history + answer


def test_unused_entries_make_room_before_anything_waits_or_fails() -> None:
    """A pool that the stored sessions fill: the next request needs their pages, and gets them."""
    pool = 300  # pages; a finished 100 + 4 token full-cache request leaves 8 layer-heads x 7 pages
    llm = LLM(
        str(MODEL_DIR),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        enable_prefix_caching=True,
        additional_config={"kv_policy": "full", "kv_num_pages": pool, "kv_runner": "project"},
    )
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    store = worker.runner.prefix_store
    scheduler = scheduler_of(llm)
    params = VllmSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        llm.generate(
            [{"prompt_token_ids": torch.randint(3, 400, (100,), generator=g).tolist()}], params, use_tqdm=False
        )
    # A request too short to be kept (no whole page): the fourth session is stored and reported meanwhile.
    llm.generate([{"prompt_token_ids": [7] * 8}], VllmSamplingParams(max_tokens=1), use_tqdm=False)
    assert len(store.entries) == 4 and worker.runner.cache.pool.num_free < 8 * 13
    big = torch.randint(3, 400, (200,), generator=g).tolist()  # 8 x 13 pages: more than is free
    out = llm.generate([{"prompt_token_ids": big}], params, use_tqdm=False)[0]
    assert store is not None and store.evicted > 0 and scheduler.metrics.preemptions == 0
    reference = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=pool, page_size=PAGE_SIZE, max_num_seqs=4)
    request_id = reference.add_request(
        big, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), policy="full"
    )
    final = None
    while reference.has_unfinished_requests():
        for update in reference.step():
            if update.finished and update.request_id == request_id:
                final = update
    assert final is not None and list(out.outputs[0].token_ids) == final.output_token_ids
