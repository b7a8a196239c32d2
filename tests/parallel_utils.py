"""What the parallel tests share: a small vLLM engine on N workers or stages, every policy run on it, and the
kept sets and figures compared with one worker's."""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_utils import write_random_gates, write_suite_model
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.distributed import cleanup_dist_env_and_memory
from vllm_utils import PAGE_SIZE

from vllm_kvpress_ext.policies.registry import create_policy, policy_names
from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY
from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, native_refusal

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
    # Scores from a few queries, so that each decode step's attention decides what the step evicts.
    "h2o": {"name": "h2o", "ratio": 0.25, "observation_window": 4},
    # The random gates beside the checkpoint (`write_random_gates`) admit about half the keys at tau 0.5.
    "wgkv": {"name": "wgkv", "tau": 0.5},
}


@pytest.fixture(scope="module")
def functions_to_workers() -> Iterator[None]:
    """`collective_rpc` ships the functions below to the worker processes (pickled by value)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


def write_parallel_model(directory: Path) -> Path:
    """A random Llama with 8 query and 4 KV heads, and random write gates beside it."""
    path = write_suite_model(directory, hidden=64, num_heads=8, num_kv_heads=4)
    write_random_gates(path, 16)
    return path


COLLECTIVE_TIMEOUT_SECONDS = 60


def parallel_llm(model: Path, workers: int, prefix_caching: bool = False, stages: int = 1, **additional: Any) -> LLM:
    """`workers` tensor-parallel workers in each of `stages` pipeline stages."""
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=512,
        block_size=PAGE_SIZE,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        enable_prefix_caching=prefix_caching,  # off unless asked: every prompt prefills under its policy
        tensor_parallel_size=workers,
        pipeline_parallel_size=stages,
        distributed_executor_backend="mp" if workers * stages > 1 else "uni",
        # A gather that one worker never joins fails the engine after this long, instead of hanging the suite.
        cpu_distributed_timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS,
        additional_config={"kv_runner": "vllm", "kv_num_pages": 2048, **additional},
    )


def close(llm: LLM) -> None:
    """Stop `llm`'s engine and this process's distributed groups: the next engine may have another worker count."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def record_kept(worker: Any) -> None:
    """Keep what each request holds right after compression and, as its row is released, at its end."""
    from vllm_kvpress_ext.engine.kept import kept_entries

    pool = worker.model_runner.pool
    pool.kept_at_compression, pool.kept_at_end = {}, {}
    release = pool.release

    def release_recording(request_id: str) -> None:
        if request_id in pool.seats and request_id in pool.kept_at_compression:
            pool.kept_at_end[request_id] = kept_entries(pool.cache, request_id)
        release(request_id)

    pool.release = release_recording


def kept_and_free(worker: Any) -> tuple[list[list[list[set[int]]]], bool]:
    """Per request this worker compressed (in order), the positions each (layer, KV head) of it held right after,
    then, in the same order, those it holds at its end (after the decode steps' evictions); and whether every page
    of its pool is free or held by a request's row."""
    from vllm_kvpress_ext.engine.kept import kept_entries

    pool = worker.model_runner.pool
    # A finished request's row is freed at a later step: what one still seated holds now is what it held at its end.
    ends = [
        pool.kept_at_end.pop(rid) if rid in pool.kept_at_end else kept_entries(pool.cache, rid)
        for rid in pool.kept_at_compression
    ]
    moments = [*pool.kept_at_compression.values(), *ends]
    kept = [
        [
            [set(entries.head(layer, head)) for head in range(entries.lengths.shape[1])]
            for layer in range(entries.lengths.shape[0])
        ]
        for entries in moments
    ]
    pool.kept_at_compression = {}
    held = sum(pool.cache.usage(request_id).pages for request_id in pool.seats)
    return kept, pool.cache.pool.num_free + held == pool.cache.pool.num_pages


def prompts() -> list[list[int]]:
    rngs = [random.Random(seed) for seed in (0, 1)]
    return [[rng.randrange(10, len(VOCABULARY)) for _ in range(96)] for rng in rngs]


Run = dict[str, tuple[list[list[int]], list[dict[str, Any]], list[list[list[set[int]]]]]]


def run_every_policy(llm: LLM, policies: list[str] = SERVED, stages: int = 1) -> Run:
    """Per policy: the greedy tokens, the KV figures and the kept sets after compression and at the end (joined over
    the workers' heads, and over the pipeline stages' layers)."""
    llm.collective_rpc(record_kept)
    results: Run = {}
    for name in policies:
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
        moments = range(len(per_worker[0][0]))  # each request right after compression, then at its end
        if stages > 1:  # each stage (one worker each) holds its layers, in order
            layers = [[layer for kept, _ in per_worker for layer in kept[m]] for m in moments]
            per_worker = [(layers, True)]
        joined = [
            [
                [head for worker, _ in per_worker for head in worker[moment][layer]]
                for layer in range(len(per_worker[0][0][moment]))
            ]
            for moment in moments
        ]
        results[name] = (
            [list(o.outputs[0].token_ids) for o in outputs],
            [o.kv_transfer_params["kvpress"] for o in outputs],
            joined,
        )
    return results


def every_policy_on(model: Path, workers: int) -> Run:
    llm = parallel_llm(model, workers)
    try:
        return run_every_policy(llm)
    finally:
        close(llm)


def assert_same_run(mine: tuple[Any, Any, Any], theirs: tuple[Any, Any, Any]) -> None:
    """The same kept sets, greedy tokens and KV figures."""
    (tokens, figures, kept), (their_tokens, their_figures, their_kept) = mine, theirs
    assert their_kept == kept
    assert their_tokens == tokens
    for one, other in zip(figures, their_figures, strict=True):
        for field in ("kv_tokens_kept", "kv_tokens_full", "kv_bytes", "kv_retention", "policy"):
            assert other[field] == one[field], field


MARKED = 3  # a prompt starting with this token fails in the second worker's pool alone


def seat_no_marked_request(pool: Any) -> None:
    """`pool` refuses to seat a request whose prompt starts with `MARKED`, as if it had run out of pages."""
    seat = pool._seat

    def seat_unless_marked(request_id: str, *args: Any) -> None:
        if pool.prompt_tokens.get(request_id, [None])[0] == MARKED:
            pool.failed[request_id] = "this worker's pool is out of pages"
            return
        seat(request_id, *args)

    pool._seat = seat_unless_marked
