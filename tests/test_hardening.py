"""Hardening: one request never hurts another, no file is read on a client's say-so, every bad input is a
clean 4xx, shutdown drains. One test (or a few) per defect, reproduced as it was found, against the live
server of `test_server.py` (a tiny random model with the suite tokenizer) unless the bundled model is needed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.types import Message, Receive, Scope, Send
from test_server import MODEL, PROMPT, LiveServer, _start, _write_model, assert_error, pool_empty, wait_for

from vllm_kvpress_ext.assets import DEFAULT_MODEL_DIR
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.llm import chat_token_ids
from vllm_kvpress_ext.engine.sampler import apply_penalties, filter_logits, sample
from vllm_kvpress_ext.policies import H2OPolicy, PolicyFiles, XKVPolicy, allowed_files, set_allowed_files
from vllm_kvpress_ext.policies.xkv import XKVProfile
from vllm_kvpress_ext.server.guards import BodySizeLimit

STREAM_PROMPTS = [f"key trout is {n} . what is key trout ? answer :" for n in range(10, 18)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("hardening-model"))


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return XKVProfile(fractions=[0.5, 0.5]).save(tmp_path_factory.mktemp("profiles") / "half.yaml")


@pytest.fixture(scope="module")
def server(model_dir: Path, profile_path: Path) -> Iterator[LiveServer]:
    previous = allowed_files()
    files = PolicyFiles()
    files.add("xkv", "profile", "half", profile_path)
    set_allowed_files(files)
    try:
        with _start(model_dir, max_request_bytes=256 << 10) as live:
            yield live
    finally:
        set_allowed_files(previous)


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def complete(client: httpx.Client, **body: Any) -> httpx.Response:
    # json.dumps writes NaN/Infinity as Python's json does (httpx's json= refuses them).
    content = json.dumps({"prompt": PROMPT, "max_tokens": 2, **body})
    return client.post("/v1/completions", content=content, headers={"content-type": "application/json"})


def stream_text(url: str, body: dict[str, Any], started: threading.Event | None = None) -> tuple[str, str | None, bool]:
    """(text, finish_reason, saw [DONE]) of one streamed completion."""
    text, reason, done = "", None, False
    with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            assert "error" not in event, event
            if started is not None:
                started.set()
            if event["choices"]:
                text += event["choices"][0]["text"]
                reason = event["choices"][0]["finish_reason"] or reason
    return text, reason, done


# ---------------------------------------------------------------------- 1. one request fails nobody else


def test_bad_sampling_and_policy_values_never_fail_the_requests_in_flight(
    server: LiveServer, http: httpx.Client
) -> None:
    bodies = [
        {"prompt": p, "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True} for p in STREAM_PROMPTS
    ]
    alone = [complete(http, prompt=b["prompt"], max_tokens=60, ignore_eos=True, temperature=0).json() for b in bodies]
    started = threading.Event()
    with ThreadPoolExecutor(len(bodies)) as pool:
        streams = [pool.submit(stream_text, server.url, b, started) for b in bodies]
        assert started.wait(60)
        # Values that used to make a step raise (NaN probabilities, a seed overflow, an exhausted pool).
        assert complete(http, prompt="hi", max_tokens=4, top_p=1e-300).status_code == 200
        assert complete(http, prompt="hi", max_tokens=4, temperature=5e-324).status_code == 200
        assert_error(complete(http, kv_policy={"name": "gvote", "seed": 1180591620717411303424}), 400, "kv_policy")
        assert_error(complete(http, kv_policy={"name": "wgkv", "local_window": 1000000}), 400, "kv_policy")
        results = [s.result() for s in streams]
    for (text, reason, done), reference in zip(results, alone, strict=True):
        assert done and reason == "length"
        assert text == reference["choices"][0]["text"]  # greedy: the same tokens as when run alone
    wait_for(lambda: pool_empty(http))


def test_a_policy_that_raises_fails_only_its_own_request(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("policy bug")

    monkeypatch.setattr(H2OPolicy, "on_decode_step", broken)  # decode-time eviction
    monkeypatch.setattr(XKVPolicy, "plan_layer", broken)  # layer-wise compression inside the forward pass
    body = {"prompt": STREAM_PROMPTS[0], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    alone = complete(http, prompt=STREAM_PROMPTS[0], max_tokens=40, ignore_eos=True, temperature=0).json()
    started = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_text, server.url, body, started) for _ in range(4)]
        assert started.wait(60)
        for policy in ({"name": "h2o", "ratio": 0.5}, {"name": "xkv", "profile": "half"}):
            error = assert_error(complete(http, kv_policy=policy, max_tokens=8), 500)
            assert error["code"] == 500 and error["type"] == "InternalServerError" and "policy bug" in error["message"]
        for text, reason, done in (s.result() for s in streams):
            assert done and reason == "length" and text == alone["choices"][0]["text"]
    wait_for(lambda: pool_empty(http))
    assert complete(http).status_code == 200


def test_a_failed_prefill_step_spares_the_requests_decoding(
    server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward pass that raises fails its own batch only: a new prompt's prefill, not the streams decoding."""
    from vllm_kvpress_ext.engine.attention_context import PrefillContext

    model = server.engine.model
    forward = model.forward
    armed = threading.Event()

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set() and isinstance(args[2], PrefillContext):
            armed.clear()
            raise RuntimeError("injected prefill failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    body = {"prompt": STREAM_PROMPTS[1], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    alone = complete(http, **body).json()["choices"][0]["text"]
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_text, server.url, {**body, "stream": True}, e) for e in started]
        assert all(e.wait(60) for e in started)  # every stream has a token: past its own prefill
        armed.set()
        # A prompt no earlier request began with: it prefills (a cached prefix would skip the failing pass).
        error = assert_error(complete(http, prompt="x29 onion key trout is 3 .", max_tokens=4), 500)
        assert "injected prefill failure" in error["message"]
        for text, reason, done in (s.result() for s in streams):
            assert done and reason == "length" and text == alone
    wait_for(lambda: pool_empty(http))


