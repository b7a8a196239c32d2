"""`PagedKVCache` with sliding-window layers: each holds a ring of exactly its window, and nothing else moves.

Layer 0 slides over a window of 8, layer 1 is global, pages hold 4 entries. Every key written is its token's
position, so reading a head back says which token each entry holds.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvpress_ext.cache import InvalidPlanError, KeepPlan, PagedKVCache

WINDOW = 8
PAGE = 4
HEADS = 2
DIM = 4


def sliding_cache(num_pages: int = 64) -> PagedKVCache:
    return PagedKVCache(
        2, HEADS, DIM, num_pages, page_size=PAGE, max_requests=4, dtype=torch.float32, layer_windows=[WINDOW, None]
    )


def append(cache: PagedKVCache, request_id: str, first: int, count: int) -> None:
    """Append tokens first .. first + count - 1 to every layer; each key and value is the token's position."""
    row = cache.row_of(request_id)
    positions = torch.arange(first, first + count).view(1, -1)
    slots = cache.append_slots([row], positions)  # [L, 1, H, n]
    values = positions.view(1, 1, 1, -1, 1).expand(2, 1, HEADS, count, DIM).float()
    cache.write(slots, values, values)


def held(cache: PagedKVCache, request_id: str, layer: int, head: int = 0) -> list[int]:
    """Sorted positions one head holds, after checking each entry's key is its own position's."""
    keys, values, positions = cache.gather(request_id, layer, head)
    assert torch.equal(keys[:, 0], positions.float()) and torch.equal(values[:, 0], positions.float())
    return sorted(positions.tolist())


