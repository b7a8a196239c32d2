"""Fuzzing the policy schema: every registered policy's fields with huge, tiny, NaN, negative and wrong-typed values.

Each spec either validates or is refused with a 400 by the server's entry point (`resolve_policy`, which
the vLLM plugin shares); a spec that validates then runs a request on the bundled model, and the engine
never raises during a step nor fails the request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvpress_ext.api.errors import APIError
from vllm_kvpress_ext.api.policy_spec import resolve_policy
from vllm_kvpress_ext.assets import DEFAULT_MODEL_DIR
from vllm_kvpress_ext.engine import LLMEngine, RequestRejectedError, SamplingParams
from vllm_kvpress_ext.policies import FIELD_LIMITS, PolicyConfigError, policy_class, policy_names

PROMPT = "key trout 65 . key clam 62 . key lion 17 . key bear 43 . key wolf 88 . what is key wolf ? answer :"

ODD_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 3, 7, 16, 2**31, 2**63, 2**64, 1e-300, 5e-324, 1e308, 0.5, 1.0]),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)
# Mostly-plausible values, so that many specs validate and reach the engine.
PLAUSIBLE = st.one_of(st.integers(min_value=0, max_value=80), st.floats(min_value=0.0, max_value=1.0))


def _fields(name: str) -> list[str]:
    cls = policy_class(name)
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(DEFAULT_MODEL_DIR, dtype="float32", num_pages=1024, page_size=16)


def spec_strategy(name: str) -> st.SearchStrategy[dict[str, Any]]:
    fields = _fields(name)
    values = st.one_of(ODD_VALUES, PLAUSIBLE, PLAUSIBLE)
    params = st.dictionaries(st.sampled_from(fields), values, max_size=len(fields)) if fields else st.just({})
    extra = st.dictionaries(st.text(max_size=6), ODD_VALUES, max_size=1)
    return st.tuples(params, st.one_of(st.just({}), st.just({}), extra)).map(lambda p: {"name": name, **p[0], **p[1]})


def test_every_numeric_field_has_a_bound() -> None:
    """New fields must be given a bound (FIELD_LIMITS or the policy's own `limits`), or this fails."""
    for name in policy_names():
        cls = policy_class(name)
        hints = {f.name: f.type for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        numeric = {n for n, t in hints.items() if "int" in str(t) or "float" in str(t)}
        assert numeric <= set(cls.field_limits()), (name, numeric - set(cls.field_limits()))
    assert all(low <= high for low, high in FIELD_LIMITS.values())


@pytest.mark.parametrize("name", policy_names())
def test_policy_specs_validate_or_400_and_never_break_a_step(engine: LLMEngine, name: str) -> None:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(spec=spec_strategy(name))
    def check(spec: dict[str, Any]) -> None:
        try:
            policy = resolve_policy(spec)
        except APIError as exc:
            assert exc.status == 400 and exc.param == "kv_policy" and exc.message
            return
        try:
            request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0), policy=policy)
        except (RequestRejectedError, PolicyConfigError):
            return  # refused before any step (a 400 in the server), e.g. a ring larger than the pool
        finished = None
        for _ in range(200):  # bounded: a 23-token prompt and 3 tokens take a handful of steps
            for out in engine.step():  # must not raise
                if out.request_id == request_id and out.finished:
                    finished = out
            if not engine.has_unfinished_requests():
                break
        assert finished is not None and finished.finish_reason in ("stop", "length"), (spec, finished)
        assert engine.cache.pool.num_used == 0

    check()
