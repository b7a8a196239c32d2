"""The CPU paths chosen once per process, and said: `kvpress info` / `kvpress env`, the engine's startup
log, and a bf16 model that runs (never crashes) on a CPU whose oneDNN has no bf16 kernels."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from vllm_kvpress_ext.assets import default_model_dir
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine
from vllm_kvpress_ext.models import linear

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_env_names_every_cpu_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    report = capsys.readouterr().out
    fields = {line[:17].strip(): line[17:] for line in report.splitlines() if len(line) > 17}
    assert fields["ATen kernels"].strip() == torch.backends.cpu.get_cpu_capability()
    bf16 = "bfloat16 oneDNN" if linear.onednn_runs(torch.bfloat16) else "bfloat16 F.linear below 16 rows, else oneDNN"
    assert bf16 in fields["projections"]
    assert fields["C++ kernels"].startswith(("on: ", "off: "))
    assert "MiB on 2 MB pages" in fields["huge pages"]
    assert {"cpu", "cpu features", "oneDNN", "cpu path env"} <= set(fields)


def test_the_engine_logs_its_cpu_paths_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm_kvpress_ext.engine.model_runner"):
        LLMEngine(default_model_dir(), dtype=torch.float32, num_pages=64, page_size=16)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU paths: ")]
    assert f"ATen {torch.backends.cpu.get_cpu_capability()}" in line and "projections float32 " in line
    assert "C++ kernels " in line and "KV pool " in line


@pytest.mark.skipif(not linear.ONEDNN_ENABLED, reason="torch without oneDNN, or oneDNN switched off")
def test_bf16_runs_where_onednn_has_no_bf16_kernels() -> None:
    """As on an AVX2-only x86-64 CPU (the variables make oneDNN and ATen behave so on any x86 CPU): the
    projections take F.linear or the widened fp32 product for bf16, say so, and a bf16 model generates."""
    script = (
        "import torch\n"
        "from vllm_kvpress_ext.assets import default_model_dir\n"
        "from vllm_kvpress_ext.engine import LLM, SamplingParams\n"
        "from vllm_kvpress_ext.engine.environment import projection_paths\n"
        "x = torch.ones(2, 16, dtype=torch.bfloat16)\n"
        "try:\n"
        "    torch.ops.mkldnn._linear_pointwise(x, torch.ones(8, 16, dtype=torch.bfloat16), None, 'none', [], '')\n"
        "    print('bfloat16 oneDNN')\n"
        "except RuntimeError:\n"
        "    print('bfloat16 F.linear')\n"
        "print(projection_paths())\n"
        "out = LLM(default_model_dir(), dtype='bfloat16', num_pages=64).generate(\n"  # 40 rows: widened
        "    [list(range(5, 45))], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]\n"
        "print(len(out.output_token_ids), out.finish_reason)\n"
    )
    env = {**os.environ, **AVX2_ONLY}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    what_onednn_does, paths, generated = result.stdout.strip().splitlines()[-3:]
    assert what_onednn_does in paths and "float32 oneDNN" in paths  # AVX2 (x86-64 only): bf16 fails, F.linear
    assert generated == "6 length"
    assert "primitive descriptor" not in result.stderr
