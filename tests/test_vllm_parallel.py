"""Tensor and data parallelism on vLLM's runner, served over HTTP too.

Tensor parallelism (`--tensor-parallel-size 2`, two worker processes over gloo):

Each worker's pool holds its half of every layer's KV heads. A policy whose budget crosses heads (AdaKV's top-k
over a layer's heads, GVote's request total, K-VEC's coverage, LAVa's and XKV's layer budgets, KVzip's global
ranking) gathers its per-head scores over the workers, so two workers keep exactly what one keeps: the same
entries in every (layer, KV head), the same greedy tokens, and the same KV figures, summed over the workers.
What cannot be served so is refused, at start and per request, with the reason.

Pipeline parallelism and more workers than KV heads: `test_vllm_stages_and_replicas.py`.

Data parallelism (`--data-parallel-size 2`): two replicas, each an engine with its own scheduler and pool,
behind `vllm serve`'s API servers; the `kvpress_*` series carry vLLM's `engine` label.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from model_utils import write_suite_model
from parallel_utils import (
    MARKED,
    NEW_TOKENS,
    SERVED,
    SPECS,
    TWO_WORKERS,
    Run,
    assert_same_run,
    close,
    every_policy_on,
    functions_to_workers,
    parallel_llm,
    prompts,
    seat_no_marked_request,
    write_parallel_model,
)
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm_utils import PAGE_SIZE, free_port, in_process_engine, stop, vllm_server

from vllm_kvpress_ext.policies.registry import create_policy
from vllm_kvpress_ext.vllm_plugin.native.support import native_refusal

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
def two_workers(model: Path) -> Run:
    return every_policy_on(model, 2)


@pytest.mark.parametrize("name", SERVED)
def test_two_workers_keep_exactly_what_one_keeps(name: str, one_worker: Run, two_workers: Run) -> None:
    assert_same_run(one_worker[name], two_workers[name])


def test_cross_head_budgets_move_entries_between_the_workers(two_workers: Run) -> None:
    """The exchange decides something: under AdaKV without a floor, the first worker's heads hold a different
    number of entries than the second's (a worker ranking its own heads alone would keep the same on each)."""
    _, _, kept = two_workers["adakv"]
    for request in kept:
        counts = [[len(head) for head in layer] for layer in request]
        assert any(sum(layer[:2]) != sum(layer[2:]) for layer in counts)


def fail_marked_requests_on_the_second_worker(worker: Any) -> None:
    """The second worker's pool refuses to seat a marked request, as if it had run out of pages there only."""
    pool = worker.model_runner.pool
    if pool.shard.first != 0:
        seat_no_marked_request(pool)


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


@pytest.mark.heavy
def test_one_server_over_two_nodes(model: Path, tmp_path: Path) -> None:
    """vLLM's multi-node form on one machine: a head (`--node-rank 0`, the API) and a `--headless` worker
    (`--node-rank 1`), one tensor-parallel worker each, as docker/k8s/multinode runs them on two nodes.

    Then the worker node dies mid-answer: the answer in flight ends with an error event, not with tokens
    computed without half the heads, and the head ends (no hang in a gather waiting for the dead rank)."""
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
            events = stream_until_a_process_dies(url, worker)
            assert len(events) < 400 and '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and server_answers(url):
                time.sleep(1)
            assert not server_answers(url), "the head still serves with its second node dead"
    finally:
        stop(worker)


def stream_until_a_process_dies(url: str, victim: subprocess.Popen[bytes]) -> list[str]:
    """The events of a long streamed answer during which `victim`'s process group is killed (SIGKILL), after
    its third event."""
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3 and victim.poll() is None:
                os.killpg(victim.pid, signal.SIGKILL)
    return events


def server_answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.heavy
def test_vllm_serve_with_two_data_parallel_replicas_of_two_tensor_parallel_workers(model: Path, tmp_path: Path) -> None:
    """Over HTTP, two replicas of two tensor-parallel workers each share the requests: every answer's `usage`
    counts each KV head once (both workers' halves), AdaKV's exchange runs in each replica, a request for a
    policy the workers cannot share is a 400 naming it, and each replica reports its pool and finished requests
    under its `engine` label."""
    args = [str(model), "--served-model-name", "model", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-num-seqs", "4"]
    args += ["--kv-policy", json.dumps(SPECS["adakv"])]
    with vllm_server(args, tmp_path / "dp.log", SERVED_IN_PROCESSES) as url:
        answers = [complete(url) for _ in range(6)]
        assert len({a["choices"][0]["text"] for a in answers}) == 1  # greedy: the same answer from either replica
        for usage in (a["usage"] for a in answers):
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
        finished = {
            dict(labels)["engine"]: value
            for (name, labels), value in samples.items()
            if name == "kvpress_requests_finished_total" and dict(labels)["policy"] == "adakv"
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
