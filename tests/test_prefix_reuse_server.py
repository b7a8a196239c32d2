"""Compressed prefix reuse over HTTP: `kv_prefix_tokens`, `usage.prompt_tokens_details.cached_tokens`,
the prefix-cache metrics, the on/off flag, and concurrent attached requests that stay isolated."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import LONG_PROMPT, LiveServer, _start, _write_model, metric

from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.policies import PolicyConfigError
from vllm_kvpress_ext.server.config import ServerConfig

POLICY = {"name": "snapkv", "ratio": 0.5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("prefix-server-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    with _start(model_dir) as live:
        yield live


def body(ids: list[int], boundary: int | None, **extra: Any) -> dict[str, Any]:
    fields = {"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "kv_policy": POLICY, **extra}
    return fields if boundary is None else {**fields, "kv_prefix_tokens": boundary}


def test_kv_prefix_tokens_reuses_the_compressed_context(server: LiveServer, model_dir: Path) -> None:
    context = [int(t) for t in server.engine.tokenizer.encode(LONG_PROMPT)]
    questions = [[7 + q, 9, 11 + q, 13] for q in range(4)]
    c = len(context)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        hits = metric(http, "kvpress_prefix_cache_hits_total")
        first = http.post("/v1/completions", json=body(context + questions[0], c)).json()
        assert "prompt_tokens_details" not in first["usage"]  # it compressed the context itself
        assert metric(http, "kvpress_prefix_cache_entries") >= 1 and metric(http, "kvpress_prefix_cache_pages") > 0

        async def concurrent() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                calls = [client.post("/v1/completions", json=body(context + q, c)) for q in questions[1:]]
                return [r.json() for r in await asyncio.gather(*calls)]

        attached = asyncio.run(concurrent())
        for answer in attached:
            assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": c}
        assert metric(http, "kvpress_prefix_cache_hits_total") == hits + 3

    # The same requests on a server without prefix caching: the same answers, nothing cached.
    with _start(model_dir, enable_prefix_caching=False) as fresh, httpx.Client(base_url=fresh.url, timeout=60) as http:
        for q, answer in zip(questions[1:], attached, strict=True):
            alone = http.post("/v1/completions", json=body(context + q, c)).json()
            assert alone["choices"][0]["text"] == answer["choices"][0]["text"]
            assert "prompt_tokens_details" not in alone["usage"]
        assert fresh.engine.runner.prefix_store is None


def test_kv_prefix_tokens_is_bounded(server: LiveServer) -> None:
    ids = [int(t) for t in server.engine.tokenizer.encode(LONG_PROMPT)]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for bad in (0, -1, len(ids), 1 << 21, "3", 2.5):
            response = http.post("/v1/completions", json=body(ids, None, kv_prefix_tokens=bad))
            assert response.status_code == 400, bad
            assert response.json()["error"]["param"] in ("kv_prefix_tokens", None), response.text


def test_serve_flag_default_and_off(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text and "(default: on;" in text
    assert ServerConfig(model_dir=Path(".")).enable_prefix_caching is True
    with pytest.raises(ValueError, match="max_cached_prefixes"):
        ServerConfig(model_dir=Path("."), max_cached_prefixes=0)


def test_chat_names_its_context_by_messages(server: LiveServer) -> None:
    context = [
        {"role": "system", "content": "answer from the records ."},
        {"role": "user", "content": LONG_PROMPT},
    ]

    def chat(question: str, **extra: Any) -> httpx.Response:
        messages = [*context, {"role": "user", "content": question}]
        fields = {"messages": messages, "max_tokens": 4, "temperature": 0, "kv_policy": POLICY, **extra}
        return http.post("/v1/chat/completions", json=fields)

    with httpx.Client(base_url=server.url, timeout=60) as http:
        first = chat("what is key trout ?", kv_prefix_messages=2).json()
        assert "prompt_tokens_details" not in first["usage"]
        second = chat("what is the sky ?", kv_prefix_messages=2).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < second["usage"]["prompt_tokens"]
        # The boundary is the rendered length of the context messages: kv_prefix_tokens says the same.
        third = chat("what is the mill ?", kv_prefix_tokens=cached).json()
        assert third["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
        for bad in (
            {"kv_prefix_messages": 3},
            {"kv_prefix_messages": 0},
            {"kv_prefix_messages": 1, "kv_prefix_tokens": 4},
        ):
            response = chat("x", **bad)
            assert response.status_code == 400, bad


def test_auto_matching_chat_turns_attach_to_the_previous_turn(model_dir: Path) -> None:
    """`--prefix-matching auto`: a chat naming no context takes every message but the last as its context
    on its first turn; the next turn attaches to what that turn left (its context compressed, the rest
    as written) and answers as a fresh run naming the first turn's context does."""
    system = {"role": "system", "content": LONG_PROMPT}
    turns = ["what is key trout ?", "what is the sky ?", "what is the mill ?"]

    def chat(http: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        fields = {"messages": messages, "max_tokens": 4, "temperature": 0, "kv_policy": POLICY, **extra}
        response = http.post("/v1/chat/completions", json=fields)
        assert response.status_code == 200, response.text
        return dict(response.json())

    history: list[dict[str, str]] = [system]
    answers, cached = [], []
    # Each turn's context under the request's own policy (`--context-policy request`), as the fresh runs name it.
    with (
        _start(model_dir, prefix_matching="auto", context_policy="request") as live,
        httpx.Client(base_url=live.url, timeout=60) as http,
    ):
        tokenizer = live.engine.tokenizer
        for question in turns:
            history.append({"role": "user", "content": question})
            reply = chat(http, history)
            answers.append(reply["choices"][0]["message"]["content"])
            cached.append(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
            history.append({"role": "assistant", "content": answers[-1]})
        rendered = tokenizer.apply_chat_template([system], add_generation_prompt=False, tokenize=True)
        system_tokens = len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        assert cached[0] == 0 and cached[1] > system_tokens and cached[2] > cached[1]
    with _start(model_dir, enable_prefix_caching=False) as fresh, httpx.Client(base_url=fresh.url, timeout=60) as http:
        for turn in range(len(turns)):
            messages = history[: 2 + 2 * turn]
            alone = chat(http, messages, kv_prefix_tokens=system_tokens)
            assert alone["choices"][0]["message"]["content"] == answers[turn], turn


def test_a_chats_context_is_compressed_once_by_a_policy_that_keeps_what_questions_need(model_dir: Path) -> None:
    """By default the messages before the last user message are a context, compressed alone and reused by every
    later question about it. Under SnapKV (which would choose by the context's own last tokens) the server's
    `--context-policy` (KVzip) compresses it, at the request's budget, and `usage.kv_policy` says so; under a
    question-agnostic policy the request's own does; `full` is not split (its exact cache is reused as is).
    The answers equal a fresh server's given the same context and policy by name."""
    context = [{"role": "system", "content": LONG_PROMPT}]
    questions = ["what is key trout ?", "what is the sky ?", "what is the mill ?"]

    def chat(http: httpx.Client, question: str, policy: Any, **extra: Any) -> dict[str, Any]:
        messages = [*context, {"role": "user", "content": question}]
        fields = {"messages": messages, "max_tokens": 4, "temperature": 0, "kv_policy": policy, **extra}
        response = http.post("/v1/chat/completions", json=fields)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def cached(reply: dict[str, Any]) -> int:
        return int(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))

    with _start(model_dir) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        rendered = live.engine.tokenizer.apply_chat_template(context, add_generation_prompt=False, tokenize=True)
        c = len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        snapkv = [chat(http, q, POLICY) for q in questions]
        assert [r["usage"]["kv_policy"] for r in snapkv] == ["kvzip"] * 3
        assert [cached(r) for r in snapkv] == [0, c, c]
        agnostic = [chat(http, q, "expected_attention") for q in questions[:2]]
        assert [r["usage"]["kv_policy"] for r in agnostic] == ["expected_attention"] * 2
        assert [cached(r) for r in agnostic] == [0, c]
        full = chat(http, questions[0], "full")
        # Not split; it reads the exact context the first question kept just before compressing it.
        assert full["usage"]["kv_policy"] == "full" and cached(full) == c
    kvzip = {"name": "kvzip", "ratio": POLICY["ratio"]}
    with (
        _start(model_dir, enable_prefix_caching=False) as fresh,
        httpx.Client(base_url=fresh.url, timeout=60) as http,
    ):
        for question, reply in zip(questions, snapkv, strict=True):
            alone = chat(http, question, kvzip, kv_prefix_tokens=c)
            assert alone["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]
    # `none`: no default context, each request compressed whole by its own policy.
    with _start(model_dir, context_policy="none") as live, httpx.Client(base_url=live.url, timeout=60) as http:
        replies = [chat(http, q, POLICY) for q in questions[:2]]
        assert [r["usage"]["kv_policy"] for r in replies] == ["snapkv"] * 2


def test_context_policy_flag(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ServerConfig(model_dir=Path(".")).context_policy == "kvzip"
    assert ServerConfig(model_dir=Path("."), context_policy='{"name": "streaming_llm"}').context_policy == {
        "name": "streaming_llm"
    }
    for bad in ("bogus", "full", "wgkv", "{not json"):
        with pytest.raises(PolicyConfigError):
            ServerConfig(model_dir=Path("."), context_policy=bad)
    assert main(["serve", str(model_dir), "--context-policy", "full"]) == 2  # before the model loads
    assert "--context-policy must compress" in capsys.readouterr().err


def test_prefix_matching_flag() -> None:
    assert ServerConfig(model_dir=Path(".")).prefix_matching == "named"
    with pytest.raises(ValueError, match="prefix_matching must be named or auto"):
        ServerConfig(model_dir=Path("."), prefix_matching="longest")
    with pytest.raises(SystemExit):
        main(["serve", "some-model", "--prefix-matching", "longest"])
