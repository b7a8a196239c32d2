"""`kvpress bench kernels --compile-only`: every GPU kernel compiled for a GPU on a machine without one.

What a GPU run would find first, found on any machine with the toolchains: a kernel that no longer
compiles for the architecture, needs more shared memory than an SM has, or spills registers.

**Triton kernels, through the engine's own launch code.** Triton compiles for the GPU that its
active driver reports and then loads and launches the binary through that driver. `CompileOnlyDriver`
stands in for the CUDA driver at exactly that boundary: it reports the target (sm_90 by default),
and where the real driver would load a binary it reads the binary's resources instead (registers and
local memory from the `cuobjdump` Triton ships), and where it would launch, it records the grid. So
each case calls a kernel module's wrapper (`kernels/decode_attention.py` and the others), the
function the dispatcher calls on CUDA tensors, with small CPU tensors of the dtype and shape under
test: the wrapper chooses its block sizes, splits, warps and specialisations as it would on a GPU,
and Triton compiles exactly what it would launch. Nothing runs; no result is checked here (the
interpreter tests and the GPU tests do that).

The cases: the dtypes fp16, bf16 and fp32; head dims 64, 128 and 256 (Gemma 3); GQA groups 1, 4 and 8;
decode with and without the local ring, in one split (the direct path) and in 2 to 64 splits (every
reduce specialisation, `BLOCK_S` 2 to 64), plus mixed query / cache dtypes; the KV write with and
without positions; the slot copy staged and disjoint; the window scores' two passes with every window
and group reduction; the vertical-slash prefill.

**The CUDA decode extension** (`csrc/paged_decode.cu`) is compiled by `nvcc` for sm_80 and sm_90 with
the flags torch's JIT build passes, `-Xptxas -v` reporting each instantiation's registers, spills and
static shared memory.

A kernel fails the check if it spills (local memory per thread above zero), needs more shared memory
than one block may have (227 KiB on sm_90, 163 KiB on sm_80), or more registers per block than an SM
holds (65,536), unless `ACCEPTED` names its spills with the reason and a ceiling. The check compiles
everything, prints one table, and says what failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.bench.report import format_table, markdown_table

#: Shared memory one thread block may use (bytes, the opt-in maximum), per compute capability.
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGISTERS_PER_SM = 65_536
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Acceptance:
    """Spills a kernel may have, and why: variants of `kernel` whose label holds every one of `matching`,
    up to `max_spill_bytes` per thread (more is a regression, and fails)."""

    kernel: str
    matching: tuple[str, ...]
    max_spill_bytes: int
    reason: str

    def covers(self, build: KernelBuild) -> bool:
        label = build.variant.split()
        return build.kernel == self.kernel and all(m in label for m in self.matching)


_FP32_REASON = (
    "fp32 is the exactness mode (parity with the references to 1e-5; serving runs fp16 / bf16): its dot "
    "products are IEEE fp32 on FMA units, accumulated in registers, and spill at the smallest tile a dot allows"
)
_UPCAST_REASON = (
    "a cache in another dtype than the model's (`kv_dtype`) is widened to fp32 after loading, with fp32's "
    "register-hungry dot products; at 32 tokens a tile (16 at head_dim 256) it still spills at 128 and 256"
)
# Ceilings are the most sm_90 showed with Triton 3.9 (torch 2.13's) and 3.8 (torch 2.14's, which vLLM 0.33 pins),
# rounded up a little (docs/gpu.md). Two are 3.8's: the bf16 vertical-slash at head_dim 128 (264 B, 3.9: 168) and the
# upcast decode at head_dim 256 (3,168 B, 3.9: 2,216).
ACCEPTED: tuple[Acceptance, ...] = (
    Acceptance(
        "_vertical_slash_kernel",
        ("HEAD_DIM=128",),
        272,
        "128 x 64 tiles with 4 warps measured fastest of 24 configurations on an H100 (docs/gpu.md)",
    ),
    Acceptance("_vertical_slash_kernel", ("fp32",), 512, _FP32_REASON),
    Acceptance("_scores_kernel", ("fp32",), 2688, _FP32_REASON),
    Acceptance("_decode_partial_kernel", ("fp32",), 64, _FP32_REASON),
    Acceptance("_decode_partial_kernel", ("UPCAST=1",), 3200, _UPCAST_REASON),
)
CSRC = Path(__file__).resolve().parents[2] / "csrc"
# The constexprs that tell one specialisation from another in the table (block sizes follow from them).
_LABELLED = (
    "GROUP",
    "HEAD_DIM",
    "HAS_RING",
    "DIRECT",
    "UPCAST",
    "BLOCK_S",
    "HAS_POS",
    "SRC_PAGED",
    "DST_PAGED",
    "WINDOW_MEAN",
    "GROUP_MAX",
    "BLOCK_W",
    "BLOCK_N",
)


@dataclass(frozen=True)
class KernelBuild:
    """One compiled kernel: what it was compiled as, and the resources it needs per block."""

    source: str  # "triton" or "cuda"
    kernel: str
    variant: str
    arch: int
    threads: int | None  # per block (None where the compiler does not say)
    registers: int
    spill_bytes: int  # local memory per thread: register spills
    shared_bytes: int

    @property
    def problems(self) -> list[str]:
        found = []
        if self.spill_bytes:
            found.append(f"spills {self.spill_bytes} B per thread")
        limit = SHARED_PER_BLOCK.get(self.arch)
        if limit is not None and self.shared_bytes > limit:
            found.append(f"{self.shared_bytes} B of shared memory > {limit}")
        if self.threads is not None and self.registers * self.threads > REGISTERS_PER_SM:
            found.append(f"{self.registers} registers x {self.threads} threads > {REGISTERS_PER_SM}")
        return found

    @property
    def acceptance(self) -> Acceptance | None:
        """The entry of `ACCEPTED` that excuses this kernel's spills, if its spills are all it reports."""
        if self.problems != [f"spills {self.spill_bytes} B per thread"]:
            return None
        return next((a for a in ACCEPTED if a.covers(self) and self.spill_bytes <= a.max_spill_bytes), None)

    @property
    def failed(self) -> bool:
        return bool(self.problems) and self.acceptance is None


