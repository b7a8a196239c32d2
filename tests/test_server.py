"""The OpenAI-compatible server, live: uvicorn on 127.0.0.1 (ephemeral port) in a thread, a tiny random
model with the suite tokenizer, exercised through the real `openai` SDK and raw httpx.

Every error case checks status and OpenAI's error shape, then that a normal request still succeeds.
Pool accounting is checked through `/metrics` (`kvpress_kv_pages_used`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from vllm_kvpress_ext.api.errors import error_type
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLM, LLMEngine, SamplingParams
from vllm_kvpress_ext.models.writer import llama_config, random_model, save_model
from vllm_kvpress_ext.server.app import create_app
from vllm_kvpress_ext.server.config import BUNDLED_MODEL_DIR, ServerConfig, parse_size
from vllm_kvpress_ext.server.launch import build_engine, engine_thread
from vllm_kvpress_ext.server.streaming import TextDeltas
from vllm_kvpress_ext.tasks.tokenizer import BOS, EOS, VOCABULARY, save_tokenizer

MODEL = "tiny-suite"
PROMPT = "key trout is 65 . what is key trout ? answer :"
# ~120 tokens: long enough that a ratio budget visibly drops pages.
LONG_PROMPT = " ".join(["the sky looks blue and the sun shines bright over the old mill ."] * 8) + " " + PROMPT
PROMPT_TOKENS = len(PROMPT.split()) + 1  # one token per word, plus <bos>
SNAPKV_SMALL = {"name": "snapkv", "ratio": 0.1, "window": 4}


class LiveServer:
    """uvicorn serving `create_app(config, engine)` on an ephemeral 127.0.0.1 port, in a thread."""

    def __init__(
        self, config: ServerConfig, engine: LLMEngine, thread: concurrent.futures.ThreadPoolExecutor | None = None
    ) -> None:
        self.engine = engine
        self.app = create_app(config, engine, thread)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def _write_model(path: Path) -> Path:
    save_tokenizer(path)
    config = llama_config(
        vocab_size=len(VOCABULARY),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
        bos_token_id=VOCABULARY.index(BOS),
        eos_token_id=VOCABULARY.index(EOS),
    )
    return save_model(random_model(config, seed=1, std=0.3), config, path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("server-model"))


def _start(model_dir: Path, **overrides: Any) -> LiveServer:
    settings: dict[str, Any] = {
        "model_dir": model_dir,
        "served_model_name": MODEL,
        "num_pages": 4096,
        "page_size": 4,
        "max_num_seqs": 32,
        "dtype": "float32",
        **overrides,
    }
    config = ServerConfig(**settings)
    return LiveServer(config, build_engine(config))


def test_the_engine_is_built_and_stepped_on_one_thread(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvpress serve` builds the engine on the thread its loop then runs on (launch.engine_thread: one
    OpenMP team, not two)."""
    thread = engine_thread()
    config = ServerConfig(model_dir=model_dir, served_model_name=MODEL, num_pages=256, page_size=4, dtype="float32")
    built_on = thread.submit(threading.get_ident).result()
    engine = thread.submit(build_engine, config).result()
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step() -> list[Any]:
        stepped_on.add(threading.get_ident())
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    try:
        with LiveServer(config, engine, thread) as live, httpx.Client(base_url=live.url, timeout=30) as client:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        thread.shutdown(wait=True)
    assert stepped_on == {built_on}


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    with _start(model_dir) as live:
        yield live


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture()
def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)


# ---------------------------------------------------------------------- helpers


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    text = client.get("/metrics").text
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def pool_empty(client: httpx.Client) -> bool:
    """Nothing running, and no page held outside the prefix store (with prefix caching on, the default, a
    finished request's cache stays there for reuse until the pool needs its pages)."""
    held = metric(client, "kvpress_kv_pages_used")
    return metric(client, "kvpress_requests_running") == 0 and held <= metric(client, "kvpress_prefix_cache_pages")


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and error["type"] == error_type(status)  # as vLLM's server fills them
    if param is not None:
        assert error["param"] == param
    return error


