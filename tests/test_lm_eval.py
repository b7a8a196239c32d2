"""lm-evaluation-harness 0.4.13 (`local-completions`) against `kvpress serve` and `vllm serve` with the plugin.

The test writes its own task files (nothing is downloaded): a multiple-choice task scored by
log-likelihood (echo + logprobs on token ids, batched) and a `generate_until` task, both on needle
prompts the bundled model answers. Each server runs with two policies (the full cache and SnapKV at
a quarter of the prompt). What must hold:

- lm-eval completes every request on both servers (batches of 4 prompts, echo, logprobs).
- Both servers give the same results for the same policy: the same per-choice log-likelihoods (to
  float noise) and the same generations, since the same runner and sampler serve them.
- The multiple-choice log-likelihoods are the same under both policies: the prompt is scored as
  prefilled, before the policy compresses (docs/server.md), so echo-scored tasks do not see
  compression; the generations are decoded from the compressed cache, and the servers' own metrics
  show SnapKV compressed them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from test_server import LiveServer, _start
from transformers import AutoTokenizer
from vllm_utils import MODEL_DIR, vllm_server

from vllm_kvpress_ext.tasks.synthetic import generate
from vllm_kvpress_ext.tasks.synthetic.prompt import chat_messages

pytestmark = pytest.mark.slow

SERVED = "bundled"
DOCS = 8
SNAPKV_QUARTER = {"name": "snapkv", "ratio": 0.25}


def _docs() -> list[dict[str, Any]]:
    """Needle prompts rendered with the model's chat template, with the answer and two wrong numbers."""
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    rng = random.Random(30)
    docs = []
    for i in range(DOCS):
        sample = generate("niah_multikey", 8000 + i, context_length=160)
        context = tokenizer.apply_chat_template(chat_messages(sample), tokenize=False, add_generation_prompt=True)
        wrong = [str(n) for n in rng.sample(range(10, 100), 3) if str(n) != sample.answer][:2]
        choices = [f" {sample.answer}", *(f" {w}" for w in wrong)]
        rng.shuffle(choices)
        docs.append(
            {
                "context": context,
                "choices": choices,
                "answer": choices.index(f" {sample.answer}"),
                "target": sample.answer,
            }
        )
    return docs


def write_tasks(directory: Path) -> Path:
    """Two lm-eval task files and their JSONL data in `directory` (lm-eval's `include_path`)."""
    data = directory / "needles.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in _docs()))
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
    }
    tasks = {
        "kvpress_needle_choice": {
            **common,
            "output_type": "multiple_choice",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}],
        },
        "kvpress_needle_answer": {
            **common,
            "output_type": "generate_until",
            "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": ["<eos>", "\n"], "max_gen_toks": 6, "do_sample": False, "temperature": 0},
            "filter_list": [
                {
                    "name": "strip",
                    "filter": [{"function": "regex", "regex_pattern": r"\s*(\S+)"}, {"function": "take_first"}],
                }
            ],
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for name, config in tasks.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **config}))
    return directory