# ---------------------------------------------------------------------- 2. bounded policy settings


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"name": "gvote", "num_samples": 100000}, "num_samples"),
        ({"name": "gvote", "num_samples": 1000000}, "num_samples"),
        ({"name": "gvote", "future_positions": 10000000}, "future_positions"),
        ({"name": "snapkv", "window": 10**9, "ratio": None, "tokens": 10**9}, "tokens"),
        ({"name": "snapkv", "kernel_size": 100001}, "kernel_size"),
        ({"name": "kvec", "lam": float("inf")}, "lam"),
        ({"name": "pyramidkv", "beta": 1e300}, "beta"),
    ],
)
def test_policy_fields_are_bounded(http: httpx.Client, policy: dict[str, Any], field: str) -> None:
    error = assert_error(complete(http, kv_policy=policy), 400, "kv_policy")
    assert field in error["message"] and "must" in error["message"]


def test_the_largest_gvote_settings_stay_cheap(http: httpx.Client) -> None:
    policy = {"name": "gvote", "num_samples": 64, "future_positions": 256}
    r = complete(http, prompt=" ".join([PROMPT] * 20), kv_policy=policy, max_tokens=2)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- 3. large bodies


def test_large_bodies_get_413_and_health_keeps_answering(server: LiveServer, http: httpx.Client) -> None:
    big = {"prompt": "the " * 100_000}  # 400 kB > the fixture's 256 KiB limit
    error = assert_error(http.post("/v1/completions", json=big), 413)
    assert error["code"] == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts the body as it arrives
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"the " * 2000
        yield b'"}'

    with httpx.Client(base_url=server.url, timeout=60) as own:
        assert (
            own.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}).status_code
            == 413
        )
    # A long prompt under the size limit is refused by length before full tokenization, off the event loop.
    long_prompt = {"prompt": "the " * 60_000}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: httpx.post(f"{server.url}/v1/completions", json=long_prompt, timeout=60))
        assert http.get("/health").status_code == 200
        error = assert_error(pending.result(), 400, "prompt")
    assert error["code"] == 400 and "limit" in error["message"]
    assert complete(http).status_code == 200


