"""Tensor, pipeline and data parallelism on vLLM's runner.

Tensor parallelism (`--tensor-parallel-size 2`, two worker processes over gloo):

Each worker's pool holds its half of every layer's KV heads. A policy whose budget crosses heads (AdaKV's top-k
over a layer's heads, GVote's request total, K-VEC's coverage, LAVa's and XKV's layer budgets, KVzip's global
ranking) gathers its per-head scores over the workers, so two workers keep exactly what one keeps: the same
entries in every (layer, KV head), the same greedy tokens, and the same KV figures, summed over the workers.
What cannot be served so is refused, at start and per request, with the reason.

Pipeline parallelism (`--pipeline-parallel-size 2`): each stage's pool holds its layers; a policy that decides
across layers runs stage after stage and plans on the last. Every policy but KVzip (refused by name) keeps what one
worker keeps.

Data parallelism (`--data-parallel-size 2`): two replicas, each an engine with its own scheduler and pool,
behind `vllm serve`'s API servers; the `kvpress_*` series carry vLLM's `engine` label.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from model_utils import write_random_gates, write_suite_model
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.distributed import cleanup_dist_env_and_memory
from vllm.exceptions import VLLMValidationError
from vllm_utils import PAGE_SIZE, free_port, in_process_engine, stop, vllm_server

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
    # Scores from a few queries, so that each decode step's attention decides what the step evicts.
    "h2o": {"name": "h2o", "ratio": 0.25, "observation_window": 4},
    # The random gates beside the checkpoint (`write_random_gates`) admit about half the keys at tau 0.5.
    "wgkv": {"name": "wgkv", "tau": 0.5},
}


@pytest.fixture(scope="module", autouse=True)
def functions_to_workers() -> Iterator[None]:
    """`collective_rpc` ships the functions below to the worker processes (pickled by value)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_suite_model(tmp_path_factory.mktemp("tp"), hidden=64, num_heads=8, num_kv_heads=4)
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


TWO_STAGES = ModelFacts(rope=True, projections=True, pipeline_parallel=2)
# What pipeline stages serve: every policy but KVzip.
STAGED = [n for n in SERVED if native_refusal(create_policy(n), TWO_STAGES) is None]


@pytest.fixture(scope="module")
def one_worker(model: Path) -> Run:
    return every_policy_on(model, 1)


@pytest.fixture(scope="module")
def two_workers(model: Path) -> Run:
    return every_policy_on(model, 2)


def assert_same_run(mine: tuple[Any, Any, Any], theirs: tuple[Any, Any, Any]) -> None:
    """The same kept sets, greedy tokens and KV figures."""
    (tokens, figures, kept), (their_tokens, their_figures, their_kept) = mine, theirs
    assert their_kept == kept
    assert their_tokens == tokens
    for one, other in zip(figures, their_figures, strict=True):
        for field in ("kv_tokens_kept", "kv_tokens_full", "kv_bytes", "kv_retention", "policy"):
            assert other[field] == one[field], field


@pytest.mark.parametrize("name", SERVED)
def test_two_workers_keep_exactly_what_one_keeps(name: str, one_worker: Run, two_workers: Run) -> None:
    assert_same_run(one_worker[name], two_workers[name])


@pytest.fixture(scope="module")
def two_stages(model: Path) -> tuple[Run, str]:
    """Every policy the stages serve on two pipeline stages, and what a request for KVzip is told there."""
    llm = parallel_llm(model, 1, stages=2)
    try:
        refused = VllmSamplingParams(max_tokens=2, extra_args={"kv_policy": "kvzip"})
        with pytest.raises(VLLMValidationError) as refusal:
            llm.generate([{"prompt_token_ids": prompts()[0]}], refused, use_tqdm=False)
        return run_every_policy(llm, STAGED, stages=2), str(refusal.value)
    finally:
        close(llm)


@pytest.mark.parametrize("name", STAGED)
def test_two_pipeline_stages_keep_exactly_what_one_worker_keeps(
    name: str, one_worker: Run, two_stages: tuple[Run, str]
) -> None:
    """Each stage's pool holds its layers. A policy that decides layer by layer keeps there what one worker keeps
    in those layers; one that decides across layers (PyramidKV, LAVa, XKV, GVote, K-VEC) sees the second stage's
    layers after the first's, carrying its state over, and plans every layer on the last stage, as one worker
    would. The scheduler reads the figures of every stage's layers (the first stage's report merged into the
    last's)."""
    assert_same_run(one_worker[name], two_stages[0][name])