class KernelBuildUnavailableError(RuntimeError):
    """A toolchain the check needs is missing; the message says which."""


# ---------------------------------------------------------------------------------------- Triton


def _cuobjdump() -> Path:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        raise KernelBuildUnavailableError(f"Triton's cuobjdump is missing ({tool})")
    return tool


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes per thread) of a cubin's one kernel, as `cuobjdump --dump-resource-usage` says."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        report = subprocess.run(
            [str(_cuobjdump()), "--dump-resource-usage", handle.name], capture_output=True, text=True, timeout=60
        )
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report.stdout)
    if usage is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {report.stdout[-500:]} {report.stderr[-500:]}")
    registers, stack, local = (int(v) for v in usage.groups())
    return registers, stack + local


class CompileOnlyDriver:
    """Triton's `driver.active` for a machine without a GPU: the target is `arch`; binaries are read, not
    loaded; launches are recorded, not run. Everything before those two calls is Triton's own path."""

    def __init__(self, arch: int = 90) -> None:
        self.arch = arch
        self.builds: list[KernelBuild] = []
        self.launches: list[tuple[str, tuple[int, int, int]]] = []
        self._metadata: dict[str, tuple[Any, Any]] = {}
        self.utils = types.SimpleNamespace(
            load_binary=self._load_binary,
            get_device_properties=lambda device: {
                "max_shared_mem": SHARED_PER_BLOCK.get(arch, 227 * 1024),
                "multiprocessor_count": 132,
            },
            unload_module=lambda module: None,
        )
        self.launcher_cls = self._launcher

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def _launcher(self, src: Any, metadata: Any) -> Callable[..., None]:
        self._metadata[metadata.name] = (src, metadata)
        name = metadata.name

        def launch(grid_x: int, grid_y: int, grid_z: int, *rest: object) -> None:
            self.launches.append((name, (grid_x, grid_y, grid_z)))

        return launch

    def _load_binary(self, name: str, cubin: bytes, shared: int, device: int) -> tuple[None, None, int, int, int]:
        src, metadata = self._metadata[name]
        registers, spill = cubin_resources(cubin)
        labels = [f"{key}={int(v) if isinstance(v, bool) else v}" for key in _LABELLED if (v := _constant(src, key))]
        # The float tensors' dtypes, in argument order: `bf16` for a direct decode, `bf16/fp32` with split
        # partials, `fp32/fp16` for a reduce writing fp16.
        floats = [t.lstrip("*") for t in src.signature.values() if isinstance(t, str) and t.startswith(("*fp", "*bf"))]
        variant = " ".join(["/".join(dict.fromkeys(floats)), *labels])
        threads = metadata.num_warps * 32  # per block (a cluster of CTAs is blocks side by side)
        self.builds.append(
            KernelBuild("triton", name, variant, self.arch, threads, registers, spill, int(metadata.shared))
        )
        return None, None, registers, spill, 1024


