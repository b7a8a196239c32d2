"""GVote's observed-query votes, Expected Attention and KVzip through every per-request route: the embedded server's
`kv_policy` and `vllm_xargs`, and the vLLM plugin's request validation; out-of-range fields are a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import LONG_PROMPT, MODEL, LiveServer, _start, _write_model
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_kvpress_ext.policies import ExpectedAttentionPolicy, GVotePolicy, KVzipPolicy
from vllm_kvpress_ext.vllm_plugin.platform import validate_kvpress_request
from vllm_kvpress_ext.vllm_plugin.request_policy import request_policy

POLICIES: list[dict[str, Any]] = [
    {"name": "gvote", "observation_window": 8, "p_nuc": 0.5},
    {"name": "expected_attention", "ratio": 0.25},
    {"name": "expected_attention", "tokens": 16, "use_covariance": False},
    {"name": "kvzip", "ratio": 0.25, "chunk_size": 24},
    {"name": "kvzip", "tokens": 16, "allocation": "head"},
]
BAD: list[dict[str, Any]] = [
    {"name": "gvote", "observation_window": 1000},
    {"name": "gvote", "observation_window": -1},
    {"name": "expected_attention", "future_positions": 100000},
    {"name": "expected_attention", "epsilon": -1.0},
    {"name": "expected_attention", "use_vnorm": "no"},
    {"name": "kvzip", "chunk_size": 100000},
    {"name": "kvzip", "overlap_tokens": -1},
    {"name": "kvzip", "allocation": "pair"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _start(_write_model(tmp_path_factory.mktemp("routes-model"))) as live:
        yield live


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _usage(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json()["usage"])


@pytest.mark.parametrize("policy", POLICIES, ids=json.dumps)
def test_each_route_runs_the_policy(http: httpx.Client, policy: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0}
    direct = _usage(http.post("/v1/completions", json={**body, "kv_policy": policy}))
    xargs = _usage(http.post("/v1/completions", json={**body, "vllm_xargs": {"kv_policy": json.dumps(policy)}}))
    assert direct["kv_policy"] == xargs["kv_policy"] == policy["name"]
    # The same plan either way (entries: bytes count pages shared with the prefix store's entries 1/k).
    assert direct["kv_tokens_kept"] == xargs["kv_tokens_kept"]
    if policy["name"] in ("expected_attention", "kvzip"):
        assert direct["kv_retention"] < 1.0


@pytest.mark.parametrize("policy", BAD, ids=json.dumps)
def test_out_of_range_fields_are_a_400_and_the_next_request_runs(http: httpx.Client, policy: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 1}
    bad = http.post("/v1/completions", json={**body, "kv_policy": policy})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_policy"
    assert http.post("/v1/completions", json=body).status_code == 200


def test_the_vllm_plugin_takes_and_refuses_them() -> None:
    for policy in POLICIES:
        loaded = request_policy({"kv_policy": json.dumps(policy)}, None)
        assert isinstance(loaded, GVotePolicy | ExpectedAttentionPolicy | KVzipPolicy) and loaded.name == policy["name"]
        validate_kvpress_request(VllmSamplingParams(max_tokens=4, extra_args={"kv_policy": json.dumps(policy)}))
    named = request_policy({"kv_policy": "expected_attention", "kv_ratio": 0.5}, None)
    assert isinstance(named, ExpectedAttentionPolicy) and named.ratio == 0.5
    named = request_policy({"kv_policy": "kvzip", "kv_ratio": 0.5}, None)
    assert isinstance(named, KVzipPolicy) and named.ratio == 0.5
    for policy in BAD:
        with pytest.raises(VLLMValidationError):
            validate_kvpress_request(VllmSamplingParams(max_tokens=4, extra_args={"kv_policy": json.dumps(policy)}))
