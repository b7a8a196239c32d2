"""`kvpress bench serve`: HTTP load against `kvpress serve`, per policy, at a fixed KV memory.

Why over HTTP: the number that matters to an operator is what a client sees -- time to first token
and inter-token latency through the whole stack (queueing, the engine loop, SSE) -- and how many
requests the pool can hold at once when a policy frees pages. So this bench streams completions
from a real server and measures on the client side, and reads the server's own metric for the
peak number of requests holding KV pages.

Two modes:

- default: for each policy, start `kvpress serve --kv-policy POLICY --kv-memory SIZE` in a
  subprocess on 127.0.0.1 (same pool size for every policy, fresh server, so the peak gauge
  `kvpress_requests_running_peak` belongs to that policy alone), warm it up, load it, stop it;
- `--url`: one running server; each request names the policy in its body (`kv_policy`). The peak
  is the server's peak gauge if the phase raised it, else the highest `kvpress_requests_running`
  polled during the phase (a sample, so it can miss a brief spike).

Load: up to `concurrency` streaming requests in flight, `num_requests` in all, and no new request
after `duration` seconds (in-flight ones are then cancelled and counted as not completed).
Prompts are random filler words of the suite vocabulary (one token each with the suite
tokenizer), outputs run to `max_tokens` (`ignore_eos`), greedy.

Shared-context workload (`shared_contexts` > 0): `shared_contexts` contexts of `prompt_len` tokens,
each asked `questions_per_context` questions of `question_len` tokens (`num_requests` is then their
product), every request naming its context with `kv_prefix_tokens`. Requests go out question-major
(every context's first question, then every context's second, ...). Each policy runs twice, on a
fresh server with prefix caching off and on, side by side, so the two rows differ in reuse alone.

Multi-turn workload (`sessions` > 0): `sessions` conversations of `turns` turns each. A conversation
opens with a context of `prompt_len` tokens; turn t sends the context, every earlier question and
the answer text the server returned for it, and a new question of `question_len` tokens, naming the
context with `kv_prefix_tokens` (so every turn compresses the same context and the rest stays as
written, and all three runs produce the same answers). Turns of one conversation run one after the
other; conversations run side by side up to `concurrency`. Each policy runs on three fresh servers:
prefix caching off, on with named matching (the context is reused), and on with
`--prefix-matching auto` (each turn attaches to what the previous turn left).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_kvpress_ext.bench.harness import HOST, free_port, scrape_metric, served
from vllm_kvpress_ext.bench.models import suite_bench_model_dir
from vllm_kvpress_ext.bench.report import format_table
from vllm_kvpress_ext.tasks.tokenizer import FILLER_WORDS


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str | None = None
    model: str | None = None
    policies: tuple[str, ...] = ("full", "snapkv", "streaming_llm")
    kv_memory: str = "16MiB"
    num_requests: int = 64
    concurrency: int = 32
    duration: float = 60.0
    prompt_len: int = 512
    max_tokens: int = 32
    max_num_seqs: int = 64
    page_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    out: str | None = None
    startup_timeout: float = 180.0
    # Also run the same load against `vllm serve` with the plugin, then `kvpress serve`, both through vLLM's
    # own load generator (`vllm bench serve`), and print them side by side with the ratio.
    compare_vllm: bool = False
    num_pages: int = 52000  # the comparison's KV pool, in pages, for both servers
    shared_contexts: int = 0
    questions_per_context: int = 8
    question_len: int = 16
    sessions: int = 0
    turns: int = 4

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("give at least one policy")
        for name in ("num_requests", "concurrency", "prompt_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.duration <= 0:
            raise ValueError("duration must be positive")
        if self.shared_contexts < 0 or self.questions_per_context < 1 or self.question_len < 1:
            raise ValueError("shared_contexts must be >= 0, questions_per_context and question_len >= 1")
        if self.shared_contexts and self.url:
            raise ValueError("the shared-context workload starts its own servers (prefix caching off, then on)")
        if self.sessions < 0 or self.turns < 1:
            raise ValueError("sessions must be >= 0 and turns >= 1")
        if self.sessions and (self.url or self.shared_contexts):
            raise ValueError("the multi-turn workload starts its own servers and excludes --shared-contexts")

    @property
    def requests(self) -> int:
        if self.sessions:
            return self.sessions * self.turns
        return self.shared_contexts * self.questions_per_context if self.shared_contexts else self.num_requests

    @property
    def max_model_len(self) -> int:
        per_turn = self.question_len + self.max_tokens + 2
        return self.prompt_len + per_turn * (self.turns if self.sessions else 1) + 8


@dataclass
class _Result:
    completed: bool = False
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _prompts(config: ServeBenchConfig) -> list[tuple[str, int | None]]:
    """(prompt, kv_prefix_tokens) per request, plus one more for the warm-up at the end."""
    rng = random.Random(config.seed)
    # `prompt_len - 1` words: the tokenizer prepends <bos>.
    words = max(1, config.prompt_len - 1)

    def text(count: int) -> str:
        return " ".join(rng.choice(FILLER_WORDS) for _ in range(count))

    if not config.shared_contexts:
        return [(text(words), None) for _ in range(config.num_requests + 1)]
    contexts = [text(words) for _ in range(config.shared_contexts)]
    prompts = [
        (f"{context} {text(config.question_len)}", words + 1)
        for _ in range(config.questions_per_context)
        for context in contexts
    ]
    return [*prompts, (text(words), None)]


# ---------------------------------------------------------------------- load


async def _one(client: httpx.AsyncClient, body: dict[str, Any], result: _Result) -> None:
    start = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return
                if event.get("usage"):
                    result.usage = event["usage"]
                for choice in event.get("choices", []):
                    now = time.perf_counter()
                    if choice.get("text"):
                        result.text += choice["text"]
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                    if choice.get("finish_reason"):
                        result.completed = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def _poll_running(client: httpx.AsyncClient, seen: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            value = scrape_metric((await client.get("/metrics")).text, "kvpress_requests_running")
            if value is not None:
                seen.append(value)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.05)


def _request_body(config: ServeBenchConfig, model: str, policy: str, text: str, boundary: int | None) -> dict[str, Any]:
    """A streamed completion of `text` under `policy`; a shared context names its end (`kv_prefix_tokens`)."""
    extra = {} if boundary is None else {"kv_prefix_tokens": boundary}
    return {
        **extra,
        "model": model,
        "prompt": text,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_policy": policy,
    }


async def _session_phase(url: str, model: str, policy: str, config: ServeBenchConfig, label: str) -> dict[str, Any]:
    """The multi-turn workload: each conversation's turns in order, conversations side by side."""
    rng = random.Random(config.seed)

    def words(count: int) -> str:
        return " ".join(rng.choice(FILLER_WORDS) for _ in range(count))

    context_words = max(1, config.prompt_len - 1)  # the tokenizer prepends <bos>
    contexts = [words(context_words) for _ in range(config.sessions)]
    questions = [[words(config.question_len) for _ in range(config.turns)] for _ in contexts]
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4)
    results: list[_Result] = []
    finish_times: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(config.duration + 120.0), limits=limits) as client:
        warm = _Result()
        await _one(client, {**_request_body(config, model, policy, words(context_words), None), "max_tokens": 2}, warm)
        if warm.error:
            raise RuntimeError(f"policy {policy}: warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(config.concurrency)
        start = time.perf_counter()
        deadline = start + config.duration

        async def conversation(index: int) -> None:
            history = contexts[index]
            for question in questions[index]:
                if time.perf_counter() >= deadline:
                    return
                history = f"{history} {question}"
                result = _Result()
                results.append(result)
                async with gate:
                    await _one(client, _request_body(config, model, policy, history, context_words + 1), result)
                finish_times.append(time.perf_counter())
                if not result.completed:
                    return
                history = f"{history} {result.text.strip()}"

        tasks = [asyncio.create_task(conversation(i)) for i in range(config.sessions)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        metrics_text = (await client.get("/metrics")).text
    elapsed = (max(finish_times) if finish_times else time.perf_counter()) - start
    peak = int(scrape_metric(metrics_text, "kvpress_requests_running_peak") or 0)
    return _summary(label, results, elapsed, peak, "server peak gauge")


async def _phase(url: str, model: str, policy: str, config: ServeBenchConfig, label: str = "") -> dict[str, Any]:
    prompts = _prompts(config)
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4)
    timeout = httpx.Timeout(config.duration + 120.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        def body(prompt: tuple[str, int | None]) -> dict[str, Any]:
            return _request_body(config, model, policy, *prompt)

        warm = _Result()
        await _one(client, {**body(prompts[-1]), "max_tokens": 2}, warm)  # first forward passes are slow
        if warm.error:
            raise RuntimeError(f"policy {policy}: warm-up request failed: {warm.error}")
        peak_before = scrape_metric((await client.get("/metrics")).text, "kvpress_requests_running_peak") or 0.0
        samples: list[float] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_running(client, samples, stop))

        results: list[_Result] = []
        gate = asyncio.Semaphore(config.concurrency)
        start = time.perf_counter()
        deadline = start + config.duration
        finish_times: list[float] = []

        async def run(prompt: tuple[str, int | None]) -> None:
            result = _Result()
            results.append(result)
            try:
                await _one(client, body(prompt), result)
            finally:
                finish_times.append(time.perf_counter())
                gate.release()

        tasks: list[asyncio.Task[None]] = []
        for prompt in prompts[: config.requests]:
            await gate.acquire()
            if time.perf_counter() >= deadline:
                gate.release()
                break
            tasks.append(asyncio.create_task(run(prompt)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        stop.set()
        await poller
        metrics_text = (await client.get("/metrics")).text

    elapsed = (max(finish_times) if finish_times else time.perf_counter()) - start
    peak_after = scrape_metric(metrics_text, "kvpress_requests_running_peak") or 0.0
    if peak_after > peak_before:
        peak, peak_from = peak_after, "server peak gauge"
    else:
        # The poll can miss a short request; one that completed held pages at some moment of the phase.
        floor = 1.0 if any(r.completed for r in results) else 0.0
        peak, peak_from = max([*samples, floor]), "polled running gauge"
    return _summary(label or policy, results, elapsed, int(peak), peak_from)


def _summary(label: str, results: list[_Result], elapsed: float, peak: int, peak_from: str) -> dict[str, Any]:
    """One phase's figures: throughput, latency percentiles, the peak of requests running, the KV usage."""
    completed = [r for r in results if r.completed]
    ttfts = [r.ttft for r in completed if r.ttft is not None]
    itls = [x for r in completed for x in r.itls]
    usages = [r.usage for r in completed if r.usage]
    errors = [r.error for r in results if r.error]
    return {
        "policy": label,
        "sent": len(results),
        "completed": len(completed),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "elapsed_s": elapsed,
        "requests_per_s": len(completed) / elapsed if elapsed > 0 else 0.0,
        "ttft_s": {f"p{q}": _percentile(ttfts, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": _percentile(itls, q) for q in (50, 90, 99)},
        "peak_running": peak,
        "peak_from": peak_from,
        "mean_kv_bytes": sum(u.get("kv_bytes", 0) for u in usages) / len(usages) if usages else 0.0,
        "mean_kv_bytes_peak": sum(u.get("kv_bytes_peak", 0) for u in usages) / len(usages) if usages else 0.0,
        "mean_retention": sum(u.get("kv_retention", 1.0) for u in usages) / len(usages) if usages else float("nan"),
        "mean_prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usages) / len(usages) if usages else 0.0,
        "cached_prompt_tokens": sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages),
    }


# ---------------------------------------------------------------------- servers


@contextlib.contextmanager
def _server(
    model_dir: Path,
    policy: str,
    config: ServeBenchConfig,
    log_dir: Path,
    prefix_caching: bool = True,
    prefix_matching: str = "named",
) -> Iterator[str]:
    """`kvpress serve` in a subprocess on 127.0.0.1; yields its base URL once /health answers."""
    port = free_port()
    log_path = log_dir / f"serve-{policy}-{prefix_matching if prefix_caching else 'noreuse'}.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm_kvpress_ext.cli",
        "serve",
        str(model_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--kv-policy",
        policy,
        "--kv-memory",
        config.kv_memory,
        "--page-size",
        str(config.page_size),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-queue",
        str(max(1024, config.num_requests)),
        "--max-model-len",
        str(config.max_model_len),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--prefix-matching",
        prefix_matching,
        "--dtype",
        config.dtype,
        "--device",
        config.device,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with served(cmd, port, log_path, name="kvpress serve", startup_timeout=config.startup_timeout, env=env) as url:
        yield url


# ---------------------------------------------------------------------- report


def _ms(value: float) -> str:
    return "-" if value != value else f"{1000 * value:.1f}"  # NaN -> "-"


def _print(config: ServeBenchConfig, where: str, results: list[dict[str, Any]]) -> None:
    print(f"config: {asdict(config)}")
    print(f"server: {where}")
    headers = [
        "policy",
        "done/sent",
        "req/s",
        "TTFT p50 ms",
        "p90",
        "p99",
        "ITL p50 ms",
        "p90",
        "p99",
        "peak held",
        "KV MiB held",
        "KV MiB peak",
        "retention",
        "cached tok",
    ]
    rows = []
    for r in results:
        rows.append(
            [
                r["policy"],
                f"{r['completed']}/{r['sent']}",
                f"{r['requests_per_s']:.2f}",
                *(_ms(r["ttft_s"][p]) for p in ("p50", "p90", "p99")),
                *(_ms(r["itl_s"][p]) for p in ("p50", "p90", "p99")),
                r["peak_running"],
                f"{r['mean_kv_bytes'] / 2**20:.3f}",
                f"{r['mean_kv_bytes_peak'] / 2**20:.3f}",
                f"{r['mean_retention']:.3f}",
                r["cached_prompt_tokens"],
            ]
        )
    print(format_table(headers, rows))
    print(
        "peak held: most requests holding KV pages at once (server metric kvpress_requests_running_peak); "
        "KV MiB held / peak: per request, mean pages held at the end / at most (usage.kv_bytes, kv_bytes_peak); "
        "cached tok: prompt tokens read from cached compressed prefixes (usage.prompt_tokens_details.cached_tokens)"
    )
    for r in results:
        if r["first_error"]:
            print(f"{r['policy']}: {r['errors']} failed requests; first: {r['first_error']}")


def _ratio(a: Any, b: Any) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def run_vllm_comparison(config: ServeBenchConfig) -> list[dict[str, Any]]:
    """`vllm serve` (plugin) and `kvpress serve` on the same load, one after the other per policy.

    Both are started by this bench with the same model, dtype, KV pool (`num_pages`) and `max_num_seqs`,
    and loaded by `vllm bench serve --dataset-name random` (chat, `--ignore-eos`, greedy) with
    `prompt_len` input and `max_tokens` output tokens, `num_requests` prompts, `concurrency` at once.
    """
    from vllm_kvpress_ext.bench.vllm_serve_bench import VllmServeBenchConfig, results_table, run_interleaved
    from vllm_kvpress_ext.vllm_plugin.gguf_model import is_gguf_spec, prepare_gguf_model

    model = config.model or "smollm2-135m"
    tokenizer = str(prepare_gguf_model(model)) if is_gguf_spec(model) else model
    bench = VllmServeBenchConfig(
        servers=("vllm", "kvpress"),
        policies=config.policies,
        model=model,
        num_pages=config.num_pages,
        num_prompts=config.num_requests,
        input_len=config.prompt_len,
        output_len=config.max_tokens,
        max_concurrency=config.concurrency,
        max_num_seqs=config.max_num_seqs,
        seed=config.seed,
        tokenizer=tokenizer,
    )
    rows = run_interleaved(model, bench)
    print(f"config: {asdict(bench)}")
    print(results_table(rows))
    headers = [
        "policy",
        "req/s vllm",
        "req/s kvpress",
        "kvpress / vllm",
        "out tok/s vllm",
        "out tok/s kvpress",
        "TPOT ms vllm",
        "TPOT ms kvpress",
    ]
    table = []
    for policy in config.policies:
        by = {r["server"]: r for r in rows if r["policy"] == policy}
        v, k = by["vllm serve"], by["kvpress serve"]
        table.append(
            [
                policy,
                f"{v['requests_per_s']:.3f}",
                f"{k['requests_per_s']:.3f}",
                _ratio(k["requests_per_s"], v["requests_per_s"]),
                f"{v['output_tokens_per_s']:.1f}",
                f"{k['output_tokens_per_s']:.1f}",
                f"{v['tpot_ms_mean']:.0f}",
                f"{k['tpot_ms_mean']:.0f}",
            ]
        )
    print(format_table(headers, table))
    if config.out:
        Path(config.out).write_text(json.dumps({"config": asdict(bench), "results": rows}, indent=2) + "\n")
    return rows


def _session_runs(model_dir: Path, policy: str, config: ServeBenchConfig, log_dir: Path) -> list[dict[str, Any]]:
    """The multi-turn workload on three fresh servers: reuse off, the named context only, every turn."""
    results = []
    for label, caching, matching in (("off", False, "named"), ("named", True, "named"), ("auto", True, "auto")):
        with _server(model_dir, policy, config, log_dir, caching, matching) as url:
            results.append(asyncio.run(_session_phase(url, "bench", policy, config, f"{policy}, reuse {label}")))
    return results


def run_serve_bench(config: ServeBenchConfig) -> list[dict[str, Any]]:
    """Run every policy and print one table; returns the per-policy figures (also written to `out`)."""
    if config.compare_vllm:
        return run_vllm_comparison(config)
    results: list[dict[str, Any]] = []
    if config.url:
        url = config.url.rstrip("/")
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for policy in config.policies:
            results.append(asyncio.run(_phase(url, model, policy, config)))
        where = f"{url} (running; KV memory is whatever it was started with)"
    else:
        with tempfile.TemporaryDirectory(prefix="kvpress-bench-serve-") as tmp:
            model_dir = Path(config.model) if config.model else suite_bench_model_dir(Path(tmp) / "model", config.seed)
            for policy in config.policies:
                if config.sessions:
                    results += _session_runs(model_dir, policy, config, Path(tmp))
                    continue
                for reuse in (False, True) if config.shared_contexts else (True,):
                    label = f"{policy}, reuse {'on' if reuse else 'off'}" if config.shared_contexts else policy
                    with _server(model_dir, policy, config, Path(tmp), reuse) as url:
                        results.append(asyncio.run(_phase(url, "bench", policy, config, label)))
        model_name = config.model or "random bench model (suite tokenizer)"
        where = f"one `kvpress serve` per policy on 127.0.0.1, --kv-memory {config.kv_memory}, model {model_name}"
    _print(config, where, results)
    if config.out:
        Path(config.out).write_text(json.dumps({"config": asdict(config), "results": results}, indent=2) + "\n")
    return results
