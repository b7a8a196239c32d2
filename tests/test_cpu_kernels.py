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
