"""Weights and the KV pool on 2 MB pages: same values, one arena, and the switch that turns it off."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vllm_kvpress_ext.utils import huge_pages
from vllm_kvpress_ext.utils.huge_pages import HUGE_PAGE_BYTES, huge_page_span, huge_page_tensor, move_to_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_huge_page_span_is_the_aligned_inside() -> None:
    two_mb = HUGE_PAGE_BYTES
    assert huge_page_span(0, 3 * two_mb) == (0, 3 * two_mb)
    assert huge_page_span(1, 3 * two_mb) == (two_mb, 2 * two_mb)  # the partial first and last are left out
    assert huge_page_span(two_mb - 1, two_mb + 1) == (two_mb, two_mb)  # ends exactly on a boundary
    assert huge_page_span(5, two_mb)[1] == 0  # smaller than one aligned huge page


def test_huge_page_tensor_is_zeros() -> None:
    tensor = huge_page_tensor((3, 2, 16, 8), torch.float16)
    assert tensor.shape == (3, 2, 16, 8) and tensor.dtype == torch.float16 and tensor.is_cpu
    assert not tensor.any()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1536), nn.LayerNorm(1536), nn.Linear(1536, 700, bias=False))  # ~12 MB


def test_move_keeps_every_value_in_one_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.DISABLE_ENV, raising=False)
    if huge_pages._madvise() is None:
        pytest.skip("no madvise here")
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(5, 1024)
    expected = model(x)
    assert move_to_huge_pages(model) > 0
    params = list(model.parameters())
    assert all(isinstance(p, nn.Parameter) for p in params)
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1  # one arena
    assert params[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_move_is_off_when_disabled_or_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "1")
    model = _model()
    pointers = [p.data_ptr() for p in model.parameters()]
    assert move_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers
    monkeypatch.delenv(huge_pages.DISABLE_ENV)
    assert move_to_huge_pages(nn.Linear(8, 8)) == 0  # under two huge pages: not worth an arena


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="transparent huge pages unavailable",
)
def test_the_pool_is_faulted_in_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.DISABLE_ENV, raising=False)
    tensor = huge_page_tensor((8 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 16 MB
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * 4
    huge_kb = 0
    overlaps = False
    for line in Path("/proc/self/smaps").read_text().splitlines():  # the advice splits the mapping: sum them
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            low, high = (int(v, 16) for v in head.groups())
            overlaps = low < end and start < high
        elif overlaps and line.startswith("AnonHugePages:"):
            huge_kb += int(line.split()[1])
    assert huge_kb >= 4 * HUGE_PAGE_BYTES // 1024  # at least half of it, whatever the alignment