def assert_serving(client: httpx.Client) -> None:
    """A normal request succeeds (used after every error case)."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


class HeldSteps:
    """An engine hook that holds steps: while held, `engine.step()` runs nothing and returns no output.

    The engine loop keeps taking its commands between (empty) steps, so requests are admitted,
    queued, rejected and aborted as usual, but none advances: a test decides how many real steps run
    (`allow`) instead of hoping a generation outlasts a client's timeout.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.step = engine.step
        self.lock = threading.Lock()
        self.permits: int | None = 0  # None: released, every step runs
        self.steps = 0

    def __call__(self) -> list[Any]:
        with self.lock:
            run = self.permits is None or self.permits > 0
            if run and self.permits is not None:
                self.permits -= 1
        if not run:
            time.sleep(0.001)  # held: yield the CPU instead of spinning
            return []
        outputs = self.step()
        with self.lock:
            self.steps += 1
        return outputs

    def allow(self, count: int) -> None:
        with self.lock:
            assert self.permits is not None
            self.permits += count

    def release(self) -> None:
        with self.lock:
            self.permits = None

    def ran(self, count: int) -> bool:
        with self.lock:
            return self.steps >= count


# ---------------------------------------------------------------------- happy paths


def test_models_health_openapi(http: httpx.Client, server: LiveServer) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    debug = http.get("/debug/kv").json()
    assert debug["pages_total"] == 4096 and "snapkv" in debug["policies"]


def test_sdk_completion_with_and_without_policy(sdk: openai.OpenAI) -> None:
    full = sdk.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    assert full.choices[0].text and full.usage is not None
    extra = full.usage.model_extra or {}
    assert extra["kv_policy"] == "full" and extra["kv_retention"] == 1.0
    assert extra["kv_bytes"] > 0 and extra["kv_bytes_peak"] >= extra["kv_bytes"]
    assert full.usage.completion_tokens == 4 and full.usage.prompt_tokens > 100

    pressed = sdk.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0, extra_body={"kv_policy": SNAPKV_SMALL}
    )
    kv = pressed.usage.model_extra or {}  # type: ignore[union-attr]
    assert kv["kv_policy"] == "snapkv"
    assert kv["kv_retention"] < 0.5 and kv["kv_bytes"] < extra["kv_bytes"] / 2
    assert kv["kv_tokens_kept"] < extra["kv_tokens_kept"]

    by_xargs = sdk.completions.create(
        model=MODEL,
        prompt=LONG_PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"vllm_xargs": {"kv_policy": json.dumps(SNAPKV_SMALL)}},
    )
    assert by_xargs.usage.model_extra == kv  # type: ignore[union-attr]
    by_name = sdk.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=4, extra_body={"vllm_xargs": {"kv_policy": "snapkv"}}
    )
    named = by_name.usage.model_extra or {}  # type: ignore[union-attr]
    assert named["kv_policy"] == "snapkv" and named["kv_bytes"] < extra["kv_bytes"]


def test_sdk_completion_stream(sdk: openai.OpenAI) -> None:
    whole = sdk.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "kv_policy": "snapkv"}
    )
    chunks = list(
        sdk.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kv_policy": "snapkv"},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    assert (usage.model_extra or {})["kv_policy"] == "snapkv"


def test_sdk_chat_and_stream(sdk: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "what is key trout ?"}]
    whole = sdk.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "kv_policy": SNAPKV_SMALL},
    )
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kv_policy": SNAPKV_SMALL},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and (chunks[-1].usage.model_extra or {})["kv_policy"] == "snapkv"


