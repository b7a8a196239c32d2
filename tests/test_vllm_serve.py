"""`vllm serve MODEL --kv-policy snapkv`: vLLM's own OpenAI server with the plugin, as a user runs it.

One server (a subprocess on a loopback port, vLLM's API and engine-core processes) serves the whole
module. The `openai` SDK gets correct answers to retrieval prompts (completions and chat, streamed
and not), per-request policies change the KV bytes reported in `usage`, a bad policy is a 400 after
which the server still answers, and `/metrics` carries the `kvpress_*` series beside vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from vllm_utils import MODEL_DIR, retrieval_prompts, retrieval_samples, vllm_server

from vllm_kvpress_ext.bench.tasks import score
from vllm_kvpress_ext.bench.tasks.prompt import chat_messages

pytestmark = pytest.mark.slow

MODEL = "bundled"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("vllm") / "serve.log"
    args = [
        str(MODEL_DIR),
        "--kv-policy",
        "snapkv",
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--additional-config",
        json.dumps({"kv_num_pages": 2000}),
    ]
    metrics = {"KVPRESS_METRICS_FILE": str(log_path.with_name("kvpress-metrics.json"))}
    with vllm_server(args, log_path, metrics) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_chat_answer_retrieval_prompts(client: openai.OpenAI) -> None:
    samples = retrieval_samples(2, seed=7100)
    specs = retrieval_prompts(2, seed=7100)
    for sample, spec in zip(samples, specs, strict=True):
        common = {"model": MODEL, "max_tokens": spec.max_new_tokens, "temperature": 0.0}
        stops = {"stop_token_ids": list(spec.stop_ids)}
        completion = client.completions.create(prompt=spec.token_ids, extra_body=stops, **common)
        assert score(sample, completion.choices[0].text), completion.choices[0].text
        streamed = client.completions.create(prompt=spec.token_ids, stream=True, extra_body=stops, **common)
        assert score(sample, "".join(chunk.choices[0].text for chunk in streamed))
        chat = client.chat.completions.create(messages=chat_messages(sample), **common)  # type: ignore[arg-type]
        assert score(sample, chat.choices[0].message.content or ""), chat.choices[0].message.content
        chunks = client.chat.completions.create(messages=chat_messages(sample), stream=True, **common)  # type: ignore[arg-type]
        assert score(sample, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert completion.usage is not None and completion.usage.model_extra["kv_policy"] == "snapkv"


def test_per_request_policies_change_kv_bytes(client: openai.OpenAI) -> None:
    prompt = retrieval_prompts(1, context_length=384, seed=7200)[0].token_ids

    def usage(extra: dict[str, object]) -> dict[str, object]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, extra_body=extra)
        assert out.usage is not None
        return dict(out.usage.model_extra or {})

    full = usage({"vllm_xargs": {"kv_policy": "full"}})
    quarter = usage({"vllm_xargs": {"kv_policy": "snapkv", "kv_ratio": 0.25}})
    tenth = usage({"kv_policy": {"name": "snapkv", "ratio": 0.1}})  # the embedded server's body field
    default = usage({})
    assert (full["kv_policy"], quarter["kv_policy"], tenth["kv_policy"], default["kv_policy"]) == (
        "full",
        "snapkv",
        "snapkv",
        "snapkv",
    )
    assert full["kv_retention"] == 1.0
    assert full["kv_bytes"] > quarter["kv_bytes"] > tenth["kv_bytes"] > 0  # type: ignore[operator]
    assert quarter["kv_retention"] == pytest.approx(0.25, abs=0.05)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"vllm_xargs": {"kv_policy": "nonexistent"}}, "known policies"),
        ({"vllm_xargs": {"kv_policy": "snapkv", "kv_ratio": 7}}, "ratio"),
        ({"vllm_xargs": {"kv_ratio": 0.5}}, "kv_policy"),
        ({"kv_policy": "snapkv", "vllm_xargs": {"kv_policy": "h2o"}}, "disagree"),
        ({"logprobs": 2}, "logprobs"),
    ],
)
def test_a_bad_request_is_400_and_the_server_keeps_serving(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="key", max_tokens=2, extra_body=extra)
    assert caught.value.status_code == 400
    assert param in str(caught.value)
    ok = client.completions.create(model=MODEL, prompt="key", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_carry_kvpress_series_beside_vllms(server: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=retrieval_prompts(1)[0].token_ids, max_tokens=2)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text
    for series in (
        "kvpress_kv_pages_total 2000.0",
        "kvpress_kv_pages_free",
        "kvpress_kv_pages_held",
        "kvpress_pool_preemptions_total",
        'kvpress_kv_retention_ratio_bucket{le="1.0",policy="snapkv"}',
        'kvpress_compression_seconds_count{policy="snapkv"}',
        'kvpress_requests_finished_total{policy="snapkv"}',
    ):
        assert series in text, series
