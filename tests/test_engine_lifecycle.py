"""The engine's read API and the runner's lifecycle methods: what the server and the vLLM worker use instead
of reaching into the pool, the scheduler's queues or a request's fields."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.engine.model_runner import ModelRunner, Schedule, ScheduledChunk
from vllm_kvpress_ext.engine.origins import ForkOf, MatchedPrefix
from vllm_kvpress_ext.engine.request import RequestStatus
from vllm_kvpress_ext.engine.stats import PrefixStoreStats

MODEL = default_model_dir()
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 200, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(MODEL, num_pages=400, max_num_seqs=1)


def prefilled(runner: ModelRunner, request_id: str, length: int = 40) -> Any:
    request = runner.new_request(request_id, prompt(length), GREEDY, None, max_model_len=2048)
    runner.start(request)
    out = runner.execute(Schedule(prefill=[ScheduledChunk(request, 0, length)]))
    assert out.sample == [request] and out.logits is not None
    request.output_token_ids.append(int(out.logits.argmax(-1)[0]))
    return request


def test_stats_follow_the_pool_the_queues_and_the_last_step() -> None:
    engine = LLMEngine(MODEL, num_pages=600, max_num_seqs=1)
    first, second = prompt(40, 1), prompt(33, 2)
    engine.add_request(first, GREEDY, request_id="a")
    engine.add_request(second, GREEDY, request_id="b")
    stats = engine.stats()
    assert (stats.pages_total, stats.pages_used, stats.pages_free) == (600, 0, 600)
    assert (stats.running, stats.waiting, stats.last_step, stats.prefixes) == (0, 2, "idle", None)
    assert stats.page_size == 16 and stats.page_bytes == engine.runner.page_bytes > 0
    assert engine.num_waiting == 2
    engine.step()
    stats = engine.stats()
    request = engine.requests["a"]
    assert (stats.running, stats.waiting, stats.last_step) == (1, 1, "prefill")
    assert stats.pages_used == stats.pages_total - stats.pages_free == engine.runner.pages_held(request) > 0
    engine.step()
    assert engine.stats().last_step == "decode"
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.pages_used, stats.pages_free) == (0, 0, 0, 600)


def test_stats_report_the_prefix_store_when_caching_is_on() -> None:
    engine = LLMEngine(MODEL, num_pages=600, enable_prefix_caching=True, max_cached_prefixes=2)
    assert engine.stats().prefixes == PrefixStoreStats(hits=0, tokens_reused=0, pages=0, entries=0)
    context, question = prompt(48, 3), prompt(5, 4)
    for request_id in ("a", "b"):
        engine.add_request(context + question, GREEDY, request_id=request_id, policy="snapkv", compress_after=48)
        while engine.has_unfinished_requests():
            engine.step()
    prefixes = engine.stats().prefixes
    assert prefixes is not None
    # The compressed context, and the exact context its first request kept just before compressing it.
    assert (prefixes.hits, prefixes.tokens_reused, prefixes.entries) == (1, 48, 2)
    assert prefixes.pages == engine.stats().pages_used > 0  # only the stored prefixes hold pages now


def test_requests_in_last_step_name_the_batch_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(MODEL, num_pages=600)
    for request_id, seed in (("a", 5), ("b", 6)):
        engine.add_request(prompt(40, seed), GREEDY, request_id=request_id)
    engine.step()  # both prefilled: the next step decodes both

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("forward failed")

    monkeypatch.setattr(engine.runner.model, "forward", broken)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    assert sorted(engine.requests_in_last_step()) == ["a", "b"]
    engine.add_request(prompt(20, 7), GREEDY, request_id="queued")
    monkeypatch.setattr(engine.scheduler, "schedule", broken)  # fails before any plan exists
    with pytest.raises(RuntimeError):
        engine.step()
    # Everything that holds pages, nothing cleanly queued.
    assert sorted(set(engine.requests_in_last_step())) == ["a", "b"]


def test_preempt_frees_every_page_and_resume_restarts_from_token_zero(runner: ModelRunner) -> None:
    request = prefilled(runner, "p")
    assert runner.pages_held(request) > 0 and runner.free_pages < runner.total_pages
    output = list(request.output_token_ids)
    runner.preempt(request)
    assert (request.status, request.seat.num_processed, request.num_preemptions, request.seat.row) == (
        RequestStatus.WAITING,
        0,
        1,
        None,
    )
    assert request.output_token_ids == output  # kept for the recomputation
    assert runner.pages_held(request) == 0 and runner.free_pages == runner.total_pages
    request.output_token_ids = [*output, 7]  # what a driver kept for the recomputation
    runner.start(request)
    assert request.status is RequestStatus.PREFILLING and request.seat.row is not None
    assert request.output_token_ids == [*output, 7] and request.num_tokens == 40 + len(output) + 1
    runner.release(request)
    assert runner.free_pages == runner.total_pages


def test_a_fork_without_a_free_row_changes_nothing(runner: ModelRunner) -> None:
    parent = prefilled(runner, "parent")
    child = runner.new_request("child", parent.prompt_token_ids, GREEDY, None, max_model_len=2048)
    free = runner.free_pages
    assert not runner.start(child, ForkOf(parent))  # one row only, the parent's
    assert child.seat.row is None and child.status is RequestStatus.WAITING and runner.free_pages == free
    runner.release(parent)
    assert runner.free_pages == runner.total_pages


def test_decode_pages_are_refused_for_a_request_without_a_row(runner: ModelRunner) -> None:
    request = runner.new_request("rowless", prompt(10), GREEDY, None, max_model_len=2048)
    with pytest.raises(ValueError, match="cache row"):
        runner.pages_to_decode([request])


def test_a_prefilled_request_cannot_take_a_running_request_id() -> None:
    engine = LLMEngine(MODEL, num_pages=600)
    engine.add_request(prompt(20), GREEDY, request_id="same")
    other = engine.runner.new_request("same", prompt(20, 9), GREEDY, None, max_model_len=2048)
    with pytest.raises(ValueError, match="already in use"):
        engine.adopt_prefilled(other)
    assert engine.stats().running == 0 and engine.stats().pages_used == 0


def test_a_start_from_a_stored_prefix_that_is_not_there_changes_nothing(runner: ModelRunner) -> None:
    request = runner.new_request("unmatched", prompt(40), GREEDY, None, max_model_len=2048)
    free = runner.free_pages
    assert not runner.start(request, MatchedPrefix())
    assert request.seat.row is None and request.status is RequestStatus.WAITING and runner.free_pages == free
    assert runner.start(request)  # from token 0
    assert (
        request.status is RequestStatus.PREFILLING and request.seat.row is not None and request.seat.num_processed == 0
    )
    runner.release(request)
    assert runner.free_pages == runner.total_pages
