"""Tensor parallelism on vLLM's runner (`--tensor-parallel-size 2`, two worker processes over gloo).

Each worker's pool holds its half of every layer's KV heads. A policy whose budget crosses heads (AdaKV's top-k
over a layer's heads, GVote's request total, K-VEC's coverage, LAVa's and XKV's layer budgets, KVzip's global
ranking) gathers its per-head scores over the workers, so two workers keep exactly what one keeps: the same
entries in every (layer, KV head), the same greedy tokens, and the same KV figures, summed over the workers.
What cannot be served so is refused, at start and per request, with the reason.
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
from model_utils import write_suite_model
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.distributed import cleanup_dist_env_and_memory
from vllm.exceptions import VLLMValidationError
from vllm_utils import PAGE_SIZE, in_process_engine

from vllm_kvpress_ext.policies.registry import create_policy, policy_names
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY
from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, native_refusal

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

NEW_TOKENS = 6
TWO_WORKERS = ModelFacts(rope=True, projections=True, tensor_parallel=2)
SERVED = [
    n for n in policy_names() if create_policy(n).compresses and native_refusal(create_policy(n), TWO_WORKERS) is None
]
# Budgets that rank entries (a window shorter than the budget), and under which heads compete: AdaKV without a
# per-head floor, every entry won in the layer's top-k.
SPECS: dict[str, Any] = {
    "snapkv": {"name": "snapkv", "ratio": 0.25, "window": 8},
    "adakv": {"name": "adakv", "ratio": 0.25, "window": 8, "alpha": 0.0},
    "lava": {"name": "lava", "ratio": 0.25, "window": 8},
    "streaming_llm": {"name": "streaming_llm", "ratio": 0.3},
}


@pytest.fixture(scope="module", autouse=True)
def functions_to_workers() -> Iterator[None]:
    """`collective_rpc` ships the functions below to the worker processes (pickled by value)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("tp"), hidden=64, num_heads=8, num_kv_heads=4)


def parallel_llm(model: Path, workers: int, **additional: Any) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=512,
        block_size=PAGE_SIZE,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        tensor_parallel_size=workers,
        distributed_executor_backend="mp" if workers > 1 else "uni",
        additional_config={"kv_runner": "vllm", "kv_num_pages": 2048, **additional},
    )


def close(llm: LLM) -> None:
    """Stop `llm`'s engine and this process's distributed groups: the next engine may have another worker count."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def record_kept(worker: Any) -> None:
    worker.model_runner.pool.kept_at_compression = {}


def kept_and_free(worker: Any) -> tuple[list[list[list[set[int]]]], bool]:
    """Per request this worker compressed (in order), the positions each (layer, KV head) of it held right after;
    and whether every page of its pool is free or held by a request's row."""
    pool = worker.model_runner.pool
    kept = [
        [
            [set(entries.head(layer, head)) for head in range(entries.lengths.shape[1])]
            for layer in range(entries.lengths.shape[0])
        ]
        for entries in pool.kept_at_compression.values()
    ]
    pool.kept_at_compression = {}
    held = sum(pool.cache.usage(request_id).pages for request_id in pool.seats)  # finished rows go at the next step
    return kept, pool.cache.pool.num_free + held == pool.cache.pool.num_pages


def prompts() -> list[list[int]]:
    rngs = [random.Random(seed) for seed in (0, 1)]
    return [[rng.randrange(10, len(VOCABULARY)) for _ in range(96)] for rng in rngs]


Run = dict[str, tuple[list[list[int]], list[dict[str, Any]], list[list[list[set[int]]]]]]


def run_every_policy(llm: LLM) -> Run:
    """Per served policy: the greedy tokens, the KV figures and the kept sets (joined over the workers' heads)."""
    llm.collective_rpc(record_kept)
    results: Run = {}
    for name in SERVED:
        spec = SPECS.get(name, name)
        params = VllmSamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_policy": json.dumps(spec) if isinstance(spec, dict) else spec},
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        per_worker = llm.collective_rpc(kept_and_free)
        assert all(free for _, free in per_worker), name  # no page leaked on any worker
        joined = [
            [
                [head for worker, _ in per_worker for head in worker[request][layer]]
                for layer in range(len(per_worker[0][0][request]))
            ]
            for request in range(len(outputs))
        ]
        results[name] = (
            [list(o.outputs[0].token_ids) for o in outputs],
            [o.kv_transfer_params["kvpress"] for o in outputs],
            joined,
        )
    return results


