"""The CPU paged-decode kernel against the torch reference, its fallbacks, and the engine with and without it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_kvpress_ext.attention import cpu_kernels, ops, reference
from vllm_kvpress_ext.engine import LLM, SamplingParams

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


def paged_cache(
    page_size: int, kv_heads: int, dim: int, max_len: int, seed: int, requests: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool with pages shuffled across requests and heads, ragged lengths (zeros and partial pages included)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (requests, kv_heads), generator=g, dtype=torch.int32)
    lens[0, 0], lens[-1, -1] = 0, max_len  # an empty head and a full one
    pages_per_head = (max_len + page_size - 1) // page_size
    num_pages = requests * kv_heads * pages_per_head + 8
    kv = torch.randn(num_pages, 2, page_size, dim, generator=g)
    order = torch.randperm(num_pages, generator=g)[: requests * kv_heads * pages_per_head]
    tables = order.view(requests, kv_heads, pages_per_head).to(torch.int32)
    positions = torch.arange(num_pages * page_size, dtype=torch.int32).view(num_pages, page_size)
    return kv, positions, tables, lens


@needs_compiler
@pytest.mark.parametrize(
    ("page_size", "kv_heads", "group", "dim", "max_len"),
    [
        (1, 1, 1, 8, 5),
        (4, 2, 3, 16, 37),
        (16, 3, 3, 64, 300),  # two blocks of 256 entries
        (16, 2, 8, 128, 129),  # two register-held column groups of 64
        (256, 1, 2, 32, 600),
        (8, 2, 4, 96, 700),  # a column group of 64 and 32 columns past it; three blocks, the last partial
        (4, 1, 7, 40, 90),  # queries in a batch of four and one of three; 40 columns, 8 past a band of 32
        (2, 2, 5, 72, 33),  # a batch of four and one of one (its band of 64 and 8 past it); an odd key count
    ],
)
@pytest.mark.parametrize("ring", [False, True])
def test_kernel_equals_the_reference(
    page_size: int, kv_heads: int, group: int, dim: int, max_len: int, ring: bool
) -> None:
    kv, positions, tables, lens = paged_cache(page_size, kv_heads, dim, max_len, seed=page_size + dim)
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([6, 0, 3, 3, 1])  # a subset, out of order, one row twice
    query = torch.randn(rows.numel(), kv_heads * group, dim, generator=g)
    ring_tables = ring_lens = None
    if ring:
        ring_pages = 3
        ring_shape = (lens.shape[0], kv_heads, ring_pages)
        ring_tables = torch.randint(0, kv.shape[0], ring_shape, generator=g, dtype=torch.int32)
        ring_lens = torch.randint(0, ring_pages * page_size + 1, (lens.shape[0],), generator=g)
        ring_lens[0] = 0
    scale = dim**-0.5
    expected = reference.paged_decode_attention(query, kv, positions, tables, lens, rows, scale, ring_tables, ring_lens)
    got = cpu_kernels.paged_decode_attention(query, kv, tables, lens, rows, scale, ring_tables, ring_lens)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if not ring:
        assert torch.equal(got[1, :group], torch.zeros(group, dim))  # row 0, head 0 holds nothing: zeros


@needs_compiler
def test_kernel_declines_what_it_does_not_serve() -> None:
    kv, _, tables, lens = paged_cache(4, 2, 16, 20, seed=3)
    query, rows = torch.randn(2, 4, 16), torch.tensor([0, 1])
    assert cpu_kernels.paged_decode_attention(query.half(), kv.half(), tables, lens, rows, 0.25) is None
    wide = torch.randn(2, 2 * (cpu_kernels.MAX_DECODE_GROUP + 1), 16)
    assert cpu_kernels.paged_decode_attention(wide, kv, tables, lens, rows, 0.25) is None
    strided = torch.randn(kv.shape[0], 2, 4, 32)[..., ::2]  # not contiguous: never copied, declined
    assert cpu_kernels.paged_decode_attention(query, strided, tables, lens, rows, 0.25) is None
    with pytest.raises(ValueError, match="do not divide"):
        cpu_kernels.paged_decode_attention(torch.randn(2, 3, 16), kv, tables, lens, rows, 0.25)


@needs_compiler
def test_ops_runs_the_kernel_unless_disabled_or_probabilities_are_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, positions, tables, lens = paged_cache(4, 2, 16, 40, seed=4)
    query, rows = torch.randn(3, 4, 16), torch.tensor([2, 4, 5])
    calls: list[str] = []
    kernel = cpu_kernels.paged_decode_attention

    def counted(*args: torch.Tensor) -> torch.Tensor | None:
        calls.append("kernel")
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", counted)
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)
    with_kernel = ops.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.25)
    probs: list[torch.Tensor] = []
    with_probs = ops.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.25, probs_out=probs)
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    disabled = ops.paged_decode_attention(query, kv, positions, tables, lens, rows, 0.25)
    assert calls == ["kernel", "kernel"]  # the probabilities' call never asked it; the disabled one got None
    assert len(probs) == 1
    torch.testing.assert_close(with_kernel, with_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_kernel, disabled, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("policy", ["full", "snapkv", "wgkv"])
def test_engine_generates_the_same_tokens_with_and_without_the_kernel(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decoding through the engine, compressed heads and WG-KV's ring included, is unchanged by the kernel."""
    from model_utils import write_suite_model

    from vllm_kvpress_ext.models import load_config
    from vllm_kvpress_ext.models.write_gate import WriteGates

    model = write_suite_model(tmp_path / "model", std=0.3)
    spec: str | dict[str, Any] = policy
    if policy == "snapkv":
        spec = {"name": "snapkv", "ratio": 0.4}
    if policy == "wgkv":
        config = load_config(model)
        torch.manual_seed(0)
        gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        spec = {"name": "wgkv", "gates": str(gates.save(tmp_path / "gates.pt", {"local_window": 8}))}
    llm = LLM(model, dtype=torch.float32, num_pages=512, page_size=4)
    prompts = [list(range(10, 10 + n)) for n in (30, 57, 91)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [out.output_token_ids for out in llm.generate(prompts, params, policy=spec)]

    served: list[tuple[bool, bool]] = []  # per kernel call: did it run, and with a ring?
    kernel = cpu_kernels.paged_decode_attention

    def counted(*args: object) -> torch.Tensor | None:
        out = kernel(*args)  # type: ignore[arg-type]
        served.append((out is not None, args[6] is not None))
        return out

    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", counted)
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)
    with_kernel = tokens()
    assert served and all(ran for ran, _ in served)
    assert any(ring for _, ring in served) == (policy == "wgkv")
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    assert tokens() == with_kernel