def test_a_client_still_sending_reads_the_413(server: LiveServer) -> None:
    """httpx's AsyncClient (the async openai SDK's transport) writes the whole body before it reads: the
    server must read the rest of an oversized body before answering, or the client sees a reset."""
    big = b'{"prompt": "' + b"the " * 10_000_000 + b'"}'  # 40 MB, far past the fixture's 256 KiB limit

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    async def post_twice() -> list[httpx.Response]:
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            declared = await client.post("/v1/completions", content=big, headers=headers)
            streamed = await client.post("/v1/completions", content=chunks(), headers=headers)
            after = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        return [declared, streamed, after]

    declared, streamed, after = asyncio.run(post_twice())
    for response in (declared, streamed):
        assert assert_error(response, 413)["code"] == 413
        assert response.headers.get("connection") != "close"  # read to its end: the connection is reused
    assert after.status_code == 200


def test_a_body_past_the_discard_bound_is_answered_at_once_and_closed() -> None:
    sent: list[Message] = []

    async def never_called(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the app must not see an oversized body")

    async def receive() -> Message:
        raise AssertionError("a body past the discard bound is not read")

    async def send(message: Message) -> None:
        sent.append(message)

    limit = BodySizeLimit(never_called, max_bytes=10, discard_bytes=100)
    scope = {"type": "http", "headers": [(b"content-length", b"101")]}
    asyncio.run(limit(scope, receive, send))
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]


# ---------------------------------------------------------------------- 4. no file read on a client's say-so