def test_httpx_chat_policy_lowers_kv_bytes(http: httpx.Client) -> None:
    def chat(**extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 3, **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage: dict[str, Any] = r.json()["usage"]
        return usage

    full, pressed = chat(), chat(kv_policy=SNAPKV_SMALL)
    xargs = chat(vllm_xargs={"kv_policy": {"name": "snapkv", "ratio": "0.1", "window": "4"}})
    assert full["kv_policy"] == "full" and pressed["kv_policy"] == "snapkv"
    assert pressed["kv_bytes"] < full["kv_bytes"] and pressed["kv_retention"] < full["kv_retention"]
    assert xargs["kv_tokens_kept"] == pressed["kv_tokens_kept"]  # entries: bytes count shared pages 1/k


def test_httpx_stream_with_stop_string_never_leaks_it(http: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    words = http.post("/v1/completions", json=base).json()["choices"][0]["text"].split()
    stop = words[3]
    stopped = http.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={**base, "stop": [stop], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == stopped["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == stopped["finish_reason"] == "stop"


def test_32_concurrent_streams_complete_and_free_the_pool(server: LiveServer, http: httpx.Client) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[str, str | None]:
        policy = {"kv_policy": SNAPKV_SMALL} if i % 2 else {}
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"{PROMPT} {i}",
            max_tokens=8,
            stream=True,
            seed=i,
            extra_body={"ignore_eos": True, **policy},
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32 and all(reason == "length" and text for text, reason in results)
    wait_for(lambda: pool_empty(http))
    assert metric(http, "kvpress_requests_running_peak") > 1


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
        ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
        ("/v1/completions", {"prompt": "a", "kv_policy": "nonexistent"}, 400, "kv_policy"),
        ("/v1/completions", {"prompt": "a", "kv_policy": {"name": "snapkv", "ratio": 7}}, 400, "kv_policy"),
        ("/v1/completions", {"prompt": "a", "kv_policy": {"name": "snapkv", "bogus": 1}}, 400, "kv_policy"),
        ("/v1/completions", {"prompt": "a", "vllm_xargs": {"kv_policy": "nonexistent"}}, 400, "kv_policy"),
        ("/v1/completions", {"prompt": "a", "vllm_xargs": {"kv_policy": "{bad json"}}, 400, None),
        ("/v1/completions", {"prompt": "a", "kv_policy": "configs/snapkv.yaml"}, 400, "kv_policy"),
        (
            "/v1/completions",
            {"prompt": "a", "kv_policy": "snapkv", "vllm_xargs": {"kv_policy": "h2o"}},
            400,
            "kv_policy",
        ),
        ("/v1/completions", {"prompt": "a", "vllm_xargs": {"other": 1}}, 400, "vllm_xargs"),
        ("/v1/completions", {"prompt": " ".join(["the"] * 1100)}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "a", "n": 16385}, 400, "n"),  # vLLM's VLLM_MAX_N_SEQUENCES
        ("/v1/completions", {"prompt": ["a"] * 10, "n": 2000}, 400, "n"),
        ("/v1/completions", {"prompt": ["a"] * 1025}, 400, "prompt"),  # vLLM's VLLM_MAX_COMPLETION_PROMPTS
        ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 1025}, 400, "max_tokens"),  # beyond max_model_len
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
            400,
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [1, 2, 100000]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "a", "echo": True, "max_tokens": 0, "stream": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "a", "kv_polcy": "snapkv"}, 400, "kv_polcy"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {str(len(VOCABULARY)): 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"trout": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    error = assert_error(http.post(path, json=body), status, param)
    if param == "kv_policy" and "nonexistent" in json.dumps(body):
        assert "snapkv" in error["message"]  # names the valid choices
    assert_serving(http)


def test_malformed_json_and_unknown_route(http: httpx.Client) -> None:
    bad = http.post("/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert "malformed JSON" in assert_error(bad, 400)["message"]
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(http.get("/v1/nothing"), 404)
    assert_serving(http)


def test_sdk_raises_on_errors(sdk: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="known policies"):
        sdk.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={"kv_policy": "nope"})
    assert_serving(http)


def test_engine_failure_is_500_and_the_server_keeps_serving(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = server.engine.model
    forward = model.forward
    failures = {"left": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    errors_before = metric(http, "kvpress_requests_total", 'status="error"')
    failures["left"] = 1
    error = assert_error(http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3}), 500)
    assert error["type"] == "InternalServerError" and "injected failure" in error["message"]
    wait_for(lambda: pool_empty(http))
    assert_serving(http)

    failures["left"] = 1
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "InternalServerError"
    assert metric(http, "kvpress_requests_total", 'status="error"') == errors_before + 2
    wait_for(lambda: pool_empty(http))
    assert http.get("/health").status_code == 200
    assert_serving(http)


# ---------------------------------------------------------------------- disconnects


def test_stream_disconnect_aborts_and_frees_pages(server: LiveServer, http: httpx.Client) -> None:
    aborted = metric(http, "kvpress_requests_total", 'status="aborted"')
    body = {"prompt": LONG_PROMPT, "max_tokens": 800, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as own, own.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
        for _ in range(3):
            next(events)
        assert metric(http, "kvpress_kv_pages_used") > 0
    # The connection is closed with the request mid-generation.
    wait_for(lambda: metric(http, "kvpress_requests_total", 'status="aborted"') == aborted + 1)
    wait_for(lambda: pool_empty(http))
    assert_serving(http)


def test_non_streaming_disconnect_aborts(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted = metric(http, "kvpress_requests_total", 'status="aborted"')
    finished = metric(http, "kvpress_requests_total", 'status="length"')
    held = HeldSteps(server.engine)
    monkeypatch.setattr(server.engine, "step", held)
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 800, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        client.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: metric(http, "kvpress_requests_waiting") == 1)  # admitted; no step has run
        held.allow(1)  # the prefill: the request now holds pages and has its first token
        wait_for(lambda: held.ran(1) and metric(http, "kvpress_requests_running") == 1)
        assert metric(http, "kvpress_kv_pages_used") > 0
    # The client hung up mid-generation; the engine is still held, so only the abort can end the request.
    wait_for(lambda: metric(http, "kvpress_requests_total", 'status="aborted"') == aborted + 1)
    wait_for(lambda: pool_empty(http))
    assert held.steps == 1
    assert metric(http, "kvpress_requests_total", 'status="length"') == finished
    held.release()
    assert_serving(http)


# ---------------------------------------------------------------------- a small server: queue and pool limits


def test_queue_full_and_pool_too_small(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One request at a time, one waiting; 256 pages of 4 tokens over 2 layers x 2 KV heads = 256 tokens.
    with (
        _start(model_dir, num_pages=256, max_num_seqs=1, max_queue=1) as live,
        httpx.Client(base_url=live.url, timeout=30) as client,
    ):
        # Steps are held: the running request stays mid-generation for as long as the test needs.
        held = HeldSteps(live.engine)
        monkeypatch.setattr(live.engine, "step", held)
        long_body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=long_body) as running:
            assert running.status_code == 200
            held.allow(1)  # its prefill, which streams the first token
            # Keep the iterator referenced: dropping it closes the connection, which aborts the request.
            running_events = sse_events(running.iter_lines())
            next(running_events)  # admitted and generating
            with client.stream("POST", "/v1/completions", json=long_body) as waiting:
                assert waiting.status_code == 200  # accepted into the queue
                error = assert_error(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}), 429)
                assert error["type"] == "Too Many Requests" and error["code"] == 429
                assert metric(client, "kvpress_requests_total", 'status="queue_full"') == 1
                assert metric(client, "kvpress_requests_running") == metric(client, "kvpress_requests_waiting") == 1
                assert held.steps == 1
        held.release()
        wait_for(lambda: pool_empty(client))
        assert_serving(client)

        # A request that outgrows the whole pool ends with `length` instead of leaving its client hanging.
        grow = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        grown = client.post("/v1/completions", json=grow).json()
        assert grown["choices"][0]["finish_reason"] == "length"
        # The last sampled token is never written to the cache, hence the -1.
        assert PROMPT_TOKENS + grown["usage"]["completion_tokens"] - 1 <= 256 < PROMPT_TOKENS + 400
        wait_for(lambda: pool_empty(client))

        too_big = client.post("/v1/completions", json={"prompt": " ".join(["the"] * 300), "max_tokens": 1})
        assert "pool" in assert_error(too_big, 400, "prompt")["message"]
        assert_serving(client)
        wait_for(lambda: pool_empty(client))