def test_kvzip_is_refused_under_pipeline_parallelism(model: Path, two_stages: tuple[Run, str]) -> None:
    """KVzip's reconstruction pass runs the whole model over the cached prompt, which the stages do not: refused by
    name, per request (HTTP 400 over a server) and at start, while every other policy serves."""
    assert set(SERVED) - set(STAGED) == {"kvzip"}
    assert {"pyramidkv", "lava", "xkv", "gvote", "kvec"} <= set(STAGED)
    assert "kv_policy 'kvzip' scores the cache with a reconstruction pass" in two_stages[1]
    assert "pipeline parallelism (2 stages" in two_stages[1]
    with pytest.raises(Exception, match="kv_policy 'kvzip' scores the cache with a reconstruction pass"):
        parallel_llm(model, 1, stages=2, kv_policy="kvzip")


def test_cross_head_budgets_move_entries_between_the_workers(two_workers: Run) -> None:
    """The exchange decides something: under AdaKV without a floor, the first worker's heads hold a different
    number of entries than the second's (a worker ranking its own heads alone would keep the same on each)."""
    _, _, kept = two_workers["adakv"]
    for request in kept:
        counts = [[len(head) for head in layer] for layer in request]
        assert any(sum(layer[:2]) != sum(layer[2:]) for layer in counts)


MARKED = 3  # a prompt starting with this token fails in the second worker's pool alone


def fail_marked_requests_on_the_second_worker(worker: Any) -> None:
    """The second worker's pool refuses to seat a marked request, as if it had run out of pages there only."""
    pool = worker.model_runner.pool
    if pool.shard.first != 0:
        seat_no_marked_request(pool)


def seat_no_marked_request(pool: Any) -> None:
    """`pool` refuses to seat a request whose prompt starts with `MARKED`, as if it had run out of pages."""
    seat = pool._seat

    def seat_unless_marked(request_id: str, *args: Any) -> None:
        if pool.prompt_tokens.get(request_id, [None])[0] == MARKED:
            pool.failed[request_id] = "this worker's pool is out of pages"
            return
        seat(request_id, *args)

    pool._seat = seat_unless_marked


def test_a_request_failing_on_one_worker_fails_on_all_and_alone(model: Path, one_worker: Run) -> None:
    """A request that one worker's pool cannot seat is failed on every worker before the policies run: the
    other worker does not wait in a gather for it, and the batch's other request keeps what one worker keeps."""
    llm = parallel_llm(model, 2)
    try:
        llm.collective_rpc(fail_marked_requests_on_the_second_worker)
        spec = SPECS["adakv"]
        params = VllmSamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": json.dumps(spec)}
        )
        good, bad = prompts()
        outputs = llm.generate(
            [{"prompt_token_ids": good}, {"prompt_token_ids": [MARKED, *bad]}], params, use_tqdm=False
        )
        assert list(outputs[0].outputs[0].token_ids) == one_worker["adakv"][0][0]
        assert outputs[1].outputs[0].finish_reason == "error" and not outputs[1].outputs[0].token_ids
        again = llm.generate([{"prompt_token_ids": good}], params, use_tqdm=False)  # nothing left waiting
        assert list(again[0].outputs[0].token_ids) == one_worker["adakv"][0][0]
    finally:
        close(llm)


PLANNING_FAILS = 97  # a prompt of this length fails in the last stage's planning alone


def fail_marked_requests_on_the_last_stage(worker: Any) -> None:
    """On the last pipeline stage only: a marked prompt finds no pages (before any policy runs), and PyramidKV's
    plan raises for a prompt of `PLANNING_FAILS` tokens (after the first stage's layers were scored)."""
    from vllm_kvpress_ext.policies.pyramidkv import PyramidKVPolicy

    pool = worker.model_runner.pool
    if pool.stage is None or pool.stage[0] == 0:
        return
    seat_no_marked_request(pool)
    plan = PyramidKVPolicy.plan

    def plan_unless_marked(self: Any, request: Any, results: Any, state: Any) -> Any:
        if request.length == PLANNING_FAILS:
            raise RuntimeError("planning failed on the last stage")
        return plan(self, request, results, state)

    PyramidKVPolicy.plan = plan_unless_marked  # type: ignore[method-assign]


def test_a_request_failing_on_one_stage_fails_on_all_and_alone(model: Path, one_worker: Run) -> None:
    """A request the last stage cannot seat is failed on both stages before the policies run, and one whose policy
    raises on the last stage, while the first stage waits for its plan, is failed on both: neither stage waits for
    the other in vain, and the batch's other request keeps what one worker keeps."""
    llm = parallel_llm(model, 1, stages=2)
    try:
        llm.collective_rpc(fail_marked_requests_on_the_last_stage)
        params = VllmSamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": "pyramidkv"}
        )
        good, other = prompts()
        batch = [good, [MARKED, *other], [*other, 5]]
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert list(outputs[0].outputs[0].token_ids) == one_worker["pyramidkv"][0][0]
        for failed in outputs[1:]:
            assert failed.outputs[0].finish_reason == "error" and not failed.outputs[0].token_ids
        again = llm.generate([{"prompt_token_ids": good}], params, use_tqdm=False)  # nothing left waiting
        assert list(again[0].outputs[0].token_ids) == one_worker["pyramidkv"][0][0]
    finally:
        close(llm)


