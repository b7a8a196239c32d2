"""`vllm serve MODEL --kv-policy snapkv`: vLLM's own OpenAI server with the plugin, as a user runs it.

One server (a subprocess on a loopback port, vLLM's API and engine-core processes) serves the whole
module. The `openai` SDK gets correct answers to retrieval prompts (completions and chat, streamed
and not), per-request policies change the KV bytes reported in `usage`, a bad policy is a 400 after
which the server still answers, and `/metrics` carries the `kvpress_*` series beside vLLM's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from tolerances import logprob_atol
from transformers import AutoTokenizer
from vllm_utils import MODEL_DIR, retrieval_prompts, retrieval_samples, vllm_server

from vllm_kvpress_ext.bench.harness import scrape_metric
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.tasks.synthetic import score
from vllm_kvpress_ext.tasks.synthetic.prompt import chat_messages

pytestmark = pytest.mark.slow

MODEL = "bundled"
FINISHED_SNAPKV = 'kvpress_requests_finished_total{policy="snapkv"}'


@pytest.fixture(scope="module", params=["project", "vllm"], ids=["own-runner", "vllm-runner"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The plugin on its own runner, and on vLLM's model runner (`kv_runner: vllm`): the same client tests."""
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
        json.dumps({"kv_num_pages": 2000, "kv_runner": request.param}),
        "--enable-prompt-tokens-details",
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
        ({"logprobs": 21}, "logprobs"),
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


def test_a_named_context_is_compressed_once_and_read_by_each_question(server: str, client: openai.OpenAI) -> None:
    """`kv_prefix_tokens` over HTTP (vllm_plugin/contexts.py), on both runners: three questions about one context
    each answer with the embedded engine's tokens for (context, question) under the server's policy, the later
    two report the context cached, and the store's hits reach `/metrics`."""
    prompt = retrieval_prompts(1, context_length=384, seed=7300)[0].token_ids
    boundary = len(prompt) - 12
    tails = [prompt[boundary:]] + [p.token_ids[-12:] for p in retrieval_prompts(2, context_length=128, seed=7400)]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "kv_prefix_tokens": boundary}
    body |= {"ignore_eos": True, "return_token_ids": True}

    def store_hits() -> float:
        return scrape_metric(httpx.get(f"{server}/metrics").text, "kvpress_prefix_cache_hits_total") or 0.0

    hits = store_hits()
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=2000, page_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for index, tail in enumerate(tails):
        engine.add_request(prompt[:boundary] + tail, params, policy="snapkv", compress_after=boundary)
        finished = [
            out for _ in range(100) if engine.has_unfinished_requests() for out in engine.step() if out.finished
        ]
        (expected,) = finished
        reply = httpx.post(f"{server}/v1/completions", json={**body, "prompt": prompt[:boundary] + tail}, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["token_ids"] == expected.output_token_ids
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == (boundary if index else 0)
        assert answer["usage"]["kv_policy"] == "snapkv"
    assert store_hits() == hits + 2  # the first question computed its context
    too_long = httpx.post(f"{server}/v1/completions", json={**body, "prompt": prompt[:boundary]}, timeout=120)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "kv_prefix_tokens"


def test_a_chats_earlier_messages_are_its_default_context(server: str, client: openai.OpenAI) -> None:
    """On both runners, a chat's messages before its last user message are its context by default
    (vllm_plugin/chat_context.py): compressed alone by the server's context policy (KVzip: the server's SnapKV
    would keep only what its context's last sentences attend to), once, and read by each question; the context
    is the chat template's render of those messages. A one-message chat is not split."""
    sample = retrieval_samples(1, context_length=256, seed=7500)[0]
    context = [{"role": "system", "content": "Answer from the document."}, {"role": "user", "content": sample.prompt}]
    context.append({"role": "assistant", "content": "I have read it."})
    questions = ["What is the first key?", "Repeat the first number."]

    def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0)  # type: ignore[arg-type]
        assert reply.usage is not None
        return reply.usage.model_dump()

    single = ask([{"role": "user", "content": sample.prompt}])
    assert single["kv_policy"] == "snapkv" and not (single.get("prompt_tokens_details") or {}).get("cached_tokens")
    usages = [ask([*context, {"role": "user", "content": q}]) for q in questions]
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    rendered = tokenizer.apply_chat_template(context, add_generation_prompt=False, tokenize=True)
    length = len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert [u["kv_policy"] for u in usages] == ["kvzip", "kvzip"]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, length]


