"""`kvpress bench serve` end to end at a tiny size: it starts its own servers and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvpress_ext.cli import main


def test_bench_serve_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--policies", "full,snapkv", "--num-requests", "6", "--concurrency", "3"]
    # The phase ends when the 6 requests complete: the duration is only a bound a stuck server would hit,
    # never one a slow machine could (each request is 64 prompt tokens and 4 generated ones).
    argv += ["--prompt-len", "64", "--max-tokens", "4", "--kv-memory", "2MiB", "--duration", "3600"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "TTFT p50 ms" in text and "ITL p50 ms" in text and "peak held" in text and "req/s" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("full ", "snapkv "))}
    assert set(rows) == {"full", "snapkv"}
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    for r in results.values():
        assert r["completed"] == r["sent"] == 6 and r["errors"] == 0
        assert r["requests_per_s"] > 0 and r["peak_running"] >= 1
        assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p99"] >= r["itl_s"]["p50"] > 0
    assert results["snapkv"]["mean_retention"] < 1.0 == results["full"]["mean_retention"]
    assert results["snapkv"]["mean_kv_bytes"] < results["full"]["mean_kv_bytes"]


def test_shared_context_workload_names_each_context() -> None:
    from vllm_kvpress_ext.bench.serve_bench import ServeBenchConfig, _prompts
    from vllm_kvpress_ext.tasks.tokenizer import build_tokenizer

    config = ServeBenchConfig(shared_contexts=3, questions_per_context=4, prompt_len=20, question_len=5)
    assert config.requests == 12
    prompts = _prompts(config)
    assert len(prompts) == 13 and prompts[-1][1] is None  # the last one warms up, with no context named
    tokenizer = build_tokenizer()
    contexts = []
    for text, boundary in prompts[:12]:
        ids = tokenizer.encode(text).ids
        assert boundary == 20 and len(ids) == 25
        contexts.append(tuple(ids[:boundary]))
    # Question-major: every context once, then again; the questions differ.
    assert contexts[:3] == contexts[3:6] and len(set(contexts)) == 3
    assert len({text for text, _ in prompts[:12]}) == 12
    for bad in ({"shared_contexts": -1}, {"question_len": 0}, {"shared_contexts": 2, "url": "http://x"}):
        with pytest.raises(ValueError):
            ServeBenchConfig(**bad)  # type: ignore[arg-type]


def test_multi_turn_workload_compares_three_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "turns.json"
    argv = ["bench", "serve", "--policies", "snapkv", "--sessions", "2", "--turns", "3", "--concurrency", "2"]
    argv += ["--prompt-len", "48", "--question-len", "4", "--max-tokens", "4", "--kv-memory", "4MiB"]
    argv += ["--duration", "3600", "--out", str(out)]
    assert main(argv) == 0
    assert "cached tok" in capsys.readouterr().out
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"snapkv, reuse off", "snapkv, reuse named", "snapkv, reuse auto"}
    for r in results.values():
        assert r["completed"] == r["sent"] == 6 and r["errors"] == 0
    # Off: nothing cached. Named: turns 2 and 3 of each conversation read the context (48 tokens).
    # Auto: they read the previous turn, which holds the context and more.
    assert results["snapkv, reuse off"]["cached_prompt_tokens"] == 0
    assert results["snapkv, reuse named"]["cached_prompt_tokens"] == 2 * 2 * 48
    assert results["snapkv, reuse auto"]["cached_prompt_tokens"] > 2 * 2 * 48


def test_multi_turn_settings_are_checked() -> None:
    from vllm_kvpress_ext.bench.serve_bench import ServeBenchConfig

    assert ServeBenchConfig(sessions=3, turns=5).requests == 15
    for bad in ({"sessions": -1}, {"sessions": 2, "turns": 0}, {"sessions": 2, "url": "http://x"}):
        with pytest.raises(ValueError):
            ServeBenchConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="excludes --shared-contexts"):
        ServeBenchConfig(sessions=2, shared_contexts=2)


def test_vllm_serve_bench_runs_stock_vllm_beside_the_plugin_on_the_same_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The stock server is vLLM from another environment with its own defaults and no policy; the load
    generator gets the shared prefix; every server gets a context long enough for it."""
    from vllm_kvpress_ext.bench.vllm_serve_bench import VllmServeBenchConfig, bench_command, server_command

    config = VllmServeBenchConfig(prefix_len=2048, input_len=128, output_len=32, stock_vllm="/opt/stock/bin/vllm")
    stock = server_command("stock", "full", "/m", 8000, config)
    assert stock[:3] == ["/opt/stock/bin/vllm", "serve", "/m"] and "--kv-policy" not in stock
    for server in ("stock", "vllm", "vllm-native", "kvpress"):
        command = server_command(server, "full", "/m", 8000, config)
        assert command[command.index("--max-model-len") + 1] == str(2048 + 128 + 32 + 64)
    native = server_command("vllm-native", "full", "/m", 8000, config)
    assert json.loads(native[native.index("--additional-config") + 1])["kv_runner"] == "vllm"
    own = server_command("vllm", "full", "/m", 8000, config)
    assert json.loads(own[own.index("--additional-config") + 1])["kv_runner"] == "project"
    with pytest.raises(ValueError, match="cannot run policy"):
        server_command("stock", "snapkv", "/m", 8000, config)
    load = bench_command("http://x", "/m", Path("/tmp/r.json"), config)
    assert load[load.index("--random-prefix-len") + 1] == "2048"
    assert "--random-prefix-len" not in bench_command("http://x", "/m", Path("/tmp/r.json"), VllmServeBenchConfig())
    assert load[load.index("--endpoint") + 1] == "/v1/chat/completions"
    base = bench_command("http://x", "/m", Path("/tmp/r.json"), VllmServeBenchConfig(endpoint="completions"))
    assert base[base.index("--backend") + 1] == "openai" and base[base.index("--endpoint") + 1] == "/v1/completions"
    assert main(["bench", "vllm-serve", "--servers", "stock"]) == 2
    assert "--stock-vllm" in capsys.readouterr().err