def _constant(src: Any, name: str) -> Any:
    """A constexpr of a compiled kernel by name (Triton keys them by argument path)."""
    names = list(src.fn.arg_names)
    if name not in names:
        return None
    return src.constants.get((names.index(name),))


@contextmanager
def compile_only(arch: int = 90) -> Iterator[CompileOnlyDriver]:
    """Make Triton compile for `arch` without a GPU for the duration (one process: Triton keeps what it
    compiled per device, so run this where no real GPU work follows)."""
    from triton.runtime.driver import driver

    stand_in = CompileOnlyDriver(arch)
    previous = driver._active  # None until something asked: `reset_active` would look for a GPU driver
    driver.set_active(stand_in)
    try:
        yield stand_in
    finally:
        driver._active = previous


@dataclass(frozen=True)
class Case:
    """One launch of a kernel wrapper: the family and the shape axes that select its specialisations."""

    family: str
    dtype: str
    head_dim: int
    group: int = 1
    ring: bool = False
    splits: int = 1  # decode: 1 = direct, else the forced split count
    option: str = ""  # a family's own switch: "positions", "disjoint", "mean-max", "kv=float16", ...

    def label(self) -> str:
        parts = [self.family, self.dtype, f"d{self.head_dim}", f"g{self.group}"]
        parts += ["ring"] if self.ring else []
        parts += [f"{self.splits} splits"] if self.splits > 1 else []
        return " ".join(parts + ([self.option] if self.option else []))


def triton_cases() -> list[Case]:
    """Every specialisation the engine can launch along the axes in the module docstring."""
    dtype_names = [str(d).removeprefix("torch.") for d in DTYPES]
    cases = []
    for dtype in dtype_names:
        for head_dim in HEAD_DIMS:
            for group in GROUPS:
                for ring in (False, True):
                    cases.append(Case("decode", dtype, head_dim, group, ring, splits=1))
                    cases.append(Case("decode", dtype, head_dim, group, ring, splits=2))
                for reductions in ("sum-mean", "sum-max", "mean-mean", "mean-max"):
                    cases.append(Case("window_scores", dtype, head_dim, group, option=reductions))
                cases.append(Case("vertical_slash", dtype, head_dim, group))
            for splits in (4, 8, 16, 32, 64):  # the reduce kernel's BLOCK_S; the partial kernel is the same
                cases.append(Case("decode", dtype, head_dim, 4, splits=splits))
            cases.append(Case("kv_write", dtype, head_dim, option="positions"))
            cases.append(Case("kv_write", dtype, head_dim))
            cases.append(Case("copy_slots", dtype, head_dim, option="disjoint"))
            cases.append(Case("copy_slots", dtype, head_dim, option="staged"))
    for head_dim in HEAD_DIMS:  # a cache in another dtype than the model's (`kv_dtype`): the upcast path
        for query, cache in (("bfloat16", "float16"), ("float32", "bfloat16")):
            for splits in (1, 2):
                cases.append(Case("decode", query, head_dim, 4, splits=splits, option=f"kv={cache}"))
    return cases


