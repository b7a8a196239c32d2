"""CPU kernels in C++, compiled on first use for the machine that runs them and loaded with ctypes.

Two so far, in one library:

- `causal_column_sums_given_lse` (`column_sums.cpp`), which H2O's prefill scores need: the column
  sums of a prompt's causal attention, given each query's log-sum-exp. torch has no op that does it
  without a second full attention pass (see `policies/h2o.py`).
- `paged_decode_attention` (`paged_decode.cpp`): a decode step's attention read straight from the
  ragged pages, where torch's path first copies each request's entries into a dense padded tensor.

Build: `$CXX` (else `c++`) compiles with `-O3 -march=native -ffast-math -fopenmp` (fast math lets the
exponentials vectorise), then links in a second step without `-ffast-math`: linked with it, the
library would carry `crtfastmath.o`, whose constructor sets flush-to-zero for the whole process on
load and silently changes every other float computation in it. No torch headers (about a second).
The source is portable C++ (`omp simd` loops, no intrinsics): `-march` alone picks the vector width,
AVX-512 on a CPU that has it, AVX2 on one that does not. `KVPRESS_CPU_KERNEL_ARCH` replaces `native`
(`x86-64-v3` builds the AVX2 code on an AVX-512 machine, as CI does to test it).

The library is cached under `$KVPRESS_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/vllm-kvpress-ext/kernels`, else `~/.cache/vllm-kvpress-ext/kernels` (beside the
pulled models, `hub/catalog.py`), named by a hash of the source, the flags, the compiler's version,
the instruction sets the flags enable (the compiler's `__AVX512F__`-style macros) and this CPU's
feature flags, so a cache shared between machines never hands one CPU code built for another. And
before loading, the instruction sets the build uses are checked against this CPU's flags: a library
that needs one this CPU lacks is never loaded (it would die of an illegal instruction), whatever the
cache holds. It is written to a temporary name and renamed, so concurrent builds do not clash.
Without a compiler, with `KVPRESS_DISABLE_CPU_KERNELS=1`, or if the build fails (one warning),
callers get None and use their torch path; results agree to float rounding either way
(tests/test_cpu_kernels.py). `status()` says which it is (`kvpress info`, the engine's startup log).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from vllm_kvpress_ext.utils.flags import env_flag

DISABLE_ENV = "KVPRESS_DISABLE_CPU_KERNELS"
CACHE_ENV = "KVPRESS_KERNEL_CACHE"
ARCH_ENV = "KVPRESS_CPU_KERNEL_ARCH"
SOURCES = tuple(Path(__file__).with_name(name) for name in ("column_sums.cpp", "paged_decode.cpp"))
BASE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC")  # and -march (`compile_flags`)
LINK_FLAGS = ("-shared", "-fopenmp")  # never -ffast-math here (see the module docstring)
BUILD_TIMEOUT_S = 120
# The compiler's instruction-set macros and the /proc/cpuinfo flag each one needs. A build whose
# macros name a flag this CPU lacks is never loaded.
ISA_MACROS: dict[str, str] = {
    "__SSE4_2__": "sse4_2",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512CD__": "avx512cd",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile",
}

_build_lock = threading.Lock()
_status = "not built yet"


def target_arch() -> str:
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def compile_flags() -> tuple[str, ...]:
    return (f"-march={target_arch()}", *BASE_FLAGS)


def disabled() -> bool:
    return env_flag(DISABLE_ENV)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-kvpress-ext" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def build_isa(compiler: str, flags: tuple[str, ...]) -> list[str]:
    """The instruction-set macros (`ISA_MACROS`) that `flags` turn on, in the table's order."""
    result = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=30
    )
    defined = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    return [macro for macro in ISA_MACROS if macro in defined]


def missing_cpu_features(isa: list[str], cpu_flags: str) -> list[str]:
    """The cpuinfo flags that a build using `isa` needs and this CPU's `cpu_flags` line lacks (x86 only:
    elsewhere the table's macros are never defined)."""
    present = set(cpu_flags.split(":", 1)[-1].split())
    return [ISA_MACROS[macro] for macro in isa if ISA_MACROS[macro] not in present]


def _build(compiler: str) -> Path:
    flags = compile_flags()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    isa = build_isa(compiler, flags)
    missing = missing_cpu_features(isa, _cpu_flags())
    if missing:  # e.g. KVPRESS_CPU_KERNEL_ARCH=x86-64-v4 on an AVX2 CPU: loading it would kill the process
        raise RuntimeError(f"-march={target_arch()} needs {', '.join(missing)}, which this CPU lacks")
    parts = [*(source.read_text() for source in SOURCES), *flags, *LINK_FLAGS, version, *isa, _cpu_flags()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = cache_dir() / f"cpu_kernels-{digest[:16]}.so"
    global _status
    _status = f"on: {_isa_label(isa)} build (-march={target_arch()}, {(version.splitlines() or ['?'])[0]})"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        built = Path(scratch) / target.name
        commands = [
            [compiler, *flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects, strict=True)
        ]
        commands.append([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built)])
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _isa_label(isa: list[str]) -> str:
    if "__AVX512F__" in isa:
        return "AVX-512"
    if "__AVX2__" in isa:
        return "AVX2"
    return "+".join(macro.strip("_") for macro in isa) or "baseline ISA"