def test_metrics_carry_kvpress_series_beside_vllms(server: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=retrieval_prompts(1)[0].token_ids, max_tokens=2)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text
    for series in (
        "kvpress_kv_pages_total 2000.0",
        "kvpress_kv_pages_free",
        "kvpress_kv_pages_used",
        "kvpress_pool_preemptions_total",
        'kvpress_kv_retention_ratio_bucket{le="1.0",policy="snapkv"}',
        'kvpress_compression_seconds_count{policy="snapkv"}',
        'kvpress_requests_finished_total{policy="snapkv"}',
    ):
        assert series in text, series


def test_a_request_ending_on_a_stop_string_reports_its_figures(server: str, client: openai.OpenAI) -> None:
    """A stop string ends the request in vLLM's API process, after the engine's output: that output carries
    the figures already, streamed or not, and `/metrics` counts the request."""
    prompt = retrieval_prompts(1, seed=7300)[0].token_ids
    common: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
    free = client.completions.create(**common, extra_body={"ignore_eos": True})
    words = free.choices[0].text.split()
    assert len(words) >= 3, free.choices[0].text
    stop = words[2]  # ends the answer after the first two words, well before its 12 tokens
    finished_before = scrape_metric(httpx.get(f"{server}/metrics", timeout=10).text, FINISHED_SNAPKV) or 0.0
    out = client.completions.create(**common, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop
    assert out.usage is not None and out.usage.model_extra["kv_policy"] == "snapkv"
    assert out.usage.model_extra["kv_bytes"] > 0 and 0 < out.usage.model_extra["kv_retention"] < 1
    chunks = list(
        client.completions.create(
            **common, stop=[stop], stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    usage = chunks[-1].usage
    # Entries, not bytes: bytes count a page shared with vLLM's kept prefix blocks 1/k.
    assert usage is not None and usage.model_extra["kv_tokens_kept"] == out.usage.model_extra["kv_tokens_kept"]
    deadline = time.monotonic() + 10  # the abort reaches the engine after the answer
    while time.monotonic() < deadline:
        finished = scrape_metric(httpx.get(f"{server}/metrics", timeout=10).text, FINISHED_SNAPKV) or 0.0
        if finished >= finished_before + 2:
            break
        time.sleep(0.2)
    assert finished == finished_before + 2


def test_banned_words_on_vllms_runner(request: pytest.FixtureRequest, client: openai.OpenAI) -> None:
    """On vLLM's runner vLLM's sampler serves what the plugin's own runner refuses, here `bad_words` under
    SnapKV. (Structured output needs a tokenizer that can spell JSON, which the bundled model's word-level
    one cannot: `tests/test_vllm_native_policies.py` checks it on SmolLM2.)"""
    if request.node.callspec.params["server"] != "vllm":
        pytest.skip("the plugin's own runner refuses bad_words with a 400")
    prompt = retrieval_prompts(1, seed=7400)[0].token_ids
    common: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    free = client.completions.create(**common)
    words = free.choices[0].text.split()
    assert words
    banned = client.completions.create(**common, extra_body={"bad_words": [words[0]]})
    assert words[0] not in banned.choices[0].text.split()
    assert banned.usage is not None and banned.usage.model_extra["kv_policy"] == "snapkv"


def test_a_deeply_nested_body_is_a_400_and_the_server_keeps_serving(server: str, client: openai.OpenAI) -> None:
    nested = b'{"model": "bundled", "prompt": "a", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    response = httpx.post(
        f"{server}/v1/completions", content=nested, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="key", max_tokens=2).choices


def _stream_usage(server: str, path: str, body: dict[str, object]) -> dict[str, object]:
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    final = json.loads(data[-2])
    assert final["choices"] == []
    return dict(final["usage"])


def test_streams_with_include_usage_end_with_the_kv_figures(server: str, client: openai.OpenAI) -> None:
    sample = retrieval_samples(1, seed=7300)[0]
    prompt = retrieval_prompts(1, seed=7300)[0].token_ids
    common = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert whole.usage is not None
    streamed = _stream_usage(
        server,
        "/v1/completions",
        {**common, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}},
    )
    expected = dict(whole.usage.model_extra or {})
    for field in ("kv_policy", "kv_bytes", "kv_bytes_peak", "kv_retention", "kv_tokens_kept", "kv_tokens_full"):
        assert streamed[field] == expected[field], field
    chat = _stream_usage(
        server,
        "/v1/chat/completions",
        {
            **common,
            "messages": chat_messages(sample),
            "stream": True,
            "stream_options": {"include_usage": True},
            "vllm_xargs": {"kv_policy": "full"},
        },
    )
    assert chat["kv_policy"] == "full" and chat["kv_retention"] == 1.0 and chat["kv_bytes"] > 0  # type: ignore[operator]


def test_batched_prompts_and_n_samples_report_the_sum_of_their_requests(client: openai.OpenAI) -> None:
    prompts = [spec.token_ids for spec in retrieval_prompts(2, context_length=192, seed=7400)]
    common = {"model": MODEL, "max_tokens": 3, "temperature": 0.0, "extra_body": {"ignore_eos": True}}

    def kv(prompt: object, **extra: object) -> dict[str, object]:
        out = client.completions.create(prompt=prompt, **{**common, **extra})  # type: ignore[call-overload]
        assert out.usage is not None
        return dict(out.usage.model_extra or {})

    alone = [kv(p) for p in prompts]
    batch = kv(prompts)
    # Entries add up exactly; bytes count a page shared with prefix-cache entries 1/k, so they depend on what
    # the cache holds at the time.
    assert batch["kv_tokens_kept"] == sum(a["kv_tokens_kept"] for a in alone)  # type: ignore[misc]
    assert 0 < batch["kv_bytes"] <= batch["kv_bytes_peak"]  # type: ignore[operator]
    # n samples of one prompt: each sample prefills and holds the compressed prompt itself (docs/vllm.md).
    sampled = kv(prompts[0], n=3, seed=5, temperature=1.0)
    assert sampled["kv_tokens_kept"] == 3 * alone[0]["kv_tokens_kept"]  # type: ignore[operator]
    assert sampled["kv_retention"] == alone[0]["kv_retention"]


def test_the_running_gauge_returns_to_zero(server: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="key", max_tokens=3)
    stopped = client.completions.create(model=MODEL, prompt="key", max_tokens=30, stop=[" "])  # an abort
    assert stopped.choices[0].finish_reason in ("stop", "length")
    for _ in range(100):  # the snapshot file is read at scrape time; give the engine process a moment
        text = httpx.get(f"{server}/metrics", timeout=10).text
        if "kvpress_requests_running 0.0" in text:
            break
        time.sleep(0.1)
    assert "kvpress_requests_running 0.0" in text


def test_prompt_scoring_and_logprobs_equal_the_embedded_engines(client: openai.OpenAI) -> None:
    """What lm-evaluation-harness sends (echo, logprobs 1, max_tokens 1, token ids) and chat logprobs,
    against the embedded engine's numbers for the same prompt and policy."""
    prompt = retrieval_prompts(1, context_length=160, seed=7500)[0].token_ids
    scored = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0.0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    engine = LLMEngine(MODEL_DIR, dtype=torch.float32, num_pages=2000, page_size=16)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    request_id = engine.add_request(prompt, params, policy="snapkv")
    want = next(o for _ in range(100) for o in engine.step() if o.finished and o.request_id == request_id)
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    for got, want_logprob in zip(logprobs.token_logprobs[1:], expected, strict=True):
        assert got == pytest.approx(want_logprob, abs=logprob_atol(torch.float32, engine.config, want_logprob))
    assert all(top is not None and len(top) >= 1 for top in logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "key"}],
        max_tokens=3,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 3
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob for item in content)
