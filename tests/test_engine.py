"""The engine's greedy output equals transformers' token for token, however requests are batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import hf_greedy, hf_logits, tiny_hf_model
from tolerances import logprob_atol
from transformers import PreTrainedModel

from vllm_kvpress_ext.engine import LLM, LLMEngine, RequestRejectedError, SamplingParams

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama3", "qwen3", "gemma3"])
def model_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    model = tiny_hf_model(request.param, seed=7)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def prompts(count: int, seed: int = 0, low: int = 5, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def run_staggered(engine: LLMEngine, batch: list[list[int]], every: int = 3) -> dict[str, list[int]]:
    """Add one request every `every` steps while earlier ones decode (continuous batching)."""
    pending = list(enumerate(batch))
    outputs: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(prompt, GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        step += 1
    return outputs


def test_single_request_matches_transformers(model_pair: tuple[PreTrainedModel, Path]) -> None:
    model, path = model_pair
    prompt = prompts(1, seed=1)[0]
    llm = LLM(path, dtype=torch.float32, num_pages=512, page_size=4)
    assert llm.generate([prompt], GREEDY)[0].output_token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert llm.engine.cache.pool.num_used == 0


@pytest.mark.parametrize("chunk", [2048, 7])
def test_staggered_batch_matches_transformers(model_pair: tuple[PreTrainedModel, Path], chunk: int) -> None:
    model, path = model_pair
    batch = prompts(5, seed=2)
    engine = LLMEngine(path, dtype=torch.float32, num_pages=1024, page_size=4, max_num_batched_tokens=chunk)
    outputs = run_staggered(engine, batch)
    for i, prompt in enumerate(batch):
        assert outputs[str(i)] == hf_greedy(model, prompt, NEW_TOKENS), f"request {i} (chunk {chunk})"
    assert engine.cache.pool.num_used == 0


def tight_pages(model: PreTrainedModel) -> int:
    """A pool where 4 of `prompts(4, seed=3, low=20, high=40)` cannot run at once.

    Each request needs 2 layers x 2 heads x ceil(~100 / 4) ~ 100 pages by the end: 4 cannot coexist in 220.
    Gemma 3's sliding layer holds its window (one page per head): ~52 pages a request, 4 cannot fit in 120.
    """
    return 120 if model.config.model_type == "gemma3_text" else 220


def test_preemption_by_recompute_keeps_greedy_output(model_pair: tuple[PreTrainedModel, Path]) -> None:
    model, path = model_pair
    batch = prompts(4, seed=3, low=20, high=40)
    engine = LLMEngine(path, dtype=torch.float32, num_pages=tight_pages(model), page_size=4, max_num_batched_tokens=16)
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, GREEDY, request_id=str(i))
    outputs, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
                preemptions += out.num_preemptions
    assert preemptions > 0, "the pool should have been too small to run all requests at once"
    for i, prompt in enumerate(batch):
        assert outputs[str(i)] == hf_greedy(model, prompt, NEW_TOKENS)
    assert engine.cache.pool.num_used == 0


def test_abort_frees_every_page(model_pair: tuple[PreTrainedModel, Path]) -> None:
    _, path = model_pair
    engine = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=4, max_num_batched_tokens=8)
    a = engine.add_request(prompts(1, seed=4)[0], GREEDY)
    b = engine.add_request(prompts(1, seed=5)[0], GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.cache.pool.num_used > 0
    engine.abort(a)
    engine.abort(b)
    assert engine.cache.pool.num_used == 0
    assert not engine.has_unfinished_requests()
    waiting = engine.add_request([1, 2, 3], GREEDY)
    engine.abort(waiting)  # aborting a request that never ran is fine too
    assert not engine.has_unfinished_requests()


def test_requests_that_cannot_run_are_rejected(model_pair: tuple[PreTrainedModel, Path]) -> None:
    _, path = model_pair
    engine = LLMEngine(path, dtype=torch.float32, num_pages=16, page_size=4)
    with pytest.raises(RequestRejectedError, match="whole pool has 16"):
        engine.add_request(list(range(100)), GREEDY)
    with pytest.raises(RequestRejectedError, match="limit is 256"):
        engine.add_request([1] * 300, GREEDY)
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestRejectedError, match=r"\[0, 128\)"):
        engine.add_request([1, 500], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello", GREEDY)


def test_stops_and_seeded_sampling(model_pair: tuple[PreTrainedModel, Path]) -> None:
    model, path = model_pair
    prompt = prompts(1, seed=6)[0]
    reference = hf_greedy(model, prompt, 16)
    llm = LLM(path, dtype=torch.float32, num_pages=512, page_size=4)
    stop_at = reference[5]
    first = reference.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert out.output_token_ids == reference[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == reference[:3] and out.finish_reason == "length"
    original_eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {reference[2]}
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.output_token_ids[-1] == reference[2] and len(out.output_token_ids) <= 3
    llm.engine.eos_token_ids = original_eos
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=123, ignore_eos=True)
    a = llm.generate([prompt, prompts(1, seed=9)[0]], [sampled, GREEDY])[0].output_token_ids
    b = llm.generate([prompt], sampled)[0].output_token_ids
    assert a == b, "a seeded request must not depend on what shares its batch"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_a_request_that_outgrows_the_whole_pool_finishes_with_length(
    model_pair: tuple[PreTrainedModel, Path],
) -> None:
    model, path = model_pair
    engine = LLMEngine(path, dtype=torch.float32, num_pages=16, page_size=4)
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 1 and finished[0].finish_reason == "length"
    # 16 pages of 4 tokens over 2 layers x 2 heads hold 16 tokens per head: the prompt's 10 and the first
    # 6 generated; the 7th is sampled from them, and the 8th would need a 17th slot. Gemma 3's sliding layer
    # holds one page per head (its window of 4): the 14 other pages hold 28 tokens per head, so 19 come out.
    gemma = model.config.model_type == "gemma3_text"
    assert len(finished[0].output_token_ids) == (19 if gemma else 7)
    assert engine.cache.pool.num_used == 0
    early = outputs[0].kv
    assert early is not finished[0].kv, "outputs carry snapshots, not the live statistics"


@pytest.mark.parametrize("chunk", [2048, 7])
def test_logprobs_equal_transformers_log_softmax(model_pair: tuple[PreTrainedModel, Path], chunk: int) -> None:
    """Prompt log-probabilities (the prefill, chunked or not) and generated-token ones (decode steps)
    are the log-softmax of transformers' logits for the same sequence; ranks and top-k agree."""
    model, path = model_pair
    prompt = prompts(1, seed=11)[0]
    engine = LLMEngine(path, dtype=torch.float32, num_pages=512, page_size=4, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = None
    engine.add_request(prompt, params, request_id="r")
    while engine.has_unfinished_requests():
        for step_out in engine.step():
            if step_out.finished:
                out = step_out
    assert out is not None and out.logprobs is not None and out.prompt_logprobs is not None
    sequence = prompt + out.output_token_ids
    reference = torch.log_softmax(hf_logits(model, torch.tensor(sequence)), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert len(out.logprobs) == len(out.output_token_ids)
    scored = list(out.prompt_logprobs[1:]) + list(out.logprobs)
    for position, entry in enumerate(scored):  # entry predicts sequence[position + 1] from position
        row = reference[position]
        assert entry.token_id == sequence[position + 1]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.rank == int((row > row[entry.token_id] + 1e-5).sum()) + 1
    assert all(e.rank == 1 for e in out.logprobs)  # greedy picks the most likely token
    assert all(len(e.top) == 3 for e in out.logprobs) and all(len(e.top) == 2 for e in out.prompt_logprobs[1:])
    top = out.logprobs[0].top
    assert [t for t, _ in top] == torch.topk(reference[len(prompt) - 1], 3).indices.tolist()
    assert engine.cache.pool.num_used == 0


def test_logprobs_survive_preemption_and_are_off_by_default(model_pair: tuple[PreTrainedModel, Path]) -> None:
    model, path = model_pair
    batch = prompts(4, seed=3, low=20, high=40)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    roomy_llm = LLM(path, dtype=torch.float32, num_pages=1024, page_size=4)
    roomy, roomy_config = roomy_llm.generate(batch, params), roomy_llm.engine.config
    tight = LLM(path, dtype=torch.float32, num_pages=tight_pages(model), page_size=4, max_num_batched_tokens=16)
    outs = tight.generate(batch, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for want, got in zip(roomy, outs, strict=True):
        assert got.output_token_ids == want.output_token_ids
        for got_entry, want_entry in zip(got.logprobs, want.logprobs, strict=True):
            tolerance = logprob_atol(torch.float32, roomy_config, want_entry.logprob)
            assert got_entry.logprob == pytest.approx(want_entry.logprob, abs=tolerance)
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)  # a recompute appends nothing twice
        assert all(e.top == () for e in got.logprobs)
    plain = LLM(path, dtype=torch.float32, num_pages=512, page_size=4).generate(batch[:1], GREEDY)[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None
