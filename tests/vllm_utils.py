"""Helpers shared by the vLLM plugin tests: retrieval prompts on the bundled model and embedded-engine references."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.tasks.synthetic import build_prompt, generate
from vllm_kvpress_ext.tasks.synthetic.base import Sample
from vllm_kvpress_ext.tasks.synthetic.prompt import PromptSpec

MODEL_DIR = default_model_dir()
PAGE_SIZE = 16


def retrieval_samples(count: int, context_length: int = 128, seed: int = 7000) -> list[Sample]:
    """Needle-in-a-haystack samples the bundled model answers (docs/model.md)."""
    return [generate("niah_multikey", seed + i, context_length=context_length) for i in range(count)]


def retrieval_prompts(count: int, context_length: int = 128, seed: int = 7000) -> list[PromptSpec]:
    """The samples' chat-formatted token ids, answers and stop tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    return [build_prompt(sample, tokenizer) for sample in retrieval_samples(count, context_length, seed)]


def embedded_greedy(
    prompts: list[list[int]], policies: list[Any], max_tokens: int, num_pages: int, max_num_seqs: int = 16
) -> list[Any]:
    """Finished outputs of the embedded engine for each (prompt, policy), all submitted at once."""
    engine = LLMEngine(
        MODEL_DIR, dtype=torch.float32, num_pages=num_pages, page_size=PAGE_SIZE, max_num_seqs=max_num_seqs
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, policy=policy) for p, policy in zip(prompts, policies, strict=True)]
    done: dict[str, Any] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.cache.pool.num_used == 0
    return [done[i] for i in ids]


def vllm_runner_llm(model: Path, num_pages: int = 2048, additional: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """An offline `vllm.LLM` on vLLM's runner over a pool of `num_pages` pages of PAGE_SIZE tokens (fp32, 512 tokens
    per request, 4 at once unless `max_num_seqs` says otherwise, token ids in and out); `kwargs` are further `LLM`
    arguments."""
    from vllm import LLM

    kwargs.setdefault("max_num_seqs", 4)
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=512,
        block_size=PAGE_SIZE,
        skip_tokenizer_init=True,
        additional_config={"kv_runner": "vllm", "kv_num_pages": num_pages, **(additional or {})},
        **kwargs,
    )


def in_process_worker(llm: Any) -> Any:
    """The worker of a `vllm.LLM` whose engine core runs in this process (`in_process_engine`)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def assert_no_page_leaked(pool: Any) -> None:
    """Every page of a native pool is free, or has exactly as many holders as seated requests' rows (their local
    rings, and their blocks' spill pages), kept prefix blocks and stored contexts list it."""
    cache = pool.cache
    listed = [cache.block_tables[:, seat.row].reshape(-1) for seat in pool.seats.values()]
    listed += [pages.reshape(-1) for seat in pool.seats.values() for pages in seat.spill.values()]
    listed += [cache.rings.tables[:, seat.row].reshape(-1) for seat in pool.seats.values()]  # WG-KV's local rings
    if pool.prefix_blocks is not None:
        listed += [pages.reshape(-1) for pages in pool.prefix_blocks.kept.values()]
    if pool.contexts is not None:  # stored named contexts' rows
        rows = [cache.row_of(entry.row_id) for entry in pool.contexts.entries.values()]
        listed += [cache.block_tables[:, row].reshape(-1) for row in rows]
    pages = torch.cat(listed).to(torch.int64) if listed else torch.empty(0, dtype=torch.int64)
    counts = torch.bincount(pages[pages >= 0], minlength=cache.pool.num_pages)
    assert torch.equal(counts.to(torch.int32), cache.pool.refcounts())


STARTUP_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def in_process_engine() -> Iterator[None]:
    """`vllm.LLM`'s engine core in the test's process (no engine-core subprocess) for a module's tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@contextmanager
def vllm_server(args: list[str], log_path: Path, env_extra: dict[str, str] | None = None) -> Iterator[str]:
    """`vllm serve ARGS` on a free loopback port until healthy; yields its URL, stops it (SIGINT) after."""
    with http_server([str(Path(sys.executable).with_name("vllm")), "serve", *args], log_path, env_extra) as url:
        yield url


@contextmanager
def http_server(command: list[str], log_path: Path, env_extra: dict[str, str] | None = None) -> Iterator[str]:
    """`COMMAND --host 127.0.0.1 --port P` (`vllm serve`, `kvpress serve`) until healthy; yields its URL, stops it
    (SIGINT) after."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "KVPRESS_VLLM", "VLLM_PLUGINS")}
    env.update(env_extra or {})
    command = [*command, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"{command[:2]} exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{command[:2]} not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT to the process group (a server's graceful shutdown), SIGKILL if it lingers past 30 s."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