def status() -> str:
    """What the kernels are in this process: `on: AVX2 build (...)`, `off: why`, or not built yet."""
    if disabled():
        return f"off: {DISABLE_ENV} is set"
    return _status


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _status
    compiler = _compiler()
    if compiler is None:
        _status = f"off: no C++ compiler ({os.environ.get('CXX', 'c++')} not found); torch's paths are used"
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except Exception as exc:  # a broken toolchain must not take serving down: the torch path is exact too
        _status = f"off: the build failed ({str(exc)[:200]}); torch's paths are used"
        warnings.warn(f"CPU kernel build failed ({exc}); using torch's attention instead", stacklevel=3)
        return None
    column_sums = library.kvpress_column_sums
    column_sums.restype = ctypes.c_int
    column_sums.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    paged_decode = library.kvpress_paged_decode
    paged_decode.restype = ctypes.c_int
    paged_decode.argtypes = [
        *(pointer, pointer, pointer, size, size),  # query, kv, block_tables and their row / head strides
        *(pointer, size, pointer),  # seq_lens and its row stride, rows
        *(pointer, size, size, pointer),  # ring_tables and strides, ring_lens
        *(pointer, size, size, size, size, size),  # out, batch, Hq, Hkv, page_size, dim
        ctypes.c_float,
        ctypes.c_int,
    ]
    return library


def available() -> bool:
    """Whether the kernels can run here (builds them on the first call)."""
    if disabled():
        return False
    with _build_lock:
        return _library() is not None


def causal_column_sums_given_lse(
    queries: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Column sums `[Hkv, G, n]` of causal attention with known log-sum-exps; None if the kernel cannot run.

    queries `[n, Hq, d]` at positions 0..n-1, keys `[Hkv, n, d]` at the same positions, lse `[n, Hq]`
    (natural log, each query over keys 0..i). CPU tensors only; computed in float32.
    """
    if not available() or queries.device.type != "cpu" or keys.device.type != "cpu":
        return None
    library = _library()
    assert library is not None
    n, num_q_heads, dim = queries.shape
    num_kv_heads = keys.shape[0]
    if keys.shape[1] != n or lse.shape != (n, num_q_heads) or num_q_heads % num_kv_heads:
        raise ValueError(
            f"column sums need queries [n, Hq, d], keys [Hkv, n, d], lse [n, Hq] with Hkv dividing Hq; got "
            f"{tuple(queries.shape)}, {tuple(keys.shape)}, {tuple(lse.shape)}"
        )
    # The softmax folds into the operands: (scale * q, -lse) . (k, 1) = scale * q.k - lse.
    folded_queries = torch.cat([queries.float() * scale, -lse.float().unsqueeze(-1)], dim=-1)
    folded_queries = folded_queries.transpose(0, 1).contiguous()  # [Hq, n, d + 1]
    folded_keys = torch.cat([keys.float(), torch.ones(num_kv_heads, n, 1)], dim=-1).contiguous()  # [Hkv, n, d + 1]
    out = torch.empty(num_q_heads, n, dtype=torch.float32)
    status = library.kvpress_column_sums(
        folded_queries.data_ptr(),
        folded_keys.data_ptr(),
        out.data_ptr(),
        num_q_heads,
        num_kv_heads,
        n,
        dim + 1,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"kvpress_column_sums rejected its arguments (status {status})")
    return out.view(num_kv_heads, num_q_heads // num_kv_heads, n)


MAX_DECODE_GROUP, MAX_DECODE_HEAD_DIM, MAX_DECODE_PAGE_SIZE = 32, 256, 256  # paged_decode.cpp's stack buffers


def paged_decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    ring_tables: torch.Tensor | None = None,
    ring_lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`reference.paged_decode_attention`'s output (no probabilities) read straight from the pages, or
    None where the kernel cannot run: not a CPU, not float32, a shape past its buffers, or no library.

    query `[B, Hq, d]`; kv_pool `[P, 2, page_size, d]`; `block_tables[R, Hkv, P']`, `seq_lens[R, Hkv]`
    for the layer; `rows[B]`; with a ring, `ring_tables[R, Hkv, Pr]` and `ring_lens[R]`.
    """
    if not all(t.is_cpu for t in (query, kv_pool, block_tables, seq_lens, rows)):
        return None
    if query.dtype != torch.float32 or kv_pool.dtype != torch.float32:
        return None
    if not kv_pool.is_contiguous():  # the kernel addresses pages by offset; never copy a whole pool
        return None
    batch, num_q_heads, dim = query.shape
    num_kv_heads, page_size = block_tables.shape[1], kv_pool.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    if group > MAX_DECODE_GROUP or dim > MAX_DECODE_HEAD_DIM or page_size > MAX_DECODE_PAGE_SIZE:
        return None
    if not available():
        return None
    library = _library()
    assert library is not None
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    has_ring = ring_tables is not None and ring_lens is not None and ring_tables.shape[-1] > 0
    ring = ring_tables.to(torch.int32).contiguous() if has_ring and ring_tables is not None else None
    ring_count = ring_lens.to(torch.int64).contiguous() if has_ring and ring_lens is not None else None
    out = torch.empty_like(query)
    status = library.kvpress_paged_decode(
        query.data_ptr(),
        kv_pool.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        tables.stride(1),
        lens.data_ptr(),
        lens.stride(0),
        rows.data_ptr(),
        ring.data_ptr() if ring is not None else None,
        ring.stride(0) if ring is not None else 0,
        ring.stride(1) if ring is not None else 0,
        ring_count.data_ptr() if ring_count is not None else None,
        out.data_ptr(),
        batch,
        num_q_heads,
        num_kv_heads,
        page_size,
        dim,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"kvpress_paged_decode rejected its arguments (status {status})")
    return out