def test_policy_fields_never_name_server_files(http: httpx.Client, tmp_path: Path) -> None:
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: [hunter2\n")
    messages = set()
    for value in (str(secret), str(tmp_path / "missing.yaml"), "/etc/passwd", "../secret.yaml"):
        error = assert_error(complete(http, kv_policy={"name": "xkv", "profile": value}), 400, "kv_policy")
        assert "hunter2" not in error["message"] and str(tmp_path) not in error["message"]
        messages.add(error["message"])
    assert len(messages) == 1  # the same answer whether a path exists or not
    error = assert_error(complete(http, kv_policy={"name": "wgkv", "gates": "/etc/passwd"}), 400, "kv_policy")
    assert "root" not in error["message"]
    # The operator's allow-list works by name.
    assert complete(http, kv_policy={"name": "xkv", "profile": "half"}).status_code == 200


def test_policy_file_allow_list_validation(profile_path: Path) -> None:
    files = PolicyFiles.parse([f"xkv.profile:half={profile_path}"])
    assert files.names("xkv", "profile") == ["half"]
    for entry, message in [
        ("xkv.profile", "POLICY.FIELD:NAME=PATH"),
        (f"snapkv.window:w={profile_path}", "does not name a file"),
        ("xkv.profile:x=/nonexistent.yaml", "is not a file"),
        (f"xkv.profile:../x={profile_path}", "file name"),
    ]:
        with pytest.raises(ValueError, match=message):
            PolicyFiles.parse([entry])


# ---------------------------------------------------------------------- 5. 400s, not 500s; the connection survives


def test_bad_inputs_are_400_and_errors_keep_the_connection(
    http: httpx.Client, server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = assert_error(complete(http, kv_policy={"name": "wgkv", "gates": "/nonexistent.safetensors"}), 400)
    assert error["param"] == "kv_policy"
    raw = b'{"prompt": "abc\\ud800", "max_tokens": 2}'
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert assert_error(r, 400, "prompt")["code"] == 400
    chat = b'{"messages": [{"role": "user", "content": "abc\\ud800"}]}'
    assert_error(http.post("/v1/chat/completions", content=chat, headers={"content-type": "application/json"}), 400)

    import vllm_kvpress_ext.server.completions as completions

    def broken(_prefix: str) -> str:
        raise RuntimeError("handler bug")

    monkeypatch.setattr(completions, "new_id", broken)
    r = complete(http)
    assert assert_error(r, 500)["type"] == "InternalServerError" and r.headers.get("connection") != "close"
    monkeypatch.undo()
    assert complete(http).status_code == 200  # same client, same keep-alive connection
    wait_for(lambda: pool_empty(http))


# ---------------------------------------------------------------------- 6. shutdown drains


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_process(model_dir: Path, grace: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "vllm_kvpress_ext.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--shutdown-grace", str(grace), "--dtype", "float32", "--log-level", "warning", "--num-pages", "2048"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("grace", [30.0, 0.0])
def test_sigterm_drains_streams_then_exits_0(model_dir: Path, grace: float) -> None:
    process, url = _serve_process(model_dir, grace)
    try:
        tokens = 150
        body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        # Every stream must be under way before the signal: a connection that arrives during shutdown is
        # refused by the HTTP server, which is not what this test is about.
        started = [threading.Event() for _ in range(3)]
        events: list[list[dict[str, Any] | str]] = [[] for _ in range(3)]

        def one(i: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        events[i].append(data if data == "[DONE]" else json.loads(data))
                        started[i].set()

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(one, i) for i in range(3)]
            assert all(event.wait(60) for event in started)
            process.send_signal(signal.SIGTERM)
            for f in futures:
                f.result()
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr.decode()
    assert b"CancelledError" not in stderr, stderr.decode()
    for stream in events:
        assert stream[-1] == "[DONE]"
        last = stream[-2]
        assert isinstance(last, dict)
        if grace:
            assert last["choices"][0]["finish_reason"] == "length"  # finished whole
        else:
            # the documented error event, not a cut: 503, the server going away
            assert last["error"]["code"] == 503 and "shut down" in last["error"]["message"]


# ---------------------------------------------------------------------- 7. CLI usage errors


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--num-pages", "-5"],
        ["serve", "--page-size", "0"],
        ["serve", "--port", "99999"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--max-queue", "-1"],
        ["serve", "--max-num-batched-tokens", "0"],
        ["serve", "--dtype", "int8"],
        ["serve", "--max-request-size", "0"],
        ["serve", "--shutdown-grace", "-1"],
        ["serve", "--policy-file", "xkv.profile:x=/nonexistent.yaml"],
        ["bench", "serve", "--policies", "nope"],
    ],
)
def test_cli_bad_values_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cli_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA is not available" in err


# ---------------------------------------------------------------------- 8. docs and schema agree with behaviour


def test_empty_prompt_echo_zero_and_405(http: httpx.Client) -> None:
    assert assert_error(complete(http, prompt=""), 400, "prompt")["type"] == "BadRequestError"
    assert_error(complete(http, echo=0), 400, "echo")
    assert_error(complete(http, max_tokens=2.0), 400, "max_tokens")  # no silent conversions
    assert_error(complete(http, top_k="3"), 400, "top_k")
    r = http.get("/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_openapi_documents_what_the_server_sends(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "429", "500", "503"} <= set(responses)
        assert "422" not in responses
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]


# ---------------------------------------------------------------------- 9. chat vs completions


def test_chat_template_is_the_training_rendering() -> None:
    """The server's chat prompt is token for token what the bundled model was trained on."""
    from transformers import AutoTokenizer

    from vllm_kvpress_ext.tasks.synthetic import generate, training_example
    from vllm_kvpress_ext.tasks.synthetic.training import chat_conversation

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    for seed in range(5):
        sample = generate("associative_recall", 10_000 + seed)
        example = training_example(sample, tokenizer, all_turns=False)
        rendered = chat_token_ids(tokenizer, chat_conversation(sample, all_turns=False)[:1])
        assert rendered == example.token_ids[: example.answer_spans[0][0]]


@pytest.mark.slow
def test_chat_and_completions_accuracy_on_the_same_prompts() -> None:
    """Full cache, greedy, 40 prompts per row, both forms (docs/server.md prints these figures)."""
    import random

    from vllm_kvpress_ext.tasks.synthetic import generate
    from vllm_kvpress_ext.tasks.tokenizer import KEY_WORDS, VALUE_WORDS

    engine = LLMEngine(DEFAULT_MODEL_DIR, dtype="float32")
    tok = engine.tokenizer
    rng = random.Random(0)
    short: list[tuple[str, str]] = []
    for _ in range(40):
        keys, values = rng.sample(KEY_WORDS, 3), rng.sample(VALUE_WORDS, 3)
        asked = rng.randrange(3)
        records = " ".join(f"key {k} {v} ." for k, v in zip(keys, values, strict=True))
        short.append((f"{records} what is key {keys[asked]} ? answer :", values[asked]))
    rows = {
        "suite associative_recall": [generate("associative_recall", 10_000 + i) for i in range(40)],
        "suite associative_recall @1024": [
            generate("associative_recall", 10_000 + i, context_length=1024) for i in range(40)
        ],
    }
    cases = {name: [(f"{s.context} {s.question}", s.answer) for s in samples] for name, samples in rows.items()}
    cases["3-record prompts"] = short

    def correct(prompts: list[list[int]], answers: list[str]) -> int:
        params = SamplingParams(max_tokens=4, temperature=0)
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, str] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.text for o in engine.step() if o.finished})
        return sum(done[i].split()[: len(a.split())] == a.split() for i, a in zip(ids, answers, strict=True))

    figures = {}
    for name, items in cases.items():
        answers = [a for _, a in items]
        chat = correct([chat_token_ids(tok, [{"role": "user", "content": p}]) for p, _ in items], answers)
        plain = correct([tok.encode(p) for p, _ in items], answers)
        figures[name] = (chat, plain)
        print(f"{name}: chat {chat}/40, completions {plain}/40")
    assert figures["suite associative_recall"][0] >= 38  # the trained form answers the suite's prompts
    assert figures["3-record prompts"][1] >= 36