@pytest.mark.parametrize("chunks", [[1] * 30, [3] * 10, [20, 1, 1, 9], [5, 13, 2], [30]])
def test_a_sliding_layer_holds_exactly_its_last_window(chunks: list[int]) -> None:
    cache = sliding_cache()
    cache.add_request("a")
    written = 0
    for count in chunks:
        expected_pages = cache.pages_needed_to_append(torch.tensor([cache.row_of("a")]), count)
        used = cache.pool.num_used
        append(cache, "a", written, count)
        written += count
        assert cache.pool.num_used - used == expected_pages
        for head in range(HEADS):
            assert held(cache, "a", 0, head) == list(range(max(0, written - WINDOW), written))
            assert held(cache, "a", 1, head) == list(range(written))
    assert cache.pool.num_used == HEADS * (WINDOW // PAGE + -(-written // PAGE))
    cache.free_request("a")
    assert cache.pool.num_used == 0


@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_a_row_on_a_prefixs_block_pages_rebuilds_its_ring_from_the_last_window(blocks: int) -> None:
    """Block b's pages in every layer (the sliding layer's written whole elsewhere): the new row's global layer
    holds every block, its ring only the last window's, each at ring page `b % (window / page)`; appending on
    from there keeps the ring exact and leaves the shared pages as they were (copy-on-write)."""
    cache = sliding_cache()
    pages = cache.pool.allocate(2 * HEADS * blocks).view(2, HEADS, blocks)
    for block in range(blocks):
        positions = torch.arange(block * PAGE, (block + 1) * PAGE)
        slots = pages[:, :, block, None] * PAGE + positions % PAGE  # [L, H, page]
        values = positions.view(1, 1, -1, 1).expand(2, HEADS, PAGE, DIM).float()
        cache.write(slots, values, values)
        cache.pool.positions.view(-1)[slots.reshape(-1)] = positions.repeat(2 * HEADS).to(torch.int32)
    before = cache.pool.kv.clone()
    cache.add_request_on_pages("a", pages)
    written = blocks * PAGE
    for head in range(HEADS):
        assert held(cache, "a", 0, head) == list(range(max(0, written - WINDOW), written))
        assert held(cache, "a", 1, head) == list(range(written))
    append(cache, "a", written, 6)
    for head in range(HEADS):
        assert held(cache, "a", 0, head) == list(range(written + 6 - WINDOW, written + 6))
    assert torch.equal(cache.pool.kv[pages.reshape(-1)], before[pages.reshape(-1)])
    cache.free_request("a")
    cache.pool.free(pages.reshape(-1))
    assert cache.pool.num_used == 0


def test_a_ring_that_is_not_whole_pages_cannot_start_on_a_prefix() -> None:
    cache = PagedKVCache(2, HEADS, DIM, 64, page_size=PAGE, dtype=torch.float32, layer_windows=[WINDOW - 1, None])
    pages = cache.pool.allocate(2 * HEADS).view(2, HEADS, 1)
    with pytest.raises(ValueError, match="window of 7 tokens is not whole pages of 4"):
        cache.add_request_on_pages("a", pages)
    assert cache.num_requests == 0


def test_pages_for_a_prompt_count_a_sliding_layer_up_to_its_window() -> None:
    cache = sliding_cache()
    assert cache.pages_for_prompt(6) == HEADS * (2 + 2)
    assert cache.pages_for_prompt(100) == HEADS * (WINDOW // PAGE + 25)


def test_a_fork_writes_its_own_copy_of_the_ring() -> None:
    cache = sliding_cache()
    cache.add_request("parent")
    append(cache, "parent", 0, 11)
    cache.fork_request("parent", "child")
    append(cache, "child", 11, 3)
    assert held(cache, "parent", 0) == list(range(3, 11))
    assert held(cache, "child", 0) == list(range(6, 14))
    append(cache, "parent", 11, 1)
    assert held(cache, "parent", 0) == list(range(4, 12))
    assert held(cache, "child", 0) == list(range(6, 14))
    cache.free_request("parent")
    cache.free_request("child")
    assert cache.pool.num_used == 0


def test_a_fork_that_cannot_copy_its_ring_pages_changes_nothing() -> None:
    cache = sliding_cache(num_pages=2 * HEADS + 3 * HEADS)  # the parent's pages exactly: nothing to copy into
    cache.add_request("parent")
    append(cache, "parent", 0, 12)
    cache.fork_request("parent", "child")
    with pytest.raises(Exception, match="pages"):
        append(cache, "child", 12, 1)
    assert held(cache, "child", 0) == list(range(4, 12)) and held(cache, "parent", 0) == list(range(4, 12))


def test_cutting_back_a_row_is_refused_once_its_ring_has_wrapped() -> None:
    cache = sliding_cache()
    cache.add_request("short")
    append(cache, "short", 0, 7)
    cache.truncate_request("short", 5)  # nothing replaced yet: the ring is the prefix, in order
    assert held(cache, "short", 0) == list(range(5)) and held(cache, "short", 1) == list(range(5))
    cache.add_request("long")
    append(cache, "long", 0, 12)
    with pytest.raises(InvalidPlanError, match="older than its window"):
        cache.truncate_request("long", 10)
    assert held(cache, "long", 0) == list(range(4, 12))


def test_no_plan_or_eviction_reaches_a_sliding_layer() -> None:
    cache = sliding_cache()
    cache.add_request("a")
    append(cache, "a", 0, 10)
    keep = torch.ones(2, HEADS, 10, dtype=torch.bool)
    with pytest.raises(InvalidPlanError, match="sliding-window layer"):
        cache.apply_keep_plan("a", KeepPlan.from_mask(keep))
    with pytest.raises(InvalidPlanError, match="sliding-window layer"):
        cache.evict([0], [0], [0], [1])
    cache.apply_keep_plan("a", KeepPlan.from_mask(keep[1:, :, :10].clone()), layers=[1])  # the global layer: fine
    cache.evict([0], [1], [0], [1])
    assert held(cache, "a", 0) == list(range(2, 10))


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_windows"):
        PagedKVCache(2, 1, 4, 8, layer_windows=[0, None])
    with pytest.raises(ValueError, match="layer_windows"):
        PagedKVCache(2, 1, 4, 8, layer_windows=[4])