def run_lm_eval(completions_url: str, tasks_dir: Path) -> dict[str, Any]:
    """lm-eval's results, with the per-sample log-likelihoods and generations."""
    results = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": completions_url,
            "model": SERVED,
            "tokenizer": str(MODEL_DIR),
            "tokenizer_backend": "huggingface",
            "batch_size": 4,
            "max_retries": 1,
        },
        tasks=["kvpress_needle_choice", "kvpress_needle_answer"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    assert results is not None
    return results


def choice_loglikelihoods(results: dict[str, Any]) -> list[list[float]]:
    samples = sorted(results["samples"]["kvpress_needle_choice"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def generations(results: dict[str, Any]) -> list[str]:
    samples = sorted(results["samples"]["kvpress_needle_answer"], key=lambda s: s["doc_id"])
    return [s["resps"][0][0] for s in samples]


def finished_with(metrics_text: str, policy: str) -> float:
    """Requests the server finished under `policy`: the count of its retention histogram (both servers)."""
    match = re.search(rf'kvpress_kv_retention_ratio_count\{{policy="{policy}"\}} ([0-9.e+]+)', metrics_text)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module", autouse=True)
def offline_datasets() -> Iterator[None]:
    """`datasets` (under lm-eval) must read the local JSONL and never ask the hub for anything."""
    import datasets.config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.fixture(scope="module")
def policy_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("policies")
    quarter = directory / "snapkv-quarter.yaml"
    quarter.write_text(yaml.safe_dump(SNAPKV_QUARTER))
    return {"full": "full", "snapkv": str(quarter)}


def _kvpress_serve(policy: str) -> LiveServer:
    return _start(MODEL_DIR, served_model_name=SERVED, kv_policy=policy, num_pages=4096, page_size=16)


@pytest.fixture(scope="module")
def kvpress_results(tasks_dir: Path, policy_files: dict[str, str]) -> Iterator[dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, Any]] = {}
    for name, policy in policy_files.items():
        with _kvpress_serve(policy) as live:
            results[name] = run_lm_eval(f"{live.url}/v1/completions", tasks_dir)
            results[name]["kvpress_metrics"] = httpx.get(f"{live.url}/metrics", timeout=10).text
    yield results


@pytest.fixture(scope="module")
def vllm_results(
    tasks_dir: Path, policy_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, Any]] = {}
    logs = tmp_path_factory.mktemp("vllm-lm-eval")
    for name, policy in policy_files.items():
        args = [
            str(MODEL_DIR),
            "--kv-policy",
            policy,
            "--served-model-name",
            SERVED,
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "8",
            "--additional-config",
            json.dumps({"kv_num_pages": 4096}),
        ]
        metrics = {"KVPRESS_METRICS_FILE": str(logs / f"{name}-metrics.json")}
        with vllm_server(args, logs / f"{name}.log", metrics) as url:
            results[name] = run_lm_eval(f"{url}/v1/completions", tasks_dir)
            results[name]["kvpress_metrics"] = httpx.get(f"{url}/metrics", timeout=10).text
    yield results


def test_lm_eval_runs_against_kvpress_serve_with_two_policies(kvpress_results: dict[str, dict[str, Any]]) -> None:
    for name, results in kvpress_results.items():
        assert 0.0 <= results["results"]["kvpress_needle_choice"]["acc,none"] <= 1.0, name
        assert len(choice_loglikelihoods(results)) == DOCS and len(generations(results)) == DOCS
    full, quarter = kvpress_results["full"], kvpress_results["snapkv"]
    # Echo-scored choices are read before compression: identical under both policies.
    assert choice_loglikelihoods(full) == choice_loglikelihoods(quarter)
    assert finished_with(quarter["kvpress_metrics"], "snapkv") >= DOCS  # the generations ran compressed
    assert finished_with(full["kvpress_metrics"], "snapkv") == 0


@pytest.mark.heavy  # two `vllm serve` processes, about 2.5 minutes
def test_lm_eval_gives_the_same_results_through_vllm_serve(
    kvpress_results: dict[str, dict[str, Any]], vllm_results: dict[str, dict[str, Any]]
) -> None:
    for name in ("full", "snapkv"):
        ours, theirs = kvpress_results[name], vllm_results[name]
        for mine, other in zip(choice_loglikelihoods(ours), choice_loglikelihoods(theirs), strict=True):
            assert mine == pytest.approx(other, abs=1e-4), name
        # vLLM detokenizes with the prompt as context, so a word-level tokenizer's answer starts with the
        # separating space there and not in `kvpress serve`'s text; the words are the same.
        assert [g.strip() for g in generations(ours)] == [g.strip() for g in generations(theirs)], name
        for task, metric in (("kvpress_needle_choice", "acc,none"), ("kvpress_needle_answer", "exact_match,strip")):
            assert ours["results"][task][metric] == theirs["results"][task][metric], (name, task)
    assert finished_with(vllm_results["snapkv"]["kvpress_metrics"], "snapkv") >= DOCS
    assert finished_with(vllm_results["full"]["kvpress_metrics"], "snapkv") == 0
