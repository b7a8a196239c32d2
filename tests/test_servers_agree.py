"""`kvpress serve` and `vllm serve` with the plugin answer the same unusual requests the same way.

Both servers run the bundled model with SnapKV as the default policy and the same context length. Each
request below goes to both, and both must answer with the status written beside it; where they refuse,
both bodies have OpenAI's error shape, filled as vLLM fills it (`code` the status). The statuses are
vLLM's (`api/limits.py` reads vLLM's limits), except in this project's `kv_` namespace and for `best_of`,
which both refuse by name. What one engine implements and the other refuses (structured output, tools) is
not here: docs/server.md lists it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import httpx
import pytest
from vllm_utils import MODEL_DIR, http_server, vllm_server

from vllm_kvpress_ext.api.errors import error_type

pytestmark = pytest.mark.slow

MODEL = "bundled"
MAX_MODEL_LEN = 1024
PROMPT = "The key is 42. What is the key?"
USER = [{"role": "user", "content": "hello"}]


def completion(**fields: Any) -> tuple[str, Any]:
    return "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields: Any) -> tuple[str, Any]:
    return "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


CASES: dict[str, tuple[tuple[str, Any], int]] = {
    "n above 128": (completion(n=129, max_tokens=1), 200),
    "n above vLLM's limit": (completion(n=16385), 400),
    "n and stream": (completion(n=2, stream=True), 200),
    "best_of": (completion(best_of=2), 400),
    "echo": (completion(echo=True), 200),
    "300 prompts": (("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 300, "max_tokens": 1}), 200),
    "1,025 prompts": (("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 1025, "max_tokens": 1}), 400),
    "stream_options without stream": (completion(stream_options={"include_usage": True}), 400),
    "kv_prefix_tokens negative": (completion(kv_prefix_tokens=-1), 400),
    "kv_prefix_tokens beyond the prompt": (completion(kv_prefix_tokens=10**6), 400),
    "kv_prefix_tokens a string": (completion(kv_prefix_tokens="abc"), 400),
    "an unknown kv_ field": (completion(kv_polcy="full"), 400),
    "an unknown field": (completion(not_a_field=1), 200),
    "max_tokens 0": (completion(max_tokens=0), 400),
    "max_tokens negative": (completion(max_tokens=-1), 400),
    "max_tokens beyond the context": (completion(max_tokens=MAX_MODEL_LEN + 1), 400),
    "temperature negative": (completion(temperature=-1), 400),
    "temperature above 2": (completion(temperature=3), 400),
    "top_p 0": (completion(top_p=0), 400),
    "top_p above 1": (completion(top_p=1.5), 400),
    "top_k -2": (completion(top_k=-2), 400),
    "top_k 0": (completion(top_k=0), 200),
    "logprobs 5": (completion(logprobs=5), 200),
    "logprobs 21": (completion(logprobs=21), 400),
    "logprobs negative": (completion(logprobs=-1), 400),
    "prompt_logprobs": (completion(prompt_logprobs=1), 200),
    "four stop strings": (completion(stop=["a", "b", "c", "d"]), 200),
    "five stop strings": (completion(stop=["a", "b", "c", "d", "e"]), 400),
    "an empty prompt": (completion(prompt=""), 400),
    "no prompt tokens": (completion(prompt=[]), 400),
    "a token beyond the vocabulary": (completion(prompt=[99999999]), 400),
    "another model": (completion(model="nope"), 404),
    "an unknown policy": (completion(kv_policy="nope"), 400),
    "a policy ratio above 1": (completion(kv_policy={"name": "snapkv", "ratio": 2}), 400),
    "seed negative": (completion(seed=-1), 200),
    "seed a string": (completion(seed="x"), 400),
    "presence_penalty 3": (completion(presence_penalty=3), 400),
    "frequency_penalty -3": (completion(frequency_penalty=-3), 400),
    "logit_bias 200": (completion(logit_bias={"5": 200}), 200),
    "logit_bias beyond the vocabulary": (completion(logit_bias={"99999999": 1}), 400),
    "suffix": (completion(suffix="x"), 400),
    "min_tokens above max_tokens": (completion(min_tokens=10, max_tokens=2), 400),
    "user": (completion(user="u"), 200),
    "ignore_eos": (completion(ignore_eos=True), 200),
    "chat without messages": (chat(messages=[]), 400),
    "chat with an unknown role": (chat(messages=[{"role": "robot", "content": "x"}]), 400),
    "chat echo after a user message": (chat(echo=True), 200),
    "chat tool_choice without tools": (chat(tool_choice="required"), 400),
    "chat tool_choice none": (chat(tool_choice="none"), 200),
    "chat json_schema without a schema": (chat(response_format={"type": "json_schema"}), 400),
    "chat top_logprobs 21": (chat(logprobs=True, top_logprobs=21), 400),
    "chat top_logprobs without logprobs": (chat(top_logprobs=2), 400),
    "chat n above 128": (chat(n=129, max_tokens=1), 200),
    "chat best_of": (chat(best_of=2), 400),
    "chat text parts": (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), 200),
    "chat image part": (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        400,
    ),
    "chat max_completion_tokens": (chat(max_completion_tokens=3), 200),
    "chat stream_options without stream": (chat(stream_options={"include_usage": True}), 400),
    "chat kv_prefix_messages": (chat(kv_prefix_messages=1), 400),
    "chat ending on an assistant message": (chat(messages=[*USER, {"role": "assistant", "content": "x"}]), 200),
    "chat user content null": (chat(messages=[{"role": "user", "content": None}]), 400),
    "chat system message only": (chat(messages=[{"role": "system", "content": "x"}]), 200),
    "chat temperature 2.5": (chat(temperature=2.5), 400),
    "chat max_tokens 0": (chat(max_tokens=0), 400),
    "chat parallel_tool_calls": (chat(parallel_tool_calls=False), 200),
    "a body that is not JSON": (("/v1/completions", "{not json"), 400),
    "a body that is a list": (("/v1/completions", [1, 2]), 400),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("agree")
    common = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    plugin = [str(MODEL_DIR), "--kv-policy", "snapkv", *common, "--max-num-seqs", "8"]
    plugin += ["--additional-config", json.dumps({"kv_num_pages": 4000})]
    embedded = [sys.executable, "-m", "vllm_kvpress_ext.cli", "serve", str(MODEL_DIR), "--kv-policy", "snapkv"]
    embedded += [*common, "--num-pages", "4000", "--log-level", "warning"]
    with vllm_server(plugin, logs / "vllm.log") as vllm_url, http_server(embedded, logs / "kvpress.log") as kv_url:
        yield {"vllm serve": vllm_url, "kvpress serve": kv_url}


def _send(url: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
    return httpx.post(url + path, json=body, timeout=120)


def test_both_servers_answer_each_unusual_request_alike(servers: dict[str, str]) -> None:
    wrong = []
    for name, ((path, body), status) in CASES.items():
        for server, url in servers.items():
            response = _send(url, path, body)
            if response.status_code != status:
                wrong.append(f"{name}: {server} answered {response.status_code}, not {status}: {response.text[:200]}")
            elif status >= 400:
                error = response.json().get("error")
                if not isinstance(error, dict) or sorted(error) != ["code", "message", "param", "type"]:
                    wrong.append(f"{name}: {server}'s error is not OpenAI-shaped: {response.text[:200]}")
                # vLLM names a schema violation by its HTTP phrase and its own checks' failures by class.
                elif error["code"] != status or error["type"] not in (error_type(status), HTTPStatus(status).phrase):
                    wrong.append(f"{name}: {server}'s error is not filled as vLLM fills it: {response.text[:200]}")
    assert not wrong, "\n".join(wrong)


def test_both_servers_apply_a_logit_bias_alike(servers: dict[str, str]) -> None:
    """+100 on one token: greedy decoding on either server says it at every step, the same text on both."""
    path, body = completion(prompt=[1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True, logit_bias={"7": 100})
    texts = {server: _send(url, path, body).json()["choices"][0]["text"] for server, url in servers.items()}
    plain = {
        server: _send(url, path, {**body, "logit_bias": None}).json()["choices"][0]["text"]
        for server, url in servers.items()
    }
    assert len(set(texts.values())) == 1 and texts != plain, (texts, plain)
