"""The block-sparse CPU vertical-slash attention against the reference's dense masked call."""

from __future__ import annotations

import pytest
import torch

from vllm_kvpress_ext.attention import ops, reference
from vllm_kvpress_ext.attention.block_sparse import vertical_slash_attention_blocks


def _inputs(n: int, heads: int, group: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads * group, head_dim, generator=gen)
    k = torch.randn(n, heads, head_dim, generator=gen)
    v = torch.randn(n, heads, head_dim, generator=gen)
    return q, k, v


def _admission(pattern: str, heads: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    if pattern == "all":
        return torch.ones(heads, n, dtype=torch.bool)
    if pattern == "none":
        return torch.zeros(heads, n, dtype=torch.bool)
    admitted = torch.rand(heads, n, generator=gen) < 0.2
    admitted[0, : n // 2] = False  # heads with very different admitted counts: padded far keys
    admitted[-1, n // 3 :] = True
    return admitted


@pytest.mark.parametrize("pattern", ["all", "none", "random"])
@pytest.mark.parametrize(("window", "block_size"), [(1, 16), (7, 16), (7, 5), (40, 16), (300, 64), (7, 1000)])
@pytest.mark.parametrize("group", [1, 3])
def test_block_sparse_equals_the_dense_mask(pattern: str, window: int, block_size: int, group: int) -> None:
    n, heads = 203, 3
    q, k, v = _inputs(n, heads, group, 32, seed=window + group)
    admitted = _admission(pattern, heads, n)
    expected = reference.vertical_slash_attention(q, k, v, admitted, window, 0.2)
    out = vertical_slash_attention_blocks(q, k, v, admitted, window, 0.2, block_size=block_size)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_start", [1, 64, 150])
def test_block_sparse_later_chunk(query_start: int) -> None:
    """A chunk at `query_start` over the whole prefix, as later prefill chunks call it."""
    n, heads = 190, 2
    q, k, v = _inputs(n, heads, 4, 16, seed=query_start)
    admitted = _admission("random", heads, n)
    expected = reference.vertical_slash_attention(q[query_start:], k, v, admitted, 9, 0.25, query_start=query_start)
    out = vertical_slash_attention_blocks(q[query_start:], k, v, admitted, 9, 0.25, query_start, block_size=32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_sparse_keeps_half_precision_inputs_dtype() -> None:
    q, k, v = (x.to(torch.bfloat16) for x in _inputs(100, 2, 2, 16, seed=1))
    admitted = _admission("random", 2, 100)
    out = vertical_slash_attention_blocks(q, k, v, admitted, 8, 0.25, block_size=32)
    assert out.dtype == torch.bfloat16
    expected = reference.vertical_slash_attention(q, k, v, admitted, 8, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("window", "block_size", "admitted_shape", "query_start", "message"),
    [
        (0, 16, (2, 40), 0, "window"),
        (4, 0, (2, 40), 0, "block_size"),
        (4, 16, (2, 39), 0, "admitted"),
        (4, 16, (2, 40), 3, "keys must cover"),
    ],
)
def test_block_sparse_rejects_bad_arguments(
    window: int, block_size: int, admitted_shape: tuple[int, int], query_start: int, message: str
) -> None:
    q, k, v = _inputs(40, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match=message):
        vertical_slash_attention_blocks(
            q, k, v, torch.ones(admitted_shape, dtype=torch.bool), window, 1.0, query_start, block_size
        )


def test_cpu_dispatch_runs_block_sparse_and_the_oracle_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(ops, "vertical_slash_attention_blocks", lambda *a, **k: calls.append("blocks"))
    monkeypatch.setattr(reference, "vertical_slash_attention", lambda *a, **k: calls.append("oracle"))
    q, k, v = _inputs(10, 1, 1, 8, seed=0)
    admitted = torch.ones(1, 10, dtype=torch.bool)
    monkeypatch.delenv(ops.PREFILL_ORACLE_ENV, raising=False)
    ops.vertical_slash_attention(q, k, v, admitted, 2, 1.0)
    monkeypatch.setenv(ops.PREFILL_ORACLE_ENV, "1")
    ops.vertical_slash_attention(q, k, v, admitted, 2, 1.0)
    assert calls == ["blocks", "oracle"]
