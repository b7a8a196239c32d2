"""Pipeline parallelism, and tensor parallelism over more workers than KV heads, on vLLM's runner.

Pipeline parallelism (`--pipeline-parallel-size 2`): each stage's pool holds its layers; a policy that decides
across layers runs stage after stage and plans on the last, and KVzip's reconstruction pass runs the stages in turn.
Every policy keeps what one worker keeps, and a request failing on one stage fails on both, alone.

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
from vllm_utils import in_process_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures(in_process_engine.__name__, functions_to_workers.__name__),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_parallel_model(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def one_worker(model: Path) -> Run:
    return every_policy_on(model, 1)


@pytest.fixture(scope="module")
def two_stages(model: Path) -> Run:
    """Every policy on two pipeline stages."""
    llm = parallel_llm(model, 1, stages=2)
    try:
        return run_every_policy(llm, SERVED, stages=2)
    finally:
        close(llm)


@pytest.mark.parametrize("name", SERVED)
def test_two_pipeline_stages_keep_exactly_what_one_worker_keeps(name: str, one_worker: Run, two_stages: Run) -> None:
    """Each stage's pool holds its layers. A policy that decides layer by layer keeps there what one worker keeps
    in those layers; one that decides across layers (PyramidKV, LAVa, XKV, GVote, K-VEC, KVzip) sees the second
    stage's layers after the first's, carrying its state over, and plans every layer on the last stage, as one
    worker would. KVzip's reconstruction pass runs the first stage's layers, then the second's from the hidden
    states the first relays, each scoring its own layers. The scheduler reads the figures of every stage's layers
    (the first stage's report merged into the last's)."""
    assert_same_run(one_worker[name], two_stages[name])


PLANNING_FAILS = 97  # a prompt of this length fails in the last stage's planning alone
RECONSTRUCTION_FAILS = 98  # and one of this length in the last stage's part of KVzip's reconstruction pass


def fail_marked_requests_on_the_last_stage(worker: Any) -> None:
    """On the last pipeline stage only: a marked prompt finds no pages (before any policy runs), PyramidKV's
    plan raises for a prompt of `PLANNING_FAILS` tokens (after the first stage's layers were scored), and the
    model raises in KVzip's reconstruction pass over a prompt of `RECONSTRUCTION_FAILS` tokens (after the first
    stage ran its layers over the chunk)."""
    from vllm_kvpress_ext.policies.pyramidkv import PyramidKVPolicy

    runner = worker.model_runner
    pool = runner.pool
    if pool.stage is None or pool.stage[0] == 0:
        return
    seat_no_marked_request(pool)

    def raise_if_marked(_model: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        # The pass's chunks are positioned after the prompt: the first one's position is the prompt's length.
        if pool.reconstructing and int(kwargs["positions"][0]) == RECONSTRUCTION_FAILS:
            raise RuntimeError("the reconstruction pass failed on the last stage")

    runner.model.register_forward_pre_hook(raise_if_marked, with_kwargs=True)
    plan = PyramidKVPolicy.plan

    def plan_unless_marked(self: Any, request: Any, results: Any, state: Any) -> Any:
        if request.length == PLANNING_FAILS:
            raise RuntimeError("planning failed on the last stage")
        return plan(self, request, results, state)

    PyramidKVPolicy.plan = plan_unless_marked  # type: ignore[method-assign]


def test_a_request_failing_on_one_stage_fails_on_all_and_alone(model: Path, one_worker: Run) -> None:
    """A request the last stage cannot seat is failed on both stages before the policies run, and one whose policy
    raises on the last stage, while the first stage waits for its plan or for the last stage's part of KVzip's
    reconstruction pass, is failed on both: neither stage waits for the other in vain, and the batch's other
    request keeps what one worker keeps."""
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
        kvzip = VllmSamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": "kvzip"}
        )
        assert len([*other, 5, 6]) == RECONSTRUCTION_FAILS
        outputs = llm.generate([{"prompt_token_ids": p} for p in (good, [*other, 5, 6])], kvzip, use_tqdm=False)
        assert list(outputs[0].outputs[0].token_ids) == one_worker["kvzip"][0][0]
        assert outputs[1].outputs[0].finish_reason == "error" and not outputs[1].outputs[0].token_ids
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