def test_vllms_prefix_caching_reads_the_blocks_every_worker_keeps(model: Path) -> None:
    """Prefix caching on (vLLM's default): a prompt served again reads its cached blocks on both workers and
    answers as the first time."""
    llm = parallel_llm(model, 2, prefix_caching=True)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts()]
        first = llm.generate(batch, params, use_tqdm=False)
        again = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        assert all(o.num_cached_tokens == (96 - 1) // PAGE_SIZE * PAGE_SIZE for o in again)  # the last token runs
    finally:
        close(llm)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head of four query heads: on two workers vLLM replicates the head, two query heads on each."""
    path = write_suite_model(tmp_path_factory.mktemp("mqa"), hidden=64, num_heads=4, num_kv_heads=1)
    write_random_gates(path, 16)
    return path


def one_copy_of_each_head(run: tuple[Any, Any, Any], replicas: int) -> tuple[Any, Any, Any]:
    """A policy's run on workers that replicate each KV head, with each head once: the replicas keep alike."""
    tokens, figures, kept = run
    heads = []
    for moment in kept:
        layers = []
        for layer in moment:
            copies = [layer[i : i + replicas] for i in range(0, len(layer), replicas)]
            assert all(c == copy[0] for copy in copies for c in copy)
            layers.append([copy[0] for copy in copies])
        heads.append(layers)
    return tokens, figures, heads


@pytest.fixture(scope="module")
def replicated_runs(one_kv_head: Path) -> tuple[Run, Run]:
    """Every policy on one worker and on two that replicate the KV head."""
    return every_policy_on(one_kv_head, 1), every_policy_on(one_kv_head, 2)


@pytest.mark.parametrize("name", SERVED)
def test_workers_replicating_a_kv_head_keep_exactly_what_one_worker_keeps(
    name: str, replicated_runs: tuple[Run, Run]
) -> None:
    """More workers than KV heads: each replica computes half the head's query group, and the replicas join what
    they captured of it (window queries, query moments, KVzip's scores, H2O's decode attention) before the policy
    runs. Both replicas then keep what one worker keeps, after compression and at the end, token for token, and
    the figures count each head once."""
    one, two = replicated_runs
    assert_same_run(one[name], one_copy_of_each_head(two[name], replicas=2))
    figures = two[name][1][0]
    assert figures["kv_tokens_full"] == 2 * (96 + NEW_TOKENS - 1)  # each head once, not once per replica


def test_a_write_gate_cap_is_refused_under_tensor_parallelism(model: Path) -> None:
    """WG-KV's gates run per KV head on each worker (`test_two_workers_keep_exactly_what_one_keeps[wgkv]`); its cap
    ranks admitted entries across heads at every step, which is refused by name."""
    capped = {"name": "wgkv", "tau": 0.5, "cap": 8, "local_window": 16}
    assert native_refusal(create_policy("wgkv"), TWO_WORKERS) is None
    with pytest.raises(Exception, match="with a cap ranks entries across KV heads"):
        parallel_llm(model, 2, kv_policy=capped)


def test_a_worker_count_that_does_not_divide_the_kv_heads_is_refused(tmp_path: Path) -> None:
    model = write_suite_model(tmp_path / "three", hidden=96, num_heads=6, num_kv_heads=3)
    with pytest.raises(Exception, match="does not divide this model's 6 attention heads and 3 KV heads"):
        parallel_llm(model, 2)


@pytest.mark.parametrize("parallelism", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_the_plugins_own_runner_refuses_tensor_and_pipeline_parallelism(model: Path, parallelism: str) -> None:
    with pytest.raises(Exception, match="needs vLLM's runner"):
        LLM(str(model), dtype="float32", additional_config={"kv_runner": "project"}, **{parallelism: 2})


PROMPT = "key trout 65 . key clam 62 . key lion 17 . what is key trout ? answer :"
SERVED_IN_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # `vllm serve` as users run it


def complete(url: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def kvpress_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("kvpress_")
        for s in family.samples
    }


def test_vllm_serve_with_two_tensor_parallel_workers(model: Path, tmp_path: Path) -> None:
    """Over HTTP: `usage` counts every KV head once (both workers' halves), AdaKV's exchange runs, and a request
    for a policy the workers cannot share is a 400 naming it."""
    spec = json.dumps(SPECS["adakv"])
    args = [str(model), "--served-model-name", "model", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--tensor-parallel-size", "2", "--kv-policy", spec, "--max-num-seqs", "4"]
    with vllm_server(args, tmp_path / "tp.log", SERVED_IN_PROCESSES) as url:
        usage = complete(url)["usage"]
        written = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert usage["kv_policy"] == "adakv" and usage["kv_tokens_full"] == 2 * 4 * written  # layers x KV heads
        assert usage["kv_tokens_kept"] < usage["kv_tokens_full"]
        capped = {"name": "wgkv", "tau": 0.5, "cap": 8, "local_window": 16}
        refused = httpx.post(
            f"{url}/v1/completions",
            json={"model": "model", "prompt": PROMPT, "max_tokens": 2, "kv_policy": capped},
            timeout=60,
        )
        assert refused.status_code == 400 and "tensor parallelism" in refused.json()["error"]["message"]
        samples = kvpress_samples(url)
        assert samples[("kvpress_requests_finished_total", (("policy", "adakv"),))] == 1


def test_one_server_over_two_nodes(model: Path, tmp_path: Path) -> None:
    """vLLM's multi-node form on one machine: a head (`--node-rank 0`, the API) and a `--headless` worker
    (`--node-rank 1`), one tensor-parallel worker each, as docker/k8s/multinode runs them on two nodes."""
    common = [str(model), "--served-model-name", "model", "--dtype", "float32", "--max-model-len", "512"]
    common += ["--max-num-seqs", "4", "--kv-policy", "snapkv", "--tensor-parallel-size", "2"]
    common += ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "KVPRESS_VLLM", "VLLM_PLUGINS")}
    vllm = str(Path(sys.executable).with_name("vllm"))
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [vllm, "serve", *common, "--node-rank", "1", "--headless"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **SERVED_IN_PROCESSES},
            start_new_session=True,
        )
    try:
        with vllm_server([*common, "--node-rank", "0"], tmp_path / "head.log", SERVED_IN_PROCESSES) as url:
            usage = complete(url)["usage"]
            written = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            assert usage["kv_policy"] == "snapkv" and usage["kv_tokens_full"] == 2 * 4 * written  # both halves
            assert usage["kv_tokens_kept"] < usage["kv_tokens_full"]
    finally:
        stop(worker)