# ---------------------------------------------------------------------- pieces


def test_text_deltas_hold_back_stop_prefixes() -> None:
    deltas = TextDeltas(("stop here",))
    assert deltas.delta("a b st", False) == "a b "
    assert deltas.delta("a b sto", False) == ""
    assert deltas.delta("a b stone", False) == "stone"
    assert deltas.delta("a b stone", True) == ""
    final = TextDeltas(("x",))
    assert final.delta("abc", False) == "abc" and final.delta("abc", True) == ""


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096
    for bad in ("", "lots", "2XB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_cli_serve_needs_a_model_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert BUNDLED_MODEL_DIR.is_dir()  # MODEL_DIR is optional while the bundled model ships ...
    monkeypatch.setattr("vllm_kvpress_ext.server.config.BUNDLED_MODEL_DIR", tmp_path / "absent")
    assert main(["serve"]) == 2  # ... and required, with a clear message, where it does not
    assert "the bundled model is missing from this installation" in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a model directory (no config.json)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--kv-policy",
        "--host",
        "--port",
        "--num-pages",
        "--kv-memory",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-queue",
        "--dtype",
        "--device",
        "--served-model-name",
    ):
        assert flag in help_text


def test_serve_rejects_a_model_dir_with_random_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvpress_ext.cli import main

    assert main(["serve", str(tmp_path), "--random-model"]) == 2
    assert "not both" in capsys.readouterr().err