@pytest.fixture(scope="module")
def one_worker(model: Path) -> Run:
    llm = parallel_llm(model, 1)
    try:
        return run_every_policy(llm)
    finally:
        close(llm)


@pytest.fixture(scope="module")
def two_workers(model: Path) -> Run:
    llm = parallel_llm(model, 2)
    try:
        return run_every_policy(llm)
    finally:
        close(llm)


@pytest.mark.parametrize("name", SERVED)
def test_two_workers_keep_exactly_what_one_keeps(name: str, one_worker: Run, two_workers: Run) -> None:
    tokens, figures, kept = one_worker[name]
    tokens_tp, figures_tp, kept_tp = two_workers[name]
    assert kept_tp == kept
    assert tokens_tp == tokens
    for mine, theirs in zip(figures, figures_tp, strict=True):
        for field in ("kv_tokens_kept", "kv_tokens_full", "kv_bytes", "kv_retention", "policy"):
            assert theirs[field] == mine[field], field


def test_cross_head_budgets_move_entries_between_the_workers(two_workers: Run) -> None:
    """The exchange decides something: under AdaKV without a floor, the first worker's heads hold a different
    number of entries than the second's (a worker ranking its own heads alone would keep the same on each)."""
    _, _, kept = two_workers["adakv"]
    for request in kept:
        counts = [[len(head) for head in layer] for layer in request]
        assert any(sum(layer[:2]) != sum(layer[2:]) for layer in counts)


def test_more_workers_than_kv_heads_serve_the_full_cache_and_refuse_compression(tmp_path: Path) -> None:
    """One KV head, two workers: vLLM replicates the head. The full cache serves, token for token as on one
    worker; a compressing policy is refused by name, per request and at start (each replica holds half the
    head's query group, so the two would score it differently)."""
    model = write_suite_model(tmp_path / "mqa", hidden=64, num_heads=4, num_kv_heads=1)
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts()]
    expected = []
    llm = parallel_llm(model, 1)
    try:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    finally:
        close(llm)
    llm = parallel_llm(model, 2)
    try:
        outputs = llm.generate(batch, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        figures = outputs[0].kv_transfer_params["kvpress"]
        assert figures["kv_tokens_full"] == 2 * (96 + NEW_TOKENS - 1)  # each head once, not once per replica
        compressing = VllmSamplingParams(max_tokens=2, extra_args={"kv_policy": "snapkv"})
        with pytest.raises(VLLMValidationError, match="replicates over tensor-parallel workers"):
            llm.generate(batch[:1], compressing, use_tqdm=False)
    finally:
        close(llm)
    with pytest.raises(Exception, match="replicates over tensor-parallel workers"):
        parallel_llm(model, 2, kv_policy="snapkv")


def test_write_gates_are_refused_under_tensor_parallelism(model: Path) -> None:
    assert native_refusal(create_policy("wgkv"), TWO_WORKERS) is not None
    with pytest.raises(Exception, match="write gates, which do not run under tensor parallelism"):
        parallel_llm(model, 2, kv_policy="wgkv")


def test_a_worker_count_that_does_not_divide_the_kv_heads_is_refused(tmp_path: Path) -> None:
    model = write_suite_model(tmp_path / "three", hidden=96, num_heads=6, num_kv_heads=3)
    with pytest.raises(Exception, match="does not divide this model's 6 attention heads and 3 KV heads"):
        parallel_llm(model, 2)


def test_the_plugins_own_runner_refuses_tensor_parallelism(model: Path) -> None:
    with pytest.raises(Exception, match="needs vLLM's runner"):
        LLM(str(model), dtype="float32", tensor_parallel_size=2, additional_config={"kv_runner": "project"})


def test_a_plan_over_all_heads_is_cut_to_each_workers_part() -> None:
    from vllm_kvpress_ext.cache import KeepPlan
    from vllm_kvpress_ext.engine.compression import workers_part
    from vllm_kvpress_ext.policies.base import HeadShard

    mask = torch.rand(2, 4, 10) > 0.5
    plan = KeepPlan.from_mask(mask)
    for first in (0, 2):
        shard = HeadShard(first, 2, 4, gather=lambda t, fill: t)
        part = workers_part(plan, shard)
        assert torch.equal(part.to_mask(torch.full((2, 2), 10)), mask[:, first : first + 2])
        assert workers_part(part, shard) is part  # a plan over the worker's own heads is applied as it is
    with pytest.raises(ValueError, match="covers 3 KV heads"):
        workers_part(KeepPlan.from_mask(mask[:, :3]), HeadShard(0, 2, 4, gather=lambda t, fill: t))