# ---------------------------------------------------------------------- 10. a ring never costs more than the prompt


def test_wgkv_ring_costs_no_more_than_full_on_a_short_prompt() -> None:
    """An 18-token prompt used to hold twice `full`'s bytes: its ring was sized by the policy, not the request."""
    engine = LLMEngine(DEFAULT_MODEL_DIR, dtype="float32", num_pages=512)
    prompt = "key trout 65 . key clam 62 . key lion 17 . what is key trout ?"
    assert len(engine.encode(prompt)) == 18
    for max_tokens in (1, 16):
        held: dict[str, tuple[int, int]] = {}
        for name in ("full", "wgkv"):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            rid = engine.add_request(prompt, params, policy={"name": name, "tau": 0.0} if name == "wgkv" else name)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        held[name] = (out.kv.kv_bytes, out.kv.kv_bytes_peak)
        assert 0 < held["wgkv"][0] <= held["full"][0] and held["wgkv"][1] <= held["full"][1], (max_tokens, held)


# ---------------------------------------------------------------------- 11. vLLM's sampling extensions


def _vllm_bench_completions_payload(prompt: str) -> dict[str, Any]:
    """What `vllm bench serve --backend openai` posts to /v1/completions (its request function's payload)."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # --ignore-eos; sampling flags such as --temperature would be merged in too
    }


def _vllm_bench_chat_payload(prompt: str) -> dict[str, Any]:
    """What `vllm bench serve --backend openai-chat` posts to /v1/chat/completions."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def test_vllm_bench_serve_payloads_drive_both_endpoints(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/completions", _vllm_bench_completions_payload(PROMPT)),
        ("/v1/chat/completions", _vllm_bench_chat_payload(PROMPT)),
    ):
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        usage = json.loads(data[-2])["usage"]
        assert usage["completion_tokens"] == 8


