"""The CPU column-sum kernel equals the dense computation, builds once, and its absence changes no result."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_kvpress_ext.attention import cpu_kernels
from vllm_kvpress_ext.attention.reference import causal_attention, causal_attention_with_lse
from vllm_kvpress_ext.engine import LLM, SamplingParams
from vllm_kvpress_ext.policies import h2o as h2o_module

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and no library loaded yet; the loaded one is dropped again afterwards."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    cpu_kernels._library.cache_clear()
    yield tmp_path
    cpu_kernels._library.cache_clear()


def problem(n: int, kv_heads: int, group: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(n, kv_heads * group, dim, generator=g) * 2
    keys = torch.randn(kv_heads, n, dim, generator=g) * 2
    dense = h2o_module.dense_column_sums(queries, torch.arange(n), keys, torch.arange(n), dim**-0.5)
    return queries, keys, dense


def log_sum_exps(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`[n, Hq]` natural-log log-sum-exp of each query's causal attention, the slow way."""
    n, num_q_heads, dim = queries.shape
    k = keys.repeat_interleave(num_q_heads // keys.shape[0], dim=0)  # [Hq, n, d]
    logits = torch.einsum("qhd,hkd->hqk", queries, k) * dim**-0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.logsumexp(logits.masked_fill(~causal, float("-inf")), dim=-1).T


@needs_compiler
@pytest.mark.parametrize(
    ("n", "kv_heads", "group", "dim"),
    [(1, 1, 1, 8), (63, 2, 4, 16), (64, 1, 2, 32), (65, 2, 3, 32), (300, 3, 1, 64), (517, 2, 4, 128)],
)
def test_kernel_equals_the_dense_column_sums(n: int, kv_heads: int, group: int, dim: int) -> None:
    queries, keys, dense = problem(n, kv_heads, group, dim, seed=n + dim)
    got = cpu_kernels.causal_column_sums_given_lse(queries, keys, log_sum_exps(queries, keys), dim**-0.5)
    assert got is not None
    torch.testing.assert_close(got, dense, rtol=5e-5, atol=1e-5)


@needs_compiler
def test_kernel_builds_once_per_cache(fresh_build: Path) -> None:
    assert cpu_kernels.available()
    (library,) = fresh_build.glob("cpu_kernels-*.so")
    built_at = library.stat().st_mtime_ns
    cpu_kernels._library.cache_clear()
    assert cpu_kernels.available()  # a new process (here: a cleared cache) loads the same file
    assert [p.stat().st_mtime_ns for p in fresh_build.glob("cpu_kernels-*.so")] == [built_at]
    assert not [p for p in fresh_build.iterdir() if p.is_dir()]  # no build scratch left behind


@needs_compiler
def test_loading_the_kernel_leaves_the_process_floats_alone(fresh_build: Path) -> None:
    """Subnormals survive: a library linked with -ffast-math would switch on flush-to-zero process-wide."""
    import subprocess
    import sys

    script = (
        "import sys; from vllm_kvpress_ext.attention import cpu_kernels; "
        "assert cpu_kernels.available(); print(sys.float_info.min / 2 > 0)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def test_a_failed_build_warns_once_and_falls_back(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    queries, keys, dense = problem(70, 2, 2, 16, seed=1)
    with pytest.warns(UserWarning, match="CPU kernel build failed"):
        assert not cpu_kernels.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert cpu_kernels.causal_column_sums_given_lse(queries, keys, log_sum_exps(queries, keys), 0.25) is None
        torch.testing.assert_close(h2o_module.causal_column_sums(queries, keys, 16**-0.5), dense, rtol=5e-5, atol=1e-5)


@needs_compiler
def test_a_build_for_an_isa_this_cpu_lacks_is_never_loaded(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX2 (its cpuinfo flags say so) is never handed the AVX2 or AVX-512 code that
    `-march=native` or a shared cache would give it: no library is built or loaded, and the torch path serves."""
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    if "__AVX2__" not in cpu_kernels.build_isa(compiler, cpu_kernels.compile_flags()):
        pytest.skip("this machine's native build uses no AVX2")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2")
    with pytest.warns(UserWarning, match="which this CPU lacks"):
        assert not cpu_kernels.available()
    assert "avx2" in cpu_kernels.status() and cpu_kernels.status().startswith("off: the build failed")
    assert not list(fresh_build.glob("cpu_kernels-*.so"))


@needs_compiler
def test_the_cache_names_the_build_by_cpu_and_isa(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CPUs, or two instruction sets, never share a cached library: each gets a file of its own."""
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    real_flags = cpu_kernels._cpu_flags()
    names = set()
    for flags, arch in ((real_flags, ""), (real_flags + " another_feature", ""), (real_flags, "x86-64-v2")):
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setenv(cpu_kernels.ARCH_ENV, arch)
        names.add(cpu_kernels._build(compiler).name)
    assert len(names) == 3 and len(list(fresh_build.glob("cpu_kernels-*.so"))) == 3


def test_missing_cpu_features_reads_the_flags_line() -> None:
    line = "flags\t\t: fpu sse2 avx avx2 fma"
    assert cpu_kernels.missing_cpu_features(["__AVX2__", "__FMA__"], line) == []
    assert cpu_kernels.missing_cpu_features(["__AVX2__", "__AVX512F__", "__AVX512BW__"], line) == [
        "avx512f",
        "avx512bw",
    ]


@needs_compiler
def test_the_arch_switch_builds_avx2_code(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVPRESS_CPU_KERNEL_ARCH=x86-64-v3` (what CI's AVX2 pass sets) gives AVX2 code without AVX-512, and
    it computes what the native build does."""
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    import platform

    if platform.machine() != "x86_64" or "avx2" not in cpu_kernels._cpu_flags().split():
        pytest.skip("x86-64 with AVX2 only")
    monkeypatch.setenv(cpu_kernels.ARCH_ENV, "x86-64-v3")
    isa = cpu_kernels.build_isa(compiler, cpu_kernels.compile_flags())
    assert "__AVX2__" in isa and "__FMA__" in isa and "__AVX512F__" not in isa
    queries, keys, dense = problem(300, 3, 2, 64, seed=4)
    got = cpu_kernels.causal_column_sums_given_lse(queries, keys, log_sum_exps(queries, keys), 64**-0.5)
    assert got is not None and cpu_kernels.status().startswith("on: AVX2 build (-march=x86-64-v3")
    torch.testing.assert_close(got, dense, rtol=5e-5, atol=1e-5)


@pytest.mark.parametrize("given_lse", [True, False])
def test_disabled_kernel_gives_the_same_sums(given_lse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    queries, keys, dense = problem(200, 2, 4, 16, seed=2)
    lse = log_sum_exps(queries, keys) if given_lse else None
    assert cpu_kernels.causal_column_sums_given_lse(queries, keys, log_sum_exps(queries, keys), 0.25) is None
    torch.testing.assert_close(h2o_module.causal_column_sums(queries, keys, 16**-0.5, lse), dense, rtol=5e-5, atol=1e-5)


@needs_compiler
def test_kernel_rejects_mismatched_shapes() -> None:
    queries, keys, _ = problem(10, 2, 2, 8, seed=3)
    with pytest.raises(ValueError, match=r"lse \[n, Hq\]"):
        cpu_kernels.causal_column_sums_given_lse(queries, keys, torch.zeros(10, 3), 0.25)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        cpu_kernels.causal_column_sums_given_lse(queries, keys[:1].expand(3, 10, 8), torch.zeros(10, 4), 0.25)


def test_attention_with_lse_equals_sdpa_and_the_dense_lse() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 50, 6, 16, generator=g), torch.randn(1, 50, 2, 16, generator=g), torch.randn(1, 50, 2, 16)
    out, lse = causal_attention_with_lse(q, k, v, 16**-0.5)
    torch.testing.assert_close(out, causal_attention(q, k, v, 16**-0.5), rtol=1e-5, atol=1e-5)
    assert lse is not None and lse.shape == (1, 50, 6)
    torch.testing.assert_close(lse[0], log_sum_exps(q[0], k[0].transpose(0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1000, 24])
def test_h2o_keeps_the_same_entries_with_and_without_the_kernel(
    chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine (whole and chunked prefill): the prefill's log-sum-exps and the kernel change no plan."""
    from model_utils import write_suite_model

    model = write_suite_model(tmp_path, std=0.3)
    llm = LLM(model, dtype=torch.float32, num_pages=512, page_size=4, max_num_batched_tokens=chunk)
    prompts = [list(range(10, 10 + n)) for n in (70, 97)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_kept=True)

    def kept() -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        outs = llm.generate(prompts, params, policy={"name": "h2o", "ratio": 0.3})
        held = []
        for out in outs:
            assert out.kv.kept_at_compression is not None and out.kv.kept is not None
            held.append((out.output_token_ids, out.kv.kept_at_compression.positions, out.kv.kept.positions))
        return held

    fast = kept()
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    monkeypatch.setattr(h2o_module.H2OPolicy, "capture_spec", lambda self: h2o_module.CaptureSpec(window=1 << 62))
    slow = kept()  # no log-sum-exps captured, no kernel: two flash passes
    for (tokens, at_compression, at_end), (slow_tokens, slow_at_compression, slow_at_end) in zip(
        fast, slow, strict=True
    ):
        assert tokens == slow_tokens
        assert torch.equal(at_compression, slow_at_compression) and torch.equal(at_end, slow_at_end)
        assert int((at_compression >= 0).sum(-1).max()) < 70  # it did drop entries
