"""Pipeline parallelism, and tensor parallelism over more workers than KV heads, on vLLM's runner.

Pipeline parallelism (`--pipeline-parallel-size 2`): each stage's pool holds its layers; a policy that decides
across layers runs stage after stage and plans on the last. Every policy but KVzip (refused by name) keeps what one
worker keeps, and a request failing on one stage fails on both, alone.

More workers than KV heads: vLLM replicates each head, and the replicas join their parts of its query group, so
both keep what one worker keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from model_utils import write_random_gates, write_suite_model
from parallel_utils import (
    MARKED,
    NEW_TOKENS,
    SERVED,
    Run,
    assert_same_run,
    close,
    every_policy_on,
    functions_to_workers,
    parallel_llm,
    prompts,
    run_every_policy,
    seat_no_marked_request,
    write_parallel_model,
)
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_utils import in_process_engine

from vllm_kvpress_ext.policies.registry import create_policy
from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, native_refusal

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures(in_process_engine.__name__, functions_to_workers.__name__),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_parallel_model(tmp_path_factory.mktemp("tp"))


TWO_STAGES = ModelFacts(rope=True, projections=True, pipeline_parallel=2)
# What pipeline stages serve: every policy but KVzip.
STAGED = [n for n in SERVED if native_refusal(create_policy(n), TWO_STAGES) is None]


@pytest.fixture(scope="module")
def one_worker(model: Path) -> Run:
    return every_policy_on(model, 1)


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
