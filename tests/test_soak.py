"""A bounded soak: mixed policies, client aborts and bad requests interleaved with good ones, 8 at a time.

Every good request answers exactly what it answers alone (greedy), every bad one gets its 4xx, and
afterwards the page pool is empty and the process's RSS is back near its baseline.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import PROMPT, LiveServer, _start, _write_model, pool_empty, wait_for

ROUNDS = 120  # requests in the soak; about 15 s on 2 cores
POLICIES: list[Any] = [
    None,
    "full",
    {"name": "snapkv", "ratio": 0.3, "window": 4},
    {"name": "streaming_llm", "ratio": 0.5},
    {"name": "h2o", "ratio": 0.4},
    {"name": "pyramidkv", "ratio": 0.5, "window": 4},
    {"name": "adakv", "ratio": 0.5, "window": 4},
    {"name": "gvote", "num_samples": 4, "future_positions": 8},
    {"name": "kvec", "ratio": 0.5, "window": 4, "extended_window": 8},
    {"name": "lava", "ratio": 0.5, "window": 4},
    {"name": "xkv", "ratio": 0.5, "window": 4},
]
PROMPTS = [PROMPT, " ".join([PROMPT] * 4), f"the sky looks blue . {PROMPT}"]
BAD: list[tuple[dict[str, Any], int]] = [
    ({"prompt": ""}, 400),
    ({"prompt": "a", "kv_policy": {"name": "gvote", "num_samples": 10**6}}, 400),
    ({"prompt": "a", "kv_policy": {"name": "xkv", "profile": "/etc/passwd"}}, 400),
    ({"prompt": "a", "kv_policy": {"name": "wgkv"}}, 400),  # this model has no write gates
    ({"prompt": "a", "temperature": -1}, 400),
    ({"prompt": "a", "use_beam_search": True}, 400),
    ({"prompt": "a", "model": "other"}, 404),
    ({"prompt": "the " * 2000}, 400),
]


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _start(_write_model(tmp_path_factory.mktemp("soak-model")), max_num_seqs=16) as server:
        yield server


def _good_body(prompt: str, policy: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    if policy is not None:
        body["kv_policy"] = policy
    return body


def _streamed_text(client: httpx.Client, body: dict[str, Any], abort_after: int | None = None) -> str | None:
    text = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for n, line in enumerate(x for x in r.iter_lines() if x.startswith("data: ")):
            if abort_after is not None and n >= abort_after:
                return None  # closing the stream aborts the request
            data = line[len("data: ") :]
            if data != "[DONE]":
                event = json.loads(data)
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text


@pytest.mark.slow
def test_soak_mixed_policies_aborts_and_bad_requests(live: LiveServer) -> None:
    cases = list(itertools.product(PROMPTS, range(len(POLICIES))))
    with httpx.Client(base_url=live.url, timeout=120) as client:
        reference = {}
        for prompt, p in cases:  # each good request alone, once (also warms every code path up)
            r = client.post("/v1/completions", json=_good_body(prompt, POLICIES[p]))
            assert r.status_code == 200, r.text
            reference[(prompt, p)] = r.json()["choices"][0]["text"]
        wait_for(lambda: pool_empty(client))
        baseline = _rss_bytes()

    rng = random.Random(0)
    jobs = [(rng.choice(("good", "stream", "abort", "bad")), rng.choice(cases), rng.choice(BAD)) for _ in range(ROUNDS)]

    def run(job: tuple[str, tuple[str, int], tuple[dict[str, Any], int]]) -> None:
        kind, (prompt, p), (bad, status) = job
        body = _good_body(prompt, POLICIES[p])
        with httpx.Client(base_url=live.url, timeout=120) as client:
            if kind == "good":
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference[(prompt, p)], (prompt, POLICIES[p])
            elif kind == "stream":
                assert _streamed_text(client, body) == reference[(prompt, p)], (prompt, POLICIES[p])
            elif kind == "abort":
                _streamed_text(client, {**body, "max_tokens": 200}, abort_after=2)
            else:
                r = client.post("/v1/completions", json=bad)
                assert r.status_code == status, (bad, r.text)

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(run, job) for job in jobs]:
            future.result()

    with httpx.Client(base_url=live.url, timeout=30) as client:
        wait_for(lambda: pool_empty(client), timeout=30)
        assert client.get("/health").status_code == 200
        assert client.get("/debug/kv").json()["failed_steps"] == 0
    growth = _rss_bytes() - baseline
    assert growth < 150 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB over the soak"