def test_vllm_serve_with_two_data_parallel_replicas(model: Path, tmp_path: Path) -> None:
    """Two replicas share the requests; each reports its pool and finished requests under its `engine` label."""
    args = [str(model), "--served-model-name", "model", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--data-parallel-size", "2", "--kv-policy", "snapkv", "--max-num-seqs", "4"]
    with vllm_server(args, tmp_path / "dp.log", SERVED_IN_PROCESSES) as url:
        answers = [complete(url) for _ in range(6)]
        assert len({a["choices"][0]["text"] for a in answers}) == 1  # greedy: the same answer from either replica
        assert all(a["usage"]["kv_policy"] == "snapkv" for a in answers)
        samples = kvpress_samples(url)
        finished = {
            dict(labels)["engine"]: value
            for (name, labels), value in samples.items()
            if name == "kvpress_requests_finished_total"
        }
        assert set(finished) == {"0", "1"} and sum(finished.values()) == 6
        pages = {dict(labels)["engine"] for (name, labels), _ in samples.items() if name == "kvpress_kv_pages_total"}
        assert pages == {"0", "1"}


def test_the_tensor_parallel_bench_measures_memory_and_the_exchange(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.bench.tensor_parallel_bench import TensorParallelBenchConfig, run_tensor_parallel_bench

    config = TensorParallelBenchConfig(
        policies=("full", "adakv"), num_prompts=2, input_len=256, output_len=4, max_num_seqs=2
    )
    rows = {(row["workers"], row["policy"]): row for row in run_tensor_parallel_bench(config)}
    assert rows[(2, "adakv")]["gathers_per_request"] == 4  # one per layer of the bench model
    assert rows[(2, "adakv")]["exchange_kib_per_request"] > 0 and rows[(1, "adakv")]["gathers_per_request"] == 0
    assert rows[(2, "full")]["gathers_per_request"] == 0
    assert rows[(2, "full")]["worker_peak_kv_mib"] == rows[(1, "full")]["worker_peak_kv_mib"] / 2
    assert rows[(2, "adakv")]["kv_mib"] == rows[(1, "adakv")]["kv_mib"] < rows[(1, "full")]["kv_mib"]
    assert "exchange_share_of_prefill" in capsys.readouterr().out
    staged = run_tensor_parallel_bench(dataclasses.replace(config, workers=(1,), stages=(2,), policies=("full",)))
    assert staged[0]["stages"] == 2 and staged[0]["kv_mib"] == rows[(1, "full")]["kv_mib"]
    assert staged[0]["worker_peak_kv_mib"] == rows[(1, "full")]["worker_peak_kv_mib"] / 2  # each stage: 2 of 4 layers
