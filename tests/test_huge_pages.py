"""Weights and the KV pool on 2 MB pages: same values, one arena, and the switch that turns it off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from vllm_kvpress_ext.engine.host_allocator import tune_host_allocator
from vllm_kvpress_ext.utils import huge_pages
from vllm_kvpress_ext.utils.huge_pages import (
    HUGE_PAGE_BYTES,
    huge_page_placement,
    huge_page_span,
    huge_page_tensor,
    move_to_huge_pages,
)


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
    arena = move_to_huge_pages(model)
    assert arena is not None and arena.numel() >= sum(p.numel() * 4 for p in model.parameters())
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
    assert move_to_huge_pages(model) is None
    assert [p.data_ptr() for p in model.parameters()] == pointers
    monkeypatch.delenv(huge_pages.DISABLE_ENV)
    assert move_to_huge_pages(nn.Linear(8, 8)) is None  # under two huge pages: not worth an arena


def _smaps_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), read here independently of the module."""
    huge_kb = 0
    overlaps = False
    for line in Path("/proc/self/smaps").read_text().splitlines():  # the advice splits the mapping: sum them
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            low, high = (int(v, 16) for v in head.groups())
            overlaps = low < end and start < high
        elif overlaps and line.startswith("AnonHugePages:"):
            huge_kb += int(line.split()[1])
    return huge_kb * 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
def test_the_pool_is_on_huge_pages_or_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the environment permits: with THP in `always` or `madvise` mode the pool is faulted in on 2 MB
    pages, or its placement says why not (the kernel found no free 2 MB blocks, THP off for the process);
    the figure it reports is what smaps says, and a reason is given exactly when some of it is not huge."""
    monkeypatch.delenv(huge_pages.DISABLE_ENV, raising=False)
    tune_host_allocator()  # as in the engine: malloc would serve 16 MB from its heap, maybe from touched pages
    plenty_free = (huge_pages.free_huge_blocks() or 0) >= 1024  # 2 GB in free 2 MB blocks: no excuse
    tensor = huge_page_tensor((8 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 16 MB
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0  # a mapping of its own, aligned: the whole of it can be huge
    placement = huge_page_placement(tensor)
    assert placement.span_bytes == 8 * HUGE_PAGE_BYTES
    assert placement.huge_bytes == _smaps_huge_bytes(tensor.data_ptr(), tensor.data_ptr() + 8 * HUGE_PAGE_BYTES)
    assert placement.all_huge == (placement.huge_bytes == placement.span_bytes)
    assert (placement.reason is None) == placement.all_huge
    mode = huge_pages.thp_mode()
    if mode in ("always", "madvise") and not placement.all_huge:
        assert placement.reason is not None
        assert not plenty_free or "turned off for this process" in placement.reason, placement.reason
        assert "too few free 2 MB blocks" in placement.reason or "turned off for this process" in placement.reason
        assert f"defrag: {huge_pages.thp_defrag()}" in placement.reason or "prctl" in placement.reason
    elif mode in (None, "never"):
        assert (
            not placement.huge_bytes and placement.reason is not None and "transparent huge pages" in placement.reason
        )
    assert "MiB on 2 MB pages" in placement.describe()


def test_placement_names_the_switch_and_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "1")
    tensor = huge_page_tensor((4 * HUGE_PAGE_BYTES // 4,), torch.float32)
    placement = huge_page_placement(tensor)
    # The switch stops the advice, not the allocator: heap memory this process already faulted in on 2 MB pages
    # (after an earlier test's model arena, say) may back the plain allocation anyway. Where it does not, the
    # reason names the switch.
    assert placement.all_huge or placement.reason == f"{huge_pages.DISABLE_ENV} is set"
    assert huge_pages._advised_bytes(4 * HUGE_PAGE_BYTES) is None  # nothing is advised while it is set
    monkeypatch.delenv(huge_pages.DISABLE_ENV)
    small = huge_page_placement(torch.zeros(1000))
    assert small.span_bytes == 0 and small.reason == "smaller than one aligned 2 MB page"


def test_placement_reads_a_kernel_without_thp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(huge_pages.DISABLE_ENV, raising=False)
    monkeypatch.setattr(huge_pages, "resident_huge_bytes", lambda address, size: 0)
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda start, length, advice: 0)
    monkeypatch.setattr(huge_pages, "THP_DIR", tmp_path / "missing")
    tensor = torch.zeros(4 * HUGE_PAGE_BYTES // 4 + HUGE_PAGE_BYTES)  # some 2 MB-aligned part whatever the address
    assert "has no transparent huge pages" in str(huge_page_placement(tensor).reason)
    settings = tmp_path / "thp"
    settings.mkdir()
    (settings / "enabled").write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_DIR", settings)
    assert "off (" in str(huge_page_placement(tensor).reason)
    (settings / "enabled").write_text("always [madvise] never\n")
    (settings / "defrag").write_text("always defer defer+madvise madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_thp_disabled_for_process", lambda: False)
    assert "too few free 2 MB blocks" in str(huge_page_placement(tensor).reason) and "defrag: never" in str(
        huge_page_placement(tensor).reason
    )