def test_vllm_extensions_are_accepted_and_neutral_only_ones_checked(http: httpx.Client) -> None:
    extensions = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "min_p": 0.05,
        "top_k": 20,
        "min_tokens": 3,
        "skip_special_tokens": False,
        "stop_token_ids": [3],
        "use_beam_search": False,
        "include_stop_str_in_output": False,
        "length_penalty": 1.0,
        "seed": 3,
    }
    r = complete(http, max_tokens=5, **extensions)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 3
    assert_error(complete(http, use_beam_search=True), 400, "use_beam_search")
    assert_error(complete(http, length_penalty=2.0), 400, "length_penalty")
    assert_error(complete(http, min_tokens=5, max_tokens=2), 400)
    assert_error(complete(http, repetition_penalty=0), 400, "repetition_penalty")


class _Req:
    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        self.params, self.prompt_token_ids, self.output_token_ids = params, prompt, output
        self.generator: torch.Generator | None = torch.Generator().manual_seed(0)


def test_sampler_extensions_follow_vllm() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    # repetition: positive logits divided, negative multiplied, only for tokens seen in prompt or output.
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[1], output=[0])
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 0.5, 1.0]))
    # presence once, frequency per occurrence, output tokens only.
    out = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2], [0, 0, 3])
    assert torch.allclose(out, torch.tensor([2.0 - 0.5 - 0.5, -1.0, 0.5, 1.0 - 0.5 - 0.25]))
    # min_p keeps tokens with at least min_p x the top probability.
    kept = torch.isfinite(filter_logits(logits, SamplingParams(min_p=0.3)))
    assert kept.tolist() == [True, False, False, True]
    # top_p that rounds to zero keeps the best token; a denormal temperature is greedy.
    assert torch.isfinite(filter_logits(logits, SamplingParams(top_p=1e-300))).tolist() == [True, False, False, False]
    assert SamplingParams(temperature=5e-324).greedy
    # min_tokens: EOS (0 here) and stop tokens are suppressed until enough tokens are out, greedy included.
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(3,))
    assert sample(logits.view(1, -1), [_Req(params, [1], [])], eos={0}) == [2]
    assert sample(logits.view(1, -1), [_Req(params, [1], [2, 2])], eos={0}) == [0]
    for bad in ({"repetition_penalty": float("nan")}, {"min_p": 2.0}, {"presence_penalty": 3.0}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---------------------------------------------------------------------- 12. README


def test_readme_says_how_to_run_serve_and_tests() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert 'SERVE_ARGS="--port' in readme and "make test-fast" in readme and "minutes" in readme
    assert "what `make serve` runs for now" not in readme
    # SERVE_ARGS adds to the command line instead of replacing the default policy.
    assert "--kv-policy $(SERVE_POLICY) $(SERVE_ARGS)" in makefile


def test_openai_fields_that_do_not_change_the_answer_are_ignored_and_logged(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    harmless = {"metadata": {"run": "a"}, "store": True, "service_tier": "auto", "user": "u1"}
    plain = complete(http, temperature=0, max_tokens=4)
    with caplog.at_level("INFO", logger="vllm_kvpress_ext.server.serving"):
        tagged = complete(http, temperature=0, max_tokens=4, **harmless)
    assert tagged.status_code == 200, tagged.text
    assert tagged.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert any("metadata, store, service_tier, user" in r.getMessage() for r in caplog.records)
    messages = [{"role": "user", "content": PROMPT}]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "parallel_tool_calls": False, "modalities": ["text"], **harmless},
    )
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("reasoning_effort", "high"),
        ("verbosity", "low"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
    ],
)
def test_openai_fields_that_would_change_the_answer_are_refused_by_name(
    http: httpx.Client, field: str, value: Any
) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, field: value}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, field)
    assert error["code"] == 400 and "not supported" in error["message"]