def run_case(case: Case) -> None:
    """Call the kernel module's wrapper for `case` on small CPU tensors (under `compile_only`)."""
    from vllm_kvpress_ext.kernels import compaction, decode_attention, kv_write, vertical_slash, window_scores

    dtype = getattr(torch, case.dtype)
    d, g, page_size, kv_heads = case.head_dim, case.group, 16, 2
    pages = 8
    if case.family == "decode":
        cache = getattr(torch, case.option.removeprefix("kv=")) if case.option.startswith("kv=") else dtype
        batch = 2
        # The wrapper's own tile and, for several splits, one tile per split: a table wide enough
        # for `splits` tiles (nothing is read, so the pool stays small). One split: the dispatcher's choice
        # for a short table.
        upcast = cache != dtype
        tile = decode_attention.default_block_n(d, dtype == torch.float32 or upcast, upcast)
        table_pages = 4 if case.splits == 1 else case.splits * tile // page_size - (1 if case.ring else 0)
        query = torch.zeros(batch, kv_heads * g, d, dtype=dtype)
        pool = torch.zeros(pages, 2, page_size, d, dtype=cache)
        tables = torch.zeros(batch, kv_heads, table_pages, dtype=torch.int32)
        lens = torch.full((batch, kv_heads), 4 * page_size, dtype=torch.int32)
        ring = (
            (torch.zeros(batch, kv_heads, 1, dtype=torch.int32), torch.full((batch,), 3)) if case.ring else (None, None)
        )
        decode_attention.paged_decode_attention(
            query,
            pool,
            torch.zeros(pages, page_size, dtype=torch.int32),
            tables,
            lens,
            torch.arange(batch),
            d**-0.5,
            *ring,
            split_tokens=None if case.splits == 1 else tile,
        )
    elif case.family == "kv_write":
        pool = torch.zeros(pages, 2, page_size, d, dtype=dtype)
        keys = torch.zeros(5, d, dtype=dtype)
        positions = torch.zeros(pages, page_size, dtype=torch.int32) if case.option else None
        kv_write.write_kv(
            pool, torch.arange(5), keys, keys.clone(), positions, torch.arange(5) if case.option else None
        )
    elif case.family == "copy_slots":
        pool = torch.zeros(pages, 2, page_size, d, dtype=dtype)
        compaction.copy_slots(
            pool,
            torch.zeros(pages, page_size, dtype=torch.int32),
            torch.arange(4),
            torch.arange(4) + 20,
            disjoint=case.option == "disjoint",
        )
    elif case.family == "window_scores":
        window_reduction, group_reduction = case.option.split("-")
        window_scores.window_scores(
            torch.zeros(64, kv_heads * g, d, dtype=dtype),  # a 64-query window: the widest tile
            torch.arange(64, 128),
            torch.zeros(kv_heads, 128, d, dtype=dtype),
            torch.arange(128),
            d**-0.5,
            window_reduction,
            group_reduction,
        )
    elif case.family == "vertical_slash":
        n = 64
        vertical_slash.vertical_slash_attention(
            torch.zeros(n, kv_heads * g, d, dtype=dtype),
            torch.zeros(n, kv_heads, d, dtype=dtype),
            torch.zeros(n, kv_heads, d, dtype=dtype),
            torch.ones(kv_heads, n, dtype=torch.bool),
            16,
            d**-0.5,
        )
    else:
        raise ValueError(f"unknown kernel family {case.family!r}")


