"""schemathesis against the live server's `/openapi.json`, with a bounded number of examples per operation.

Positive and negative (schema-violating) bodies for every operation: no 5xx, every status and content
type documented, every JSON body shaped as documented, schema violations rejected. A short
`max_model_len` keeps any `max_tokens` a generator picks cheap on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import LiveServer, _start, _write_model, metric

EXAMPLES = 30  # per operation and mode: tens of seconds in all on 2 cores
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir: Path = _write_model(tmp_path_factory.mktemp("schemathesis-model"))
    with _start(model_dir, max_model_len=48, num_pages=1024, max_queue=64) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_api_conforms_to_its_schema(live: LiveServer, mode: schemathesis.GenerationMode) -> None:
    api = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
    failures: list[str] = []
    for operation in operations:
        if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.lower() != "post":
            continue  # the GET endpoints take no input to violate

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            run()
        except Exception as exc:  # collect every operation's failure, not just the first
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)
    with httpx.Client(base_url=live.url) as client:  # the cases really reached the server
        assert metric(client, "kvpress_requests_total", 'status="rejected"') > 0
