"""GPU kernels compiled for a GPU on a machine without one (`bench/kernel_build.py`): the engine's own launch
code drives Triton to sm_90 binaries, nvcc builds the CUDA extension for sm_80 and sm_90, and the check
reads each kernel's registers, spills and shared memory and fails what exceeds a limit.

The whole matrix (about 300 Triton kernels) is `make check-kernels`, which `.ci/run` runs; here, one
case per kernel family in a fresh process (Triton keeps what it compiled per device)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvpress_ext.bench import kernel_build
from vllm_kvpress_ext.bench.kernel_build import Acceptance, Case, KernelBuild, parse_ptxas

triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
needs_cuobjdump = pytest.mark.skipif(not CUOBJDUMP.is_file(), reason="Triton without its NVIDIA tools")


@needs_cuobjdump
def test_one_kernel_of_each_family_compiles_for_hopper_through_its_launch_code(tmp_path: Path) -> None:
    cases = [
        Case("decode", "bfloat16", 128, 4),
        Case("decode", "float16", 256, 8, ring=True, splits=4),
        Case("kv_write", "bfloat16", 64, option="positions"),
        Case("copy_slots", "float16", 128, option="staged"),
        Case("window_scores", "bfloat16", 128, 4, option="sum-max"),
        Case("vertical_slash", "bfloat16", 64, 1),
    ]
    script = (
        "import json, sys\n"
        "from vllm_kvpress_ext.bench.kernel_build import Case, compile_only, run_case\n"
        "cases = [Case(**c) for c in json.loads(sys.argv[1])]\n"
        "with compile_only(90) as driver:\n"
        "    for case in cases:\n"
        "        run_case(case)\n"
        "print(json.dumps({'builds': [b.__dict__ | {'failed': b.failed} for b in driver.builds],\n"
        "                  'launches': driver.launches}))\n"
    )
    argument = json.dumps([c.__dict__ for c in cases])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # test_kernels.py sets it
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run(
        [sys.executable, "-c", script, argument], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    builds = {(b["kernel"], b["variant"]): b for b in record["builds"]}
    kernels = {kernel for kernel, _ in builds}
    assert kernels == {
        "_decode_partial_kernel",
        "_decode_reduce_kernel",
        "_kv_write_kernel",
        "_move_kernel",
        "_lse_kernel",
        "_scores_kernel",
        "_vertical_slash_kernel",
    }
    assert all(b["arch"] == 90 and b["registers"] > 0 and b["threads"] == 128 for b in builds.values())
    assert not [b for b in builds.values() if b["failed"]]
    direct = builds[("_decode_partial_kernel", "bf16 GROUP=4 HEAD_DIM=128 DIRECT=1 BLOCK_N=128")]
    assert 0 < direct["shared_bytes"] <= kernel_build.SHARED_PER_BLOCK[90]
    assert ("_decode_reduce_kernel", "fp32/fp16 HEAD_DIM=256 BLOCK_S=4") in builds  # 4 splits: the reduce's block
    # What would have been launched: the decode grid is (batch, KV heads, splits), as on a GPU.
    launched = {name: tuple(grid) for name, grid in record["launches"]}
    assert launched["_decode_partial_kernel"] == (2, 2, 4) and launched["_decode_reduce_kernel"] == (2, 16, 1)


@pytest.mark.heavy
@pytest.mark.skipif(kernel_build.nvcc_path() is None, reason="nvcc not found")
def test_the_cuda_extension_compiles_for_ampere_and_hopper_without_spills() -> None:
    builds = kernel_build.compile_cuda_extension((80, 90))
    assert {b.arch for b in builds} == {80, 90}
    split = [b for b in builds if b.kernel == "paged_decode_split_kernel"]
    # fp32 / fp16 / bf16 x head_dim 64, 128 x group 1, 2, 4, 8, 16, per arch (csrc/README.md)
    assert len(split) == 2 * 3 * 2 * 5 and all(b.threads == 128 for b in split)
    assert {b.variant for b in split} >= {"bf16, 128, 16", "fp16, 64, 1", "float, 128, 8"}
    assert not [b for b in builds if b.problems], [(b.kernel, b.variant, b.problems) for b in builds if b.problems]


def test_ptxas_reports_are_read_per_entry() -> None:
    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelILi1EEvv' for 'sm_90'
ptxas info    : Function properties for _Z6kernelILi1EEvv
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 33280 bytes smem
ptxas info    : Compiling entry function '_Z6kernelILi2EEvv' for 'sm_80'
ptxas info    : Function properties for _Z6kernelILi2EEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""
    assert parse_ptxas(report) == [("_Z6kernelILi1EEvv", 90, 255, 20, 33280), ("_Z6kernelILi2EEvv", 80, 40, 0, 0)]


def test_limits_fail_a_kernel_unless_its_spills_are_accepted_up_to_their_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def build(spill: int = 0, shared: int = 1024, registers: int = 64, threads: int = 128) -> KernelBuild:
        return KernelBuild("triton", "_k", "fp32 HEAD_DIM=128", 90, threads, registers, spill, shared)

    assert not build().problems and not build().failed
    assert build(shared=228 * 1024).failed and "shared memory" in build(shared=228 * 1024).problems[0]
    assert build(registers=255, threads=512).failed  # 130,560 registers: more than an SM has
    monkeypatch.setattr(kernel_build, "ACCEPTED", (Acceptance("_k", ("fp32",), 256, "why"),))
    assert build(spill=200).problems and not build(spill=200).failed  # named, with a reason
    assert build(spill=300).failed  # over its ceiling: a regression
    assert build(spill=200, shared=228 * 1024).failed  # acceptance excuses spills only
    other = KernelBuild("triton", "_k", "bf16 HEAD_DIM=128", 90, 128, 64, 200, 1024)
    assert other.failed  # the bf16 variant is not covered


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt")
def test_cuda_kernel_names_are_demangled() -> None:
    names = kernel_build._demangle(["_ZN7kvpress6kernelI6__halfLi64ELi4EEEvv"])
    assert names == ["void kvpress::kernel<__half, 64, 4>()"]