def _compile_cases(cases: list[Case], arch: int) -> tuple[list[KernelBuild], list[str]]:
    """Compile `cases` in this process: the builds, and an error line per case that failed to compile."""
    errors = []
    with compile_only(arch) as stand_in:
        for case in cases:
            try:
                run_case(case)
            except Exception as exc:  # a kernel that does not compile is a finding, not a crash of the check
                errors.append(f"{case.label()}: {type(exc).__name__}: {str(exc).strip()[-800:]}")
    return stand_in.builds, errors


def compile_triton(
    arch: int = 90, jobs: int = 1, cases: list[Case] | None = None
) -> tuple[list[KernelBuild], list[str]]:
    """Compile every case for `arch` in `jobs` processes (each a fresh Triton), deduplicated by variant."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise KernelBuildUnavailableError("triton is not installed (the `triton` extra)") from exc
    _cuobjdump()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise KernelBuildUnavailableError("TRITON_INTERPRET is set: Triton would interpret, not compile")
    todo = triton_cases() if cases is None else cases
    jobs = max(1, min(jobs, len(todo)))
    shares = [todo[i::jobs] for i in range(jobs)]
    if jobs == 1:
        results = [_compile_cases(todo, arch)]
    else:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_cases, shares, [arch] * jobs))
    builds: dict[tuple[str, str], KernelBuild] = {}
    errors: list[str] = []
    for found, failed in results:
        builds.update({(b.kernel, b.variant): b for b in found})
        errors += failed
    return sorted(builds.values(), key=lambda b: (b.kernel, b.variant)), errors


# ---------------------------------------------------------------------------------------- CUDA


def nvcc_path() -> str | None:
    """nvcc on PATH, else where the CUDA toolkit installs it."""
    return shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")


#: The flags torch's JIT build (`cpp_extension.load`, `kernels/cuda_decode.py`) passes to nvcc.
NVCC_FLAGS = (
    "-std=c++20",
    "-O3",
    "--use_fast_math",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-Xcompiler",
    "-fPIC",
)
#: Threads per block of the extension's kernels (`csrc/paged_decode.cu`: 4 warps; the reduce, one per dim).
CUDA_THREADS = {"paged_decode_split_kernel": 128}


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    result = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, timeout=60)
    lines = result.stdout.splitlines()
    return lines if len(lines) == len(names) else names


def parse_ptxas(report: str) -> list[tuple[str, int, int, int, int]]:
    """(mangled kernel, sm, registers, spill bytes, static shared bytes) per entry of `nvcc -Xptxas -v` output."""
    entries = []
    blocks = re.split(r"ptxas info\s*: Compiling entry function ", report)[1:]
    for block in blocks:
        head = re.match(r"'([^']+)' for 'sm_(\d+)a?'", block)
        used = re.search(r"Used (\d+) registers", block)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        shared = re.search(r"(\d+) bytes smem", block)
        if head is None or used is None:
            continue
        spill = int(spills.group(1)) + int(spills.group(2)) if spills else 0
        entries.append(
            (head.group(1), int(head.group(2)), int(used.group(1)), spill, int(shared.group(1)) if shared else 0)
        )
    return entries


def compile_cuda_extension(arches: tuple[int, ...] = (80, 90)) -> list[KernelBuild]:
    """`nvcc -c csrc/paged_decode.cu` for each arch; raises RuntimeError with nvcc's output if it fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildUnavailableError("nvcc not found")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arches]
    with tempfile.TemporaryDirectory() as scratch:
        command = [nvcc, *NVCC_FLAGS, *gencode, "-Xptxas", "-v", "-c", str(CSRC / "paged_decode.cu")]
        result = subprocess.run([*command, "-o", str(Path(scratch) / "paged_decode.o")], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arches}:\n{result.stderr[-4000:]}")
    entries = parse_ptxas(result.stdout + result.stderr)
    names = _demangle([e[0] for e in entries])
    builds = []
    for (_, arch, registers, spill, shared), name in zip(entries, names, strict=True):
        short = re.sub(r"^.*::(\w+)<(.*)>\(.*$", r"\1<\2>", name)  # kvpress::(anon)::kernel<T, D, G>(params)
        kernel = short.split("<", 1)[0]
        variant = short[len(kernel) :].strip("<>").replace("__nv_bfloat16", "bf16").replace("__half", "fp16")
        builds.append(KernelBuild("cuda", kernel, variant, arch, CUDA_THREADS.get(kernel), registers, spill, shared))
    return sorted(builds, key=lambda b: (b.arch, b.kernel, b.variant))