# ---------------------------------------------------------------------- batched prompts and n samples

GREEDY_BODY: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "kv_policy": SNAPKV_SMALL}


def _complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={**GREEDY_BODY, **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _stream_choices(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[int, str], dict[str, Any]]:
    """Text per choice index and the final usage of a stream."""
    texts: dict[int, str] = {}
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    for event in events[:-1]:
        for choice in event["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    assert events[-1]["choices"] == []
    return texts, events[-1]["usage"]


def test_a_batch_of_prompts_answers_each_as_alone(server: LiveServer, http: httpx.Client, sdk: openai.OpenAI) -> None:
    prompts = [PROMPT, LONG_PROMPT, "key carp is 12 . what is key carp ? answer :"]
    alone = [_complete(http, prompt=p) for p in prompts]
    batch = _complete(http, prompt=prompts)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    usage = batch["usage"]
    # Entries, not bytes: a request's bytes count a page held by k (a prompt kept by the prefix store, one a
    # later request reads) 1/k, so they depend on what the store held at the time.
    for field in ("prompt_tokens", "completion_tokens", "kv_tokens_kept"):
        assert usage[field] == sum(a["usage"][field] for a in alone), field
    assert 0 < usage["kv_bytes"] <= usage["kv_bytes_peak"]
    kept, full = usage["kv_tokens_kept"], sum(a["usage"]["kv_tokens_full"] for a in alone)
    assert usage["kv_tokens_full"] == full and usage["kv_retention"] == pytest.approx(kept / full, abs=1e-6)
    # token lists batch the same way, and so do streams (chunks tagged by index) and the openai SDK.
    token_lists = [[int(t) for t in server.engine.tokenizer.encode(p)] for p in prompts]
    assert [c["text"] for c in _complete(http, prompt=token_lists)["choices"]] == [c["text"] for c in batch["choices"]]
    texts, streamed_usage = _stream_choices(http, "/v1/completions", {**GREEDY_BODY, "prompt": prompts})
    assert texts == {i: a["choices"][0]["text"] for i, a in enumerate(alone)}
    assert streamed_usage["kv_tokens_kept"] == usage["kv_tokens_kept"]
    out = sdk.completions.create(
        model=MODEL, prompt=prompts[:2], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert len(out.choices) == 2
    wait_for(lambda: pool_empty(http))


def test_n_samples_are_seeded_like_vllms_children(server: LiveServer, http: httpx.Client) -> None:
    sampled = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "kv_policy": SNAPKV_SMALL}
    one = [_complete(http, prompt=PROMPT, **sampled, seed=40 + j) for j in range(3)]
    three = _complete(http, prompt=PROMPT, **sampled, seed=40, n=3)
    assert [c["text"] for c in three["choices"]] == [o["choices"][0]["text"] for o in one]
    usage = three["usage"]
    assert usage["prompt_tokens"] == one[0]["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == 18
    # The samples share the prompt's pages (each counts a third of a shared page): one prompt plus three
    # tails, less than three separate requests and more than one (docs/server.md). Only whole pages stay
    # shared (a sample's first token copies the partial last page), so the prompt here keeps many.
    whole = {**sampled, "kv_policy": "full", "prompt": LONG_PROMPT}
    alone = [_complete(http, **whole, seed=40 + j)["usage"]["kv_bytes"] for j in range(3)]
    shared = _complete(http, **whole, seed=40, n=3)["usage"]["kv_bytes"]
    assert alone[0] < shared < sum(alone)
    # A batch of 2 prompts x n=2: prompt-major indices.
    batch = _complete(http, prompt=[PROMPT, LONG_PROMPT], n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"]  # greedy: the samples agree
    wait_for(lambda: pool_empty(http))


def test_logit_bias_moves_the_tokens_it_names(http: httpx.Client) -> None:
    """+100 on "trout" makes greedy decoding say it every step (200 is clamped to 100, as vLLM clamps);
    -100 on greedy's own tokens makes it say other ones."""
    trout = VOCABULARY.index("trout")
    greedy = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert _complete(http, **greedy, logit_bias={str(trout): 100})["choices"][0]["text"].split() == ["trout"] * 3
    assert _complete(http, **greedy, logit_bias={str(trout): 200})["choices"][0]["text"].split() == ["trout"] * 3
    plain = _complete(http, **greedy)["choices"][0]["text"].split()
    banned = {str(VOCABULARY.index(word)): -100 for word in plain}
    assert not set(_complete(http, **greedy, logit_bias=banned)["choices"][0]["text"].split()) & set(plain)


def test_a_logit_bias_that_is_not_a_number_is_refused(http: httpx.Client) -> None:
    """Python's JSON parser reads NaN and Infinity; neither is a bias (clamping would turn NaN into -100)."""
    for value in ("NaN", "Infinity"):
        body = '{"prompt": "a", "max_tokens": 1, "logit_bias": {"3": ' + value + "}}"
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert_error(response, 400, "logit_bias")


def test_chat_with_n_streams_every_choice(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "what is key trout ?"}],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        "ignore_eos": True,
    }
    whole = http.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    roles = [e["choices"][0] for e in events[:2]]
    assert [(c["index"], c["delta"]["role"]) for c in roles] == [(0, "assistant"), (1, "assistant")]
    texts, usage = _stream_choices(http, "/v1/chat/completions", body)
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert usage["completion_tokens"] == 10
    wait_for(lambda: pool_empty(http))


# ---------------------------------------------------------------------- log-probabilities and echo


def _offline(model_dir: Path, prompt: list[int], policy: Any, **params: Any) -> Any:
    """The offline API's answer on the server's model, for parity (same engine settings as `_start`)."""
    llm = LLM(model_dir, dtype="float32", num_pages=4096, page_size=4, max_num_seqs=32)
    return llm.generate([prompt], SamplingParams(**params), policy=policy)[0]


def test_completion_logprobs_and_echo_equal_the_offline_api(
    server: LiveServer, http: httpx.Client, model_dir: Path
) -> None:
    ids = [int(t) for t in server.engine.tokenizer.encode(LONG_PROMPT)]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "kv_policy": SNAPKV_SMALL}
    served = _complete(http, **body, logprobs=2, echo=True)
    offline = _offline(
        model_dir, ids, SNAPKV_SMALL, max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    choice = served["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [e.logprob for e in offline.prompt_logprobs[1:]] + [e.logprob for e in offline.logprobs]
    assert logprobs["token_logprobs"][1:] == expected  # the same numbers, to the last bit
    decode = server.engine.tokenizer.decode
    assert choice["text"] == decode(ids) + offline.text
    for token_id, token, top in zip(
        ids[1:] + offline.output_token_ids, logprobs["tokens"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert token == decode([token_id]) and token in top and 2 <= len(top) <= 3
    generated_top = logprobs["top_logprobs"][len(ids) :]
    assert all(
        max(top.values()) == top[token]
        for top, token in zip(generated_top, logprobs["tokens"][len(ids) :], strict=True)
    )
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
    )


def test_prompt_scoring_the_way_evaluation_harnesses_ask(server: LiveServer, http: httpx.Client) -> None:
    """lm-evaluation-harness scores a continuation with echo + logprobs on token ids (max_tokens 1, or 0)."""
    ids = [int(t) for t in server.engine.tokenizer.encode(PROMPT)]
    full = _complete(http, prompt=ids, max_tokens=0, echo=True, logprobs=1, kv_policy="full")
    compressed = _complete(http, prompt=ids, max_tokens=0, echo=True, logprobs=1, kv_policy=SNAPKV_SMALL)
    harness = _complete(http, prompt=[ids, ids[:-2]], max_tokens=1, echo=True, logprobs=1, temperature=0)
    for answer in (full, compressed):
        choice = answer["choices"][0]
        # Token-id prompts are echoed decoded, special tokens included (as vLLM echoes them).
        assert choice["text"] == server.engine.tokenizer.decode(ids) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    # The prompt is scored as prefilled, before the policy compresses: the same under any policy.
    assert full["choices"][0]["logprobs"] == compressed["choices"][0]["logprobs"]
    first, cut = harness["choices"]
    assert first["logprobs"]["token_logprobs"][: len(ids)] == full["choices"][0]["logprobs"]["token_logprobs"]
    assert len(first["logprobs"]["tokens"]) == len(ids) + 1 and len(cut["logprobs"]["tokens"]) == len(ids) - 1
    # echo alone returns the prompt before the completion, without logprobs.
    echoed = _complete(http, prompt=PROMPT, max_tokens=2, echo=True)
    assert echoed["choices"][0]["text"].startswith(PROMPT) and echoed["choices"][0]["logprobs"] is None


def test_chat_logprobs(http: httpx.Client, model_dir: Path) -> None:
    body = {
        "messages": [{"role": "user", "content": "what is key trout ?"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    answer = http.post("/v1/chat/completions", json=body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert item["bytes"] == list(item["token"].encode("utf-8"))
        assert len(item["top_logprobs"]) == 3 and item["top_logprobs"][0]["logprob"] == item["logprob"]  # greedy
    # The suite tokenizer is word-level: a token decoded alone carries no separating space.
    assert "".join(item["token"] for item in content) == answer["choices"][0]["message"]["content"].replace(" ", "")
    plain = http.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_vllms_prompt_logprobs_extension(server: LiveServer, http: httpx.Client) -> None:
    ids = [int(t) for t in server.engine.tokenizer.encode(PROMPT)]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    choice = _complete(http, **body)["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for token_id, legacy, position in zip(
        ids[1:], choice["logprobs"]["token_logprobs"][1:], prompt_logprobs[1:], strict=False
    ):
        entry = position[str(token_id)]
        assert entry["logprob"] == legacy and entry["decoded_token"] == server.engine.tokenizer.decode([token_id])
        assert 3 <= len(position) <= 4 and {e["rank"] for e in position.values()} >= {1, 2, 3}
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "key"}], "max_tokens": 1, "prompt_logprobs": 0},
    ).json()["choices"][0]
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    error = assert_error(http.post("/v1/completions", json={**body, "stream": True}), 400)
    assert error["param"] in ("echo", "logprobs", "prompt_logprobs")


def test_streamed_logprobs_add_up_to_the_whole_answers(http: httpx.Client) -> None:
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "kv_policy": SNAPKV_SMALL}
    whole = _complete(http, prompt=[PROMPT, LONG_PROMPT], logprobs=2, **common)
    with http.stream(
        "POST", "/v1/completions", json={"prompt": [PROMPT, LONG_PROMPT], "logprobs": 2, "stream": True, **common}
    ) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    for choice in whole["choices"]:
        pieces = [c["logprobs"] for e in events for c in e["choices"] if c["index"] == choice["index"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for piece in pieces for x in piece[key]] == choice["logprobs"][key], key
    chat_body = {
        "messages": [{"role": "user", "content": "what is key trout ?"}],
        "logprobs": True,
        "top_logprobs": 2,
        **common,
    }
    chat = http.post("/v1/chat/completions", json=chat_body).json()["choices"][0]["logprobs"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**chat_body, "stream": True}) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    streamed = [item for e in events for c in e["choices"] if c["logprobs"] for item in c["logprobs"]["content"]]
    assert streamed == chat
    # echo in a stream: the prompt (and its logprobs) first, then the answer, as the whole response has them.
    echo_body = {"prompt": [PROMPT, LONG_PROMPT], "logprobs": 1, "echo": True, **common}
    whole = _complete(http, **echo_body)
    with http.stream("POST", "/v1/completions", json={**echo_body, "stream": True}) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    for choice in whole["choices"]:
        mine = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key], key