# ---------------------------------------------------------------------------------------- report


HEADERS = ["source", "kernel", "variant", "sm", "threads", "registers", "spill B", "shared B", "verdict"]


def _row(build: KernelBuild) -> list[object]:
    problems = build.problems
    verdict = "ok" if not problems else ("; ".join(problems) + (" (accepted)" if build.acceptance else ""))
    return [
        build.source,
        build.kernel,
        build.variant,
        build.arch,
        build.threads if build.threads is not None else "-",
        build.registers,
        build.spill_bytes,
        build.shared_bytes,
        verdict,
    ]


def run_kernel_build(
    arch: int = 90, cuda_arches: tuple[int, ...] = (80, 90), jobs: int = 1, out: Path | None = None
) -> int:
    """Compile everything, print the table and a summary. Exit status: 0 if every kernel built within its
    limits, 1 if one did not, 2 if a toolchain was missing (so something went unchecked)."""
    start = time.perf_counter()
    builds: list[KernelBuild] = []
    errors: list[str] = []
    skipped: list[str] = []
    try:
        triton_builds, triton_errors = compile_triton(arch, jobs)
        builds += triton_builds
        errors += triton_errors
    except KernelBuildUnavailableError as exc:
        skipped.append(f"Triton kernels: {exc}")
    try:
        builds += compile_cuda_extension(cuda_arches)
    except KernelBuildUnavailableError as exc:
        skipped.append(f"CUDA extension: {exc}")
    except RuntimeError as exc:
        errors.append(f"CUDA extension: {exc}")
    seconds = time.perf_counter() - start
    rows = [_row(b) for b in builds]
    print(format_table(HEADERS, rows))
    failed = [b for b in builds if b.failed]
    worst = max(builds, key=lambda b: b.shared_bytes, default=None)
    print(
        f"\n{len(builds)} kernels compiled ({sum(b.source == 'triton' for b in builds)} Triton for sm_{arch}, "
        f"{sum(b.source == 'cuda' for b in builds)} CUDA for {', '.join(f'sm_{a}' for a in cuda_arches)}) "
        f"in {seconds:.0f} s; most registers {max((b.registers for b in builds), default=0)}, "
        f"most shared memory {worst.shared_bytes if worst else 0} B ({worst.kernel if worst else '-'}); "
        f"{len(failed)} over a limit, {len(errors)} failed to compile"
    )
    for line in skipped:
        print(f"skipped: {line}")
    for line in errors:
        print(f"FAILED TO COMPILE: {line}")
    for build in failed:
        print(f"OVER A LIMIT: {build.kernel} [{build.variant}] sm_{build.arch}: {'; '.join(build.problems)}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "arch": arch,
            "cuda_arches": list(cuda_arches),
            "seconds": seconds,
            "builds": [asdict(b) | {"problems": b.problems} for b in builds],
            "errors": errors,
            "skipped": skipped,
            "python": sys.version.split()[0],
        }
        (out / "kernel_build.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "kernel_build.md").write_text("\n".join(markdown_table(HEADERS, rows)) + "\n")
    if failed or errors:
        return 1
    return 2 if skipped else 0
