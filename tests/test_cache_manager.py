"""Exact, hand-derived checks of the paged cache's bookkeeping: slots, block tables, free lists,
rings, compaction and eviction on tiny caches whose every page id can be worked out on paper.

A fresh pool's free stack is [N-1, ..., 1, 0] with its top at the end: one allocation of n pages
returns [n-1, ..., 1, 0], the next continues from n, and freed pages are pushed in the order given,
so the next allocation of k pages returns the last k pushed, in push order.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvpress_ext.cache import (
    InvalidPlanError,
    KeepPlan,
    PagedKVCache,
    PagePool,
    PoolExhaustedError,
    RequestCapacityError,
)


def cache_of(layers: int, heads: int, *, pages: int, page_size: int = 2, rows: int = 2, width: int = 1) -> PagedKVCache:
    return PagedKVCache(
        layers,
        heads,
        4,
        num_pages=pages,
        page_size=page_size,
        max_requests=rows,
        dtype=torch.float32,
        initial_pages_per_head=width,
    )


def prefill(cache: PagedKVCache, request_id: str, length: int) -> int:
    """Add a request with positions 0..length-1; key[0] of every entry is its position, value = -key."""
    row = cache.add_request(request_id)
    slots = cache.append_slots([row], torch.arange(length).view(1, -1))
    keys = torch.arange(length, dtype=torch.float32).view(1, 1, 1, -1, 1).expand(*slots.shape, 4)
    cache.write(slots, keys, -keys)
    return row


def global_positions(cache: PagedKVCache, request_id: str) -> list[list[list[int]]]:
    """Stored positions of every global entry, per (layer, head), in storage order; keys must agree."""
    out = []
    for layer in range(cache.num_layers):
        per_head = []
        for head in range(cache.num_kv_heads):
            keys, values, positions = cache.gather(request_id, layer, head)
            assert keys[:, 0].to(torch.int64).tolist() == positions.tolist()
            assert torch.equal(values, -keys)
            per_head.append(positions.tolist())
        out.append(per_head)
    return out


def state(cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
    return (
        cache.block_tables.clone(),
        cache.seq_lens.clone(),
        cache.rings.tables.clone(),
        cache.rings.flags.clone(),
        cache.rings.window.clone(),
        cache.rings.count.clone(),
        cache.pool.in_use_mask(),
        torch.tensor(cache.pool.num_free),
        cache.pool.positions.clone(),
        cache.pool.kv.clone(),
    )


def unchanged(before: tuple[torch.Tensor, ...], cache: PagedKVCache) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, state(cache), strict=True))


def assert_consistent(cache: PagedKVCache) -> None:
    """No page leaked or shared: pages in the tables are exactly the pool's in-use pages."""
    ps = cache.page_size
    held = torch.arange(cache.block_tables.shape[-1]) < ((cache.seq_lens.to(torch.int64) + ps - 1) // ps).unsqueeze(-1)
    assert bool((cache.block_tables[held] >= 0).all()) and bool((cache.block_tables[~held] == -1).all())
    pages = torch.cat([cache.block_tables[held], cache.rings.tables[cache.rings.tables >= 0]]).to(torch.int64)
    assert pages.numel() == torch.unique(pages).numel()
    in_use = cache.pool.in_use_mask()
    assert int(in_use.sum()) == pages.numel() == cache.pool.num_used
    assert bool(in_use[pages].all())
    assert cache.pool.num_used + cache.pool.num_free == cache.pool.num_pages


# ------------------------------------------------------------------------------------------ page pool


def test_pool_starts_empty_and_hands_out_pages_last_in_first_out() -> None:
    pool = PagePool(6, page_size=2, head_dim=3, dtype=torch.float32)
    assert pool.kv.shape == (6, 2, 2, 3) and pool.kv.dtype == torch.float32 and not bool(pool.kv.any())
    assert pool.positions.shape == (6, 2) and pool.positions.dtype == torch.int32
    assert bool((pool.positions == -1).all())
    assert pool.device == torch.device("cpu") and pool.kv.device.type == "cpu"
    assert (pool.num_pages, pool.page_size, pool.head_dim, pool.dtype) == (6, 2, 3, torch.float32)
    assert pool.num_free == 6 and pool.num_used == 0 and not bool(pool.in_use_mask().any())
    assert pool.bytes_per_page == 2 * 2 * 3 * 4
    assert pool.allocate(0).tolist() == [] and pool.num_free == 6
    first = pool.allocate(2)
    assert first.tolist() == [1, 0] and first.dtype == torch.int64
    assert pool.allocate(3).tolist() == [4, 3, 2]
    assert pool.num_free == 1 and pool.num_used == 5
    assert pool.in_use_mask().tolist() == [True, True, True, True, True, False]
    assert pool.in_use_mask().dtype == torch.bool
    assert torch.arange(6)[~pool.in_use_mask()].tolist() == [5]
    pool.free(torch.tensor([3, 0], dtype=torch.int32))
    assert pool.num_free == 3 and pool.num_used == 3
    assert pool.in_use_mask().tolist() == [False, True, True, False, True, False]
    assert pool.allocate(1).tolist() == [0]
    assert pool.allocate(2).tolist() == [5, 3]
    pool.free(torch.tensor([[1, 2], [4, 5]]))
    assert pool.num_free == 4 and pool.in_use_mask().tolist() == [True, False, False, True, False, False]
    # The whole free list at once, then nothing left.
    assert pool.allocate(4).tolist() == [1, 2, 4, 5]
    assert pool.num_free == 0 and bool(pool.in_use_mask().all())
    mask = pool.in_use_mask()
    mask[:] = False
    assert bool(pool.in_use_mask().all()), "in_use_mask is a copy"


def test_pool_refuses_bad_sizes_and_accepts_the_smallest() -> None:
    for kwargs, message in (
        ({"num_pages": 0}, "num_pages must be positive, got 0"),
        ({"num_pages": 1, "page_size": 0}, "page_size must be positive, got 0"),
        ({"num_pages": 1, "head_dim": 0}, "head_dim must be positive, got 0"),
    ):
        with pytest.raises(ValueError) as info:
            PagePool(**kwargs)  # type: ignore[arg-type]
        assert str(info.value) == message
    pool = PagePool(1, page_size=1, head_dim=1)
    assert pool.kv.shape == (1, 2, 1, 1) and pool.kv.dtype == torch.float16
    assert pool.allocate(1).tolist() == [0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert PagePool(1, 1, 1, dtype=dtype).kv.dtype == dtype


def test_pool_errors_change_nothing() -> None:
    pool = PagePool(4, page_size=1, head_dim=1)
    assert pool.allocate(3).tolist() == [2, 1, 0]

    def check(call: object, kind: type[Exception], message: str) -> None:
        before = (pool.num_free, pool.in_use_mask(), pool._free_stack.clone())
        with pytest.raises(kind) as info:
            call()  # type: ignore[operator]
        assert str(info.value) == message
        assert pool.num_free == before[0]
        assert torch.equal(pool.in_use_mask(), before[1]) and torch.equal(pool._free_stack, before[2])

    check(lambda: pool.allocate(-1), ValueError, "cannot allocate a negative number of pages (-1)")
    check(lambda: pool.allocate(2), PoolExhaustedError, "KV page pool exhausted: 2 pages requested, 1 free")
    check(lambda: pool.free(torch.tensor([-1])), ValueError, "page id out of range [0, 4)")
    check(lambda: pool.free(torch.tensor([0, 4])), ValueError, "page id out of range [0, 4)")
    check(
        lambda: pool.free(torch.tensor([0, 3])),
        ValueError,
        "freeing a page that is not in use (double free or foreign id)",
    )
    check(lambda: pool.free(torch.tensor([1, 1])), ValueError, "the same page id is freed twice in one call")
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    pool.free(torch.tensor([], dtype=torch.int64))
    assert pool.num_free == 1
    assert pool.allocate(1).tolist() == [3]
    pool.free(torch.tensor([3]))  # the last id is in range
    assert pool.num_free == 1 and not bool(pool.in_use_mask()[3])


def test_pages_for_memory_rounds_down() -> None:
    per_page = 2 * 4 * 8 * 2
    assert PagePool.pages_for_memory(per_page * 5 - 1, 4, 8, torch.float16) == 4
    assert PagePool.pages_for_memory(per_page * 5, 4, 8, torch.bfloat16) == 5


# ------------------------------------------------------------------------------------ cache and rows


def test_new_cache_layout_and_request_rows() -> None:
    cache = cache_of(2, 3, pages=8, rows=3, width=0)
    assert cache.block_tables.shape == (2, 3, 3, 1) and cache.block_tables.dtype == torch.int32
    assert bool((cache.block_tables == -1).all())
    assert cache.seq_lens.shape == (2, 3, 3) and cache.seq_lens.dtype == torch.int32 and not bool(cache.seq_lens.any())
    assert cache.rings.tables.shape == (2, 3, 3, 0) and cache.rings.tables.dtype == torch.int32
    assert cache.rings.flags.shape == (2, 3, 3, 0) and cache.rings.flags.dtype == torch.bool
    assert cache.rings.window.tolist() == [0, 0, 0] and cache.rings.count.tolist() == [0, 0, 0]
    assert cache.device_block_tables is cache.block_tables and cache.device_seq_lens is cache.seq_lens
    assert cache.rings.device_tables is cache.rings.tables
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.page_size) == (2, 3, 4, 2)
    assert cache.max_requests == 3 and cache.device == torch.device("cpu")
    assert cache_of(1, 1, pages=1, width=3).block_tables.shape == (1, 2, 1, 3)
    assert cache.num_requests == 0
    assert [cache.add_request(name) for name in "abc"] == [0, 1, 2]
    assert cache.num_requests == 3 and cache.row_of("b") == 1
    with pytest.raises(RequestCapacityError) as capacity:
        cache.add_request("d")
    assert str(capacity.value) == "all 3 request rows are in use"
    with pytest.raises(ValueError) as again:
        cache.add_request("a")
    assert str(again.value) == "request 'a' is already in the cache"
    cache.free_request("b")
    assert cache.num_requests == 2
    with pytest.raises(KeyError) as missing:
        cache.row_of("b")
    assert missing.value.args == ("request 'b' is not in the cache",)
    assert cache.add_request("d") == 1
    cache.free_request("a")
    cache.free_request("c")
    assert cache.add_request("e") == 2 and cache.add_request("f") == 0


def test_cache_refuses_empty_shapes_and_accepts_the_smallest() -> None:
    for layers, heads, rows in ((0, 1, 1), (1, 0, 1), (-1, 1, 1), (1, -1, 1)):
        with pytest.raises(ValueError) as info:
            PagedKVCache(layers, heads, 4, num_pages=1, max_requests=rows)
        assert str(info.value) == "num_layers and num_kv_heads must be positive"
    with pytest.raises(ValueError) as info:
        PagedKVCache(1, 1, 4, num_pages=1, max_requests=0)
    assert str(info.value) == "max_requests must be positive, got 0"
    cache = PagedKVCache(1, 1, 4, num_pages=1, page_size=1, max_requests=1)
    assert cache.add_request("x") == 0 and cache.block_tables.shape == (1, 1, 1, 8)


# ----------------------------------------------------------------------------------------- appending


def test_append_slots_fills_pages_in_allocation_order() -> None:
    cache = cache_of(1, 2, pages=16, page_size=4)
    row = cache.add_request("a")
    assert row == 0
    assert cache.pages_needed_to_append([row], 6) == 4
    slots = cache.append_slots([row], torch.arange(6).view(1, -1))
    # 4 pages at once: [3, 2, 1, 0]; head 0 takes pages 3 then 2, head 1 pages 1 then 0.
    assert slots.tolist() == [[[[12, 13, 14, 15, 8, 9], [4, 5, 6, 7, 0, 1]]]]
    assert slots.dtype == torch.int64
    assert cache.block_tables.shape[-1] == 2  # grown from 1 to max(2, 2 * 1)
    assert cache.block_tables[0, row].tolist() == [[3, 2], [1, 0]]
    assert cache.seq_lens[0, row].tolist() == [6, 6]
    assert cache.pool.positions[[3, 2]].tolist() == [[0, 1, 2, 3], [4, 5, -1, -1]]
    assert cache.pool.num_free == 12 and cache.peak_pages("a") == 4
    # Entries 6, 7 fill the second pages; entry 8 opens a third page per head: [5, 4].
    assert cache.pages_needed_to_append([row], 2) == 0 and cache.pages_needed_to_append([row], 3) == 2
    slots = cache.append_slots([row], torch.tensor([[6, 7, 8]]))
    assert slots.tolist() == [[[[10, 11, 20], [2, 3, 16]]]]
    assert cache.block_tables.shape[-1] == 4  # max(3, 2 * 2)
    assert cache.block_tables[0, row].tolist() == [[3, 2, 5, -1], [1, 0, 4, -1]]
    assert cache.peak_pages("a") == 6
    # Two rows in one call, in the order given; row 1 opens a page per head ([7, 6]), row 0 does not.
    other = cache.add_request("b")
    slots = cache.append_slots([other, row], torch.tensor([[100], [9]]))
    assert slots.tolist() == [[[[28], [24]], [[21], [17]]]]
    assert cache.seq_lens[0].tolist() == [[10, 10], [1, 1]]
    assert cache.pool.positions[7, 0] == 100 and cache.pool.positions[5, 1] == 9
    assert cache.peak_pages("b") == 2 and cache.peak_pages("a") == 6
    assert cache.pages_needed_to_append(torch.tensor([row, other]), 3) == 2 + 0
    assert cache.device_block_tables is cache.block_tables
    assert_consistent(cache)


def test_append_exactly_fills_the_pool_and_one_more_page_fails_cleanly() -> None:
    cache = cache_of(1, 2, pages=4)
    row = prefill(cache, "a", 3)  # two pages per head: all four
    assert cache.pool.num_free == 0
    cache.append_slots([row], torch.tensor([[3]]))  # fits in the second pages
    before = state(cache)
    with pytest.raises(PoolExhaustedError) as info:
        cache.append_slots([row], torch.tensor([[4]]))
    assert (info.value.requested, info.value.free) == (2, 0)
    assert unchanged(before, cache)
    cache.free_request("a")
    cache = cache_of(1, 2, pages=3)
    row = cache.add_request("a")
    before = state(cache)
    with pytest.raises(PoolExhaustedError) as info:
        cache.append_slots([row], torch.arange(3).view(1, -1))
    assert (info.value.requested, info.value.free) == (4, 3)
    assert unchanged(before, cache)


def test_append_slots_refuses_repeated_rows_and_multi_token_ring_appends() -> None:
    cache = cache_of(1, 1, pages=8)
    row = prefill(cache, "a", 2)
    before = state(cache)
    with pytest.raises(ValueError) as info:
        cache.append_slots([row, row], torch.tensor([[2], [2]]))
    assert str(info.value) == "a request row appears twice in one append"
    assert unchanged(before, cache)
    cache.start_ring("a", 2, torch.zeros(1, 1, 2, dtype=torch.bool))
    before = state(cache)
    with pytest.raises(ValueError) as info:
        cache.append_slots([row], torch.tensor([[2, 3]]))
    assert str(info.value) == "requests with a local ring append one token per step"
    assert unchanged(before, cache)


def test_append_layer_slots_allocates_one_layer() -> None:
    cache = cache_of(2, 2, pages=16)
    row = cache.add_request("a")
    slots = cache.append_layer_slots(1, row, torch.tensor([0, 1, 2]))
    # Layer 1 takes [3, 2, 1, 0]: head 0 pages 3 then 2, head 1 pages 1 then 0.
    assert slots.tolist() == [[6, 7, 4], [2, 3, 0]]
    assert cache.seq_lens[:, row].tolist() == [[0, 0], [3, 3]]
    assert cache.block_tables[:, row].tolist() == [[[-1, -1], [-1, -1]], [[3, 2], [1, 0]]]
    assert cache.pool.positions[[3, 2, 1, 0]].tolist() == [[0, 1], [2, -1], [0, 1], [2, -1]]
    assert cache.peak_pages("a") == 4
    slots = cache.append_layer_slots(0, row, torch.tensor([7]))
    assert slots.tolist() == [[10], [8]]
    assert cache.pool.positions[[5, 4], 0].tolist() == [7, 7]
    assert cache.seq_lens[:, row].tolist() == [[1, 1], [3, 3]]
    assert cache.peak_pages("a") == 6
    for layer in (-1, 2):
        with pytest.raises(ValueError) as info:
            cache.append_layer_slots(layer, row, torch.tensor([0]))
        assert str(info.value) == f"layer {layer} out of range [0, 2)"
    ring = prefill(cache, "b", 2)
    cache.start_ring("b", 2, torch.zeros(2, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError) as info:
        cache.append_layer_slots(0, ring, torch.tensor([2]))
    assert str(info.value) == "requests with a local ring cannot append layer by layer"
    assert_consistent(cache)


def test_write_stores_keys_then_values_page_by_page() -> None:
    cache = cache_of(1, 1, pages=4)
    row = cache.add_request("a")
    slots = cache.append_slots([row], torch.arange(3).view(1, -1))
    assert slots.tolist() == [[[[2, 3, 0]]]]
    keys = torch.arange(12, dtype=torch.float64).view(1, 1, 1, 3, 4)
    cache.write(slots, keys, 100 + keys)
    kv = cache.pool.kv
    assert kv[1, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert kv[1, 1].tolist() == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert kv[0, 0].tolist() == [[8, 9, 10, 11], [0, 0, 0, 0]]
    assert kv[0, 1].tolist() == [[108, 109, 110, 111], [0, 0, 0, 0]]
    assert kv.dtype == torch.float32
    for k, v in ((torch.zeros(1, 1, 1, 3, 4), torch.zeros(1, 1, 1, 3, 5)), (torch.zeros(1, 3, 4),) * 2):
        with pytest.raises(ValueError) as info:
            cache.write(slots, k, v)
        assert str(info.value) == (
            f"write shapes disagree: slots (1, 1, 1, 3), keys {tuple(k.shape)}, values {tuple(v.shape)}"
        )


# ------------------------------------------------------------------------------------ compaction


def test_keep_plan_compacts_in_order_and_frees_the_tail_pages() -> None:
    cache = cache_of(1, 2, pages=8)
    row = prefill(cache, "a", 5)  # head 0 pages [5, 4, 3], head 1 pages [2, 1, 0]
    assert cache.block_tables[0, row].tolist() == [[5, 4, 3], [2, 1, 0]]
    freed = cache.apply_keep_plan("a", KeepPlan.from_lists([[[1, 4], [0, 1, 2]]]))
    assert freed == 2 + 1
    assert global_positions(cache, "a") == [[[1, 4], [0, 1, 2]]]
    assert cache.seq_lens[0, row].tolist() == [2, 3]
    assert cache.block_tables[0, row].tolist() == [[5, -1, -1], [2, 1, -1]]
    assert cache.pool.num_free == 2 + 3
    # Freed in (head, page) order: 4, 3 then 0; the next allocation returns the last pushed first.
    assert cache.pool.allocate(3).tolist() == [4, 3, 0]
    assert cache.usage("a").pages == 3 and cache.peak_pages("a") == 6
    # Keeping everything moves and frees nothing; keeping nothing frees every page.
    assert cache.apply_keep_plan("a", KeepPlan.from_lists([[[0, 1], [0, 1, 2]]])) == 0
    assert global_positions(cache, "a") == [[[1, 4], [0, 1, 2]]]
    assert cache.apply_keep_plan("a", KeepPlan.from_lists([[[], [2]]])) == 2
    assert global_positions(cache, "a") == [[[], [2]]]
    assert cache.block_tables[0, row].tolist() == [[-1, -1, -1], [2, -1, -1]]


def test_keep_plan_on_chosen_layers_leaves_the_others() -> None:
    cache = cache_of(3, 1, pages=9)
    row = prefill(cache, "a", 5)  # layer 0 pages [8, 7, 6], layer 1 [5, 4, 3], layer 2 [2, 1, 0]
    assert cache.pool.num_free == 0  # compaction needs no free page
    plan = KeepPlan.from_lists([[[1, 3]], [[0, 4]]])  # plan row 0 is layer 2, row 1 is layer 0
    assert cache.apply_keep_plan("a", plan, layers=[2, 0]) == 4
    assert global_positions(cache, "a") == [[[0, 4]], [[0, 1, 2, 3, 4]], [[1, 3]]]
    assert cache.seq_lens[:, row].tolist() == [[2], [5], [2]]
    assert cache.block_tables[:, row].tolist() == [[[8, -1, -1]], [[5, 4, 3]], [[2, -1, -1]]]
    assert cache.pool.allocate(4).tolist() == [1, 0, 7, 6]
    assert cache.apply_keep_plan("a", KeepPlan.from_lists([[[0, 2, 4]]]), layers=[1]) == 1
    assert global_positions(cache, "a") == [[[0, 4]], [[0, 2, 4]], [[1, 3]]]
    for layers, message in (
        ([], "layers must be a non-empty list in [0, 3), got []"),
        ([3], "layers must be a non-empty list in [0, 3), got [3]"),
        ([-1], "layers must be a non-empty list in [0, 3), got [-1]"),
        ([1, 1], "layers must be distinct, got [1, 1]"),
    ):
        before = state(cache)
        with pytest.raises(InvalidPlanError) as info:
            cache.apply_keep_plan("a", KeepPlan.from_lists([[[0]]] * max(1, len(layers))), layers=layers)
        assert str(info.value) == message
        assert unchanged(before, cache)


def test_bad_keep_plans_name_the_first_offender_and_change_nothing() -> None:
    cache = cache_of(2, 2, pages=16)
    prefill(cache, "a", 3)
    cache.apply_keep_plan("a", KeepPlan.from_lists([[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [1]]]))
    lists = [[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0]]]
    for layer, head, row, message in (
        (1, 1, [1], "keep index 1 out of range for layer 1 head 1 (length 1)"),
        (1, 0, [0, 3], "keep index 3 out of range for layer 1 head 0 (length 3)"),
        (0, 1, [-1, 0], "keep index -1 out of range for layer 0 head 1 (length 3)"),
        (0, 1, [0, 0], "duplicate keep indices for layer 0 head 1 at position 1"),
        (1, 0, [0, 2, 1], "unsorted keep indices for layer 1 head 0 at position 2"),
        (0, 0, [1, 0], "unsorted keep indices for layer 0 head 0 at position 1"),
    ):
        bad = [[list(h) for h in heads] for heads in lists]
        bad[layer][head] = row
        before = state(cache)
        with pytest.raises(InvalidPlanError) as info:
            cache.apply_keep_plan("a", KeepPlan.from_lists(bad))
        assert str(info.value) == message
        assert unchanged(before, cache)


# -------------------------------------------------------------------------------------------- evict


def test_evict_fills_holes_from_the_tail_in_order_and_frees_trailing_pages() -> None:
    cache = cache_of(1, 2, pages=16, rows=3)
    cache.add_request("pad")  # row 0 stays empty
    row = prefill(cache, "a", 6)  # head 0 pages [5, 4, 3], head 1 pages [2, 1, 0]
    other = prefill(cache, "b", 3)  # head 0 pages [9, 8], head 1 pages [7, 6]
    assert (row, other) == (1, 2)
    assert cache.block_tables[0, row, :, :3].tolist() == [[5, 4, 3], [2, 1, 0]]
    assert cache.evict([row, row, row], [0, 0, 0], [0, 0, 1], [1, 4, 0]) == 1
    # Head 0 drops 1 and 4: new length 4, the hole at 1 takes entry 5. Head 1 drops 0: entry 5 moves there.
    assert global_positions(cache, "a") == [[[0, 5, 2, 3], [5, 1, 2, 3, 4]]]
    assert cache.seq_lens[0, row].tolist() == [4, 5]
    assert cache.block_tables[0, row, :, :3].tolist() == [[5, 4, -1], [2, 1, 0]]
    assert cache.pool.num_free == 16 - 10 + 1
    # Holes are filled in entry order by the kept tail entries in entry order, whatever the input order.
    assert cache.evict([row, other, row], [0, 0, 0], [1, 1, 1], [2, 0, 0]) == 2
    assert global_positions(cache, "a") == [[[0, 5, 2, 3], [3, 1, 4]]]
    assert global_positions(cache, "b") == [[[0, 1, 2], [2, 1]]]
    assert cache.block_tables[0, other, :, :2].tolist() == [[9, 8], [7, -1]]
    assert cache.pool.allocate(2).tolist() == [0, 6]  # page 0 (row a) was pushed before page 6 (row b)
    # Dropping the last entries only moves nothing; dropping a whole head frees all its pages.
    assert cache.evict([other, other], [0, 0], [0, 0], [1, 2]) == 1
    assert global_positions(cache, "b") == [[[0], [2, 1]]]
    assert cache.evict([other, other], [0, 0], [1, 1], [1, 0]) == 1
    assert global_positions(cache, "b") == [[[0], []]]
    assert cache.evict([], [], [], []) == 0
    assert cache.evict(torch.tensor([], dtype=torch.int64), [], [], []) == 0


def test_evict_keeps_groups_apart_across_layers_and_heads() -> None:
    cache = cache_of(2, 2, pages=32)
    row = prefill(cache, "a", 4)
    # One entry per (layer, head), dropped from different places.
    assert cache.evict([row] * 4, [1, 0, 1, 0], [0, 1, 1, 0], [0, 3, 2, 1]) == 0
    assert global_positions(cache, "a") == [[[0, 3, 2], [0, 1, 2]], [[3, 1, 2], [0, 1, 3]]]
    assert cache.seq_lens[:, row].tolist() == [[3, 3], [3, 3]]
    assert cache.evict([row] * 3, [1, 1, 1], [1, 1, 1], [0, 1, 2]) == 2
    assert global_positions(cache, "a") == [[[0, 3, 2], [0, 1, 2]], [[3, 1, 2], []]]
    # Pages 1, 0 were freed; now the last entry of both heads of layer 0 frees 6 (head 0) then 4 (head 1).
    assert cache.evict([row] * 2, [0, 0], [1, 0], [2, 2]) == 2
    assert global_positions(cache, "a") == [[[0, 3], [0, 1]], [[3, 1, 2], []]]
    assert cache.pool.allocate(4).tolist() == [1, 0, 6, 4]
    cache.pool.free(torch.tensor([1, 0, 6, 4]))
    assert_consistent(cache)


def test_evictions_out_of_range_raise_and_change_nothing() -> None:
    cache = cache_of(2, 2, pages=32, rows=3)
    row = prefill(cache, "a", 4)
    cache.evict([row], [1], [1], [3])  # (1, 1) now holds 3 entries
    for args, message in (
        (([row], [0, 0], [0], [0]), "evict needs rows, layers, heads and entries of equal length"),
        (([row], [0], [0, 0], [0]), "evict needs rows, layers, heads and entries of equal length"),
        (([row], [0], [0], [0, 1]), "evict needs rows, layers, heads and entries of equal length"),
        (([1], [0], [0], [0]), "evict names a request row that is not in use"),
        (([row, -1], [0, 0], [0, 0], [0, 1]), "evict names a request row that is not in use"),
        (([3], [0], [0], [0]), "evict names a request row that is not in use"),
        (([row], [2], [0], [0]), "evict names a layer or head out of range"),
        (([row], [-1], [0], [0]), "evict names a layer or head out of range"),
        (([row], [0], [2], [0]), "evict names a layer or head out of range"),
        (([row], [0], [-1], [0]), "evict names a layer or head out of range"),
        (([row, row], [0, 1], [0, 1], [1, 3]), "evict entry 3 out of range for row 0 layer 1 head 1 (length 3)"),
        (([row, row], [0, 0], [1, 1], [-1, 9]), "evict entry -1 out of range for row 0 layer 0 head 1 (length 4)"),
        (([row, row], [1, 1], [1, 1], [2, 2]), "evict names the same entry twice"),
        (([row, row, row], [0, 1, 0], [0, 0, 0], [0, 0, 0]), "evict names the same entry twice"),
        (([row, row, row], [0, 1, 1], [0, 0, 0], [0, 1, 1]), "evict names the same entry twice"),
    ):
        before = state(cache)
        with pytest.raises(InvalidPlanError) as info:
            cache.evict(*args)
        assert str(info.value) == message
        assert unchanged(before, cache)
    # The error names the first out-of-range entry, after valid ones (0 included).
    before = state(cache)
    with pytest.raises(InvalidPlanError) as info:
        cache.evict([row, row, row], [0, 0, 0], [0, 1, 0], [0, 1, 4])
    assert str(info.value) == "evict entry 4 out of range for row 0 layer 0 head 0 (length 4)"
    assert unchanged(before, cache)
    # The last row, in use, while the row below it is free; then a row past the last one.
    prefill(cache, "b", 2)
    last = prefill(cache, "c", 2)
    cache.free_request("b")
    assert last == 2
    assert cache.evict([last, row], [1, 1], [1, 1], [1, 2]) == 1
    assert global_positions(cache, "c")[1][1] == [0]
    assert global_positions(cache, "a")[1][1] == [0, 1]
    before = state(cache)
    with pytest.raises(InvalidPlanError) as info:
        cache.evict([3], [0], [0], [0])
    assert str(info.value) == "evict names a request row that is not in use"
    assert unchanged(before, cache)


# ------------------------------------------------------------------------------------------- rings


def test_start_ring_moves_the_last_window_and_keeps_admitted_older_tokens() -> None:
    cache = cache_of(1, 2, pages=32)
    row = prefill(cache, "r", 7)  # head 0 pages [7, 6, 5, 4], head 1 pages [3, 2, 1, 0]
    admitted = torch.zeros(1, 2, 7, dtype=torch.bool)
    admitted[0, 0, [0, 2, 4, 6]] = True
    admitted[0, 1, [1, 5]] = True
    # Global keeps 0, 2 (head 0) and 1 (head 1): 2 pages; it held 8; the ring takes 2 per head.
    assert cache.start_ring("r", 4, admitted) == 8 - 2 - 4
    assert cache.rings.window.tolist() == [4, 0] and cache.rings.count.tolist() == [7, 0]
    assert cache.rings.lens().tolist() == [4, 0] and cache.rings.lens([row]).tolist() == [4]
    assert global_positions(cache, "r") == [[[0, 2], [1]]]
    assert cache.block_tables[0, row].tolist() == [[7, -1, -1, -1], [3, -1, -1, -1]]
    # Compaction freed 6, 5, 4 then 2, 1, 0; the ring's 4 pages are the last four pushed.
    assert cache.rings.tables.shape == (1, 2, 2, 2)
    assert cache.rings.tables[0, row].tolist() == [[4, 2], [1, 0]]
    assert cache.rings.tables[0, 1].tolist() == [[-1, -1], [-1, -1]]
    assert cache.rings.device_tables is cache.rings.tables
    # Token t sits in ring slot t % 4: slots hold tokens 4, 5, 6, 3 with their flags.
    _, _, ring_pos = cache.gather("r", 0, 0, region="ring")
    assert ring_pos.tolist() == [4, 5, 6, 3]
    keys, values, _ = cache.gather("r", 0, 1, region="ring")
    assert keys[:, 0].tolist() == [4, 5, 6, 3] and torch.equal(values, -keys)
    assert cache.rings.flags[0, row].tolist() == [[True, False, True, False], [False, True, False, False]]
    assert cache.pool.num_free == 32 - 6
    usage = cache.usage("r")
    assert (usage.pages, usage.tokens, usage.ring_tokens) == (6, 2 + 1 + 2 * 4, 4)
    assert usage.global_tokens.tolist() == [[2, 1]]
    assert cache.pages_per_head("r").tolist() == [[3, 3]]
    assert cache.peak_pages("r") == 8
    assert_consistent(cache)

    # t = 7 goes to slot 3, whose token 3 is not admitted: no promotion, no page.
    assert cache.pages_needed_to_append([row], 1) == 0
    assert cache.append_slots([row], torch.tensor([[7]])).tolist() == [[[[5], [1]]]]
    cache.write(torch.tensor([5, 1]), torch.full((2, 4), 7.0), torch.full((2, 4), -7.0))
    assert cache.rings.count.tolist() == [8, 0]
    cache.rings.admit(0, [row], torch.tensor([[True, False]]))
    assert cache.rings.flags[0, row].tolist() == [[True, False, True, True], [False, True, False, False]]
    # t = 8 goes to slot 0, whose token 4 is admitted in head 0: promoted to a new global page (26... top: 5).
    assert cache.pages_needed_to_append([row], 1) == 1
    assert cache.append_slots([row], torch.tensor([[8]])).tolist() == [[[[8], [2]]]]
    cache.write(torch.tensor([8, 2]), torch.full((2, 4), 8.0), torch.full((2, 4), -8.0))
    assert cache.block_tables[0, row].tolist() == [[7, 5, -1, -1], [3, -1, -1, -1]]
    assert global_positions(cache, "r") == [[[0, 2, 4], [1]]]
    assert cache.rings.flags[0, row].tolist() == [[False, False, True, True], [False, True, False, False]]
    _, _, ring_pos = cache.gather("r", 0, 1, region="ring")
    assert ring_pos.tolist() == [8, 5, 6, 7]
    assert cache.peak_pages("r") == 8
    assert cache.usage("r").tokens == 3 + 1 + 2 * 4
    assert_consistent(cache)

    # free_request returns global and ring pages and clears the row for the next request.
    cache.free_request("r")
    assert cache.pool.num_free == 32 and not bool(cache.pool.in_use_mask().any())
    assert cache.rings.window.tolist() == [0, 0] and cache.rings.count.tolist() == [0, 0]
    assert bool((cache.rings.tables == -1).all()) and not bool(cache.rings.flags.any())
    assert bool((cache.block_tables == -1).all()) and not bool(cache.seq_lens.any())
    assert cache.add_request("s") == row and cache.peak_pages("s") == 0


def test_start_ring_on_a_prompt_shorter_than_the_window() -> None:
    cache = cache_of(1, 1, pages=8)
    row = prefill(cache, "r", 3)  # pages [1, 0]
    assert cache.start_ring("r", 4, torch.ones(1, 1, 3, dtype=torch.bool)) == 2 - 0 - 2
    assert global_positions(cache, "r") == [[[]]]
    assert cache.rings.lens([row]).tolist() == [3]
    _, _, ring_pos = cache.gather("r", 0, 0, region="ring")
    assert ring_pos.tolist() == [0, 1, 2]
    assert cache.rings.flags[0, row].tolist() == [[True, True, True, False]]
    # t = 3 fills slot 3; t = 4 overwrites token 0, admitted: promoted.
    cache.append_slots([row], torch.tensor([[3]]))
    assert cache.pages_needed_to_append([row], 1) == 1
    cache.append_slots([row], torch.tensor([[4]]))
    assert cache.entry_positions("r")[0].tolist() == [[[0]]]
    _, _, ring_pos = cache.gather("r", 0, 0, region="ring")
    assert ring_pos.tolist() == [4, 1, 2, 3]
    assert_consistent(cache)


def test_start_ring_fits_a_full_pool_exactly_or_fails_cleanly() -> None:
    cache = cache_of(1, 1, pages=3)
    prefill(cache, "r", 6)  # pages [2, 1, 0]; the pool is full
    before = state(cache)
    with pytest.raises(PoolExhaustedError) as info:
        cache.start_ring("r", 8, torch.ones(1, 1, 6, dtype=torch.bool))
    assert (info.value.requested, info.value.free) == (4, 3)
    assert unchanged(before, cache)
    admitted = torch.tensor([[[True, True, True, False, False, False]]])
    # Tokens 0 and 1 stay global (one page), 2..5 need two ring pages: 3 held - 1 kept = 2 available.
    assert cache.start_ring("r", 4, admitted) == 3 - 1 - 2
    assert cache.pool.num_free == 0 and cache.rings.tables[0, 0, 0].tolist() == [1, 0]
    assert global_positions(cache, "r") == [[[0, 1]]]
    assert cache.rings.flags[0, 0, 0].tolist() == [False, False, True, False]


def test_start_ring_refuses_bad_requests() -> None:
    cache = cache_of(2, 1, pages=32, rows=3)
    prefill(cache, "r", 4)
    for window in (0, -2, 3):
        with pytest.raises(ValueError) as info:
            cache.start_ring("r", window, torch.zeros(2, 1, 4, dtype=torch.bool))
        assert str(info.value) == f"ring window must be a positive multiple of page_size 2, got {window}"
    for admitted in (torch.zeros(2, 1, 3, dtype=torch.bool), torch.zeros(2, 1, 4, dtype=torch.int8)):
        before = state(cache)
        with pytest.raises(InvalidPlanError) as info:
            cache.start_ring("r", 2, admitted)
        assert str(info.value) == (
            f"admitted must be bool [L, H, n] = (2, 1, 4), got {admitted.dtype} {tuple(admitted.shape)}"
        )
        assert unchanged(before, cache)
    prefill(cache, "c", 4)
    cache.evict([1], [1], [0], [3])  # the last prompt token of one head, which the ring needs
    with pytest.raises(InvalidPlanError) as info:
        cache.start_ring("c", 2, torch.zeros(2, 1, 4, dtype=torch.bool))
    assert str(info.value) == "start_ring needs the last 2 prompt tokens, in order, at the end of every head"
    cache.start_ring("r", 2, torch.zeros(2, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError) as info:
        cache.start_ring("r", 2, torch.zeros(2, 1, 4, dtype=torch.bool))
    assert str(info.value) == "request 'r' already has a ring"
    # A wider ring later widens the ring tables and flags of every row.
    prefill(cache, "w", 8)
    assert cache.rings.tables.shape == (2, 3, 1, 1)
    cache.start_ring("w", 6, torch.zeros(2, 1, 8, dtype=torch.bool))
    assert cache.rings.tables.shape == (2, 3, 1, 3) and cache.rings.flags.shape == (2, 3, 1, 6)
    assert cache.rings.tables[:, 0, 0, 1:].tolist() == [[-1, -1], [-1, -1]]
    assert cache.rings.lens().tolist() == [2, 0, 6]
    assert cache.rings.device_tables is cache.rings.tables
    assert_consistent(cache)


def test_admit_flags_the_token_just_appended() -> None:
    cache = cache_of(2, 2, pages=32, rows=3)
    prefill(cache, "plain", 2)
    a = prefill(cache, "a", 2)
    b = prefill(cache, "b", 4)
    cache.start_ring("a", 4, torch.zeros(2, 2, 2, dtype=torch.bool))
    cache.start_ring("b", 2, torch.zeros(2, 2, 4, dtype=torch.bool))
    cache.append_slots([b, a], torch.tensor([[4], [2]]))
    # a's token 2 sits in slot 2 of 4; b's token 4 in slot 0 of 2.
    cache.rings.admit(1, [b, a], torch.tensor([[True, True], [False, True]]))
    assert cache.rings.flags[1, a].tolist() == [[False, False, False, False], [False, False, True, False]]
    assert cache.rings.flags[1, b].tolist() == [[True, False, False, False], [True, False, False, False]]
    assert not bool(cache.rings.flags[0].any())
    for rows, flags, message in (
        ([0], torch.ones(1, 2, dtype=torch.bool), "admission flags only apply to requests with a local ring"),
        ([a, 0], torch.ones(2, 2, dtype=torch.bool), "admission flags only apply to requests with a local ring"),
        ([a], torch.ones(2, dtype=torch.bool), "flags must be [B, H] = (1, 2), got (2,)"),
        ([a, b], torch.ones(2, 3, dtype=torch.bool), "flags must be [B, H] = (2, 2), got (2, 3)"),
    ):
        with pytest.raises(ValueError) as info:
            cache.rings.admit(0, rows, flags)
        assert str(info.value) == message
    # A ring row and a plain row decode together; the plain one grows its global region.
    cache.append_slots([0, a], torch.tensor([[2], [3]]))
    assert cache.seq_lens[:, 0].tolist() == [[3, 3], [3, 3]]
    # Each row's peak counts its own pages: the plain row's 2 per (layer, head), a's ring of 2 per (layer, head).
    assert cache.peak_pages("plain") == 8 and cache.peak_pages("a") == 8
    assert cache.rings.count.tolist() == [0, 4, 5]


# ------------------------------------------------------------------------------------ reading back


def test_gather_reads_regions_and_refuses_others() -> None:
    cache = cache_of(1, 1, pages=8)
    prefill(cache, "a", 3)
    keys, values, positions = cache.gather("a", 0, 0)
    assert keys.shape == (3, 4) and keys[:, 0].tolist() == [0, 1, 2] and torch.equal(values, -keys)
    assert positions.dtype == torch.int32 and positions.tolist() == [0, 1, 2]
    assert [t.numel() for t in cache.gather("a", 0, 0, region="ring")] == [0, 0, 0]
    with pytest.raises(ValueError) as info:
        cache.gather("a", 0, 0, region="local")
    assert str(info.value) == "region must be 'global' or 'ring', got 'local'"


def test_usage_of_a_ring_request_in_a_later_row_of_a_deeper_cache() -> None:
    cache = cache_of(2, 1, pages=32, rows=3)
    prefill(cache, "first", 1)
    row = prefill(cache, "r", 6)
    assert row == 1
    admitted = torch.zeros(2, 1, 6, dtype=torch.bool)
    admitted[0, 0, 0] = True
    cache.start_ring("r", 4, admitted)
    usage = cache.usage("r")
    # Global: 1 token in layer 0, none in layer 1; ring: 4 tokens in each of 2 (layer, head) pairs.
    assert usage.ring_tokens == 4 and usage.tokens == 1 + 4 * 2 and usage.pages == 1 + 2 * 2
    assert usage.bytes == 5 * cache.pool.bytes_per_page
    assert cache.usage("first").ring_tokens == 0 and cache.usage("first").tokens == 2
    assert cache.pages_per_head("r").tolist() == [[3], [2]]
    assert cache.pages_per_head("r").dtype == torch.int64


def test_usages_of_many_rows_are_each_rows_own() -> None:
    """One pass over several rows (a ring row, a forked row sharing its parent's pages, a plain one) gives each the
    figures it has alone, the shared pages' bytes split between their holders."""
    cache = cache_of(2, 1, pages=48, rows=4)
    prefill(cache, "plain", 5)
    prefill(cache, "parent", 9)
    cache.fork_request("parent", "child")
    prefill(cache, "ring", 6)
    admitted = torch.zeros(2, 1, 6, dtype=torch.bool)
    admitted[0, 0, :2] = True
    cache.start_ring("ring", 4, admitted)
    ids = ["ring", "child", "plain", "parent"]
    together = cache.usages(ids)
    assert [u.pages for u in together] == [1 + 2 * 2, 10, 6, 10]  # pages of 2 tokens, 2 layers
    assert together[1].bytes == together[3].bytes == 5 * cache.pool.bytes_per_page  # 10 pages, each held twice
    for request_id, usage in zip(ids, together, strict=True):
        alone = cache.usage(request_id)
        assert (usage.pages, usage.bytes, usage.tokens, usage.ring_tokens) == (
            alone.pages,
            alone.bytes,
            alone.tokens,
            alone.ring_tokens,
        )
        assert torch.equal(usage.global_tokens, alone.global_tokens)
    assert sum(u.bytes for u in together) == (cache.pool.num_pages - cache.pool.num_free) * cache.pool.bytes_per_page
    assert cache.usages([]) == []


def test_slot_and_position_queries_are_int64() -> None:
    cache = cache_of(1, 2, pages=16)
    row = cache.add_request("a")
    assert cache.append_layer_slots(0, row, torch.tensor([0, 1], dtype=torch.int32)).dtype == torch.int64
    positions, lengths = cache.entry_positions("a")
    assert positions.dtype == torch.int64 and lengths.dtype == torch.int64
    assert positions.tolist() == [[[0, 1], [0, 1]]] and lengths.tolist() == [[2, 2]]


def test_keep_plans_with_no_layers_or_no_heads_are_empty() -> None:
    plan = KeepPlan.from_mask(torch.zeros(0, 2, 3, dtype=torch.bool))
    assert plan.indices.shape == (0, 2, 0) and plan.lengths.shape == (0, 2)
    no_heads = KeepPlan.from_lists([[]])
    assert no_heads.indices.shape == (1, 0, 0) and no_heads.lengths.shape == (1, 0)


def test_keep_plan_to_mask_exact_and_its_shape_checks() -> None:
    plan = KeepPlan(
        indices=torch.tensor([[[0, 2, 99], [1, -7, 3]], [[4, 5, 6], [-1, -1, -1]]]),
        lengths=torch.tensor([[2, 1], [3, 0]]),
    )
    # Padding past each row's length is never read, whatever it holds.
    mask = plan.to_mask(torch.tensor([[3, 2], [7, 1]], dtype=torch.int32))
    assert mask.shape == (2, 2, 7) and mask.dtype == torch.bool
    assert mask.int().tolist() == [
        [[1, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]],
        [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]],
    ]

    def message(plan: KeepPlan, lengths: torch.Tensor) -> str:
        with pytest.raises(InvalidPlanError) as info:
            plan.to_mask(lengths)
        return str(info.value)

    flat = KeepPlan(indices=torch.tensor([[0, 1]]), lengths=torch.tensor([[2]]))
    assert message(flat, torch.tensor([[2]])) == (
        "keep plan indices must be [L, H, K] with lengths [L, H]; got (1, 2) and (1, 1)"
    )
    skewed = KeepPlan(indices=torch.zeros(2, 1, 1, dtype=torch.int64), lengths=torch.zeros(1, 2, dtype=torch.int64))
    assert message(skewed, torch.zeros(1, 2)) == (
        "keep plan indices must be [L, H, K] with lengths [L, H]; got (2, 1, 1) and (1, 2)"
    )
    one = KeepPlan.from_lists([[[0], [1]]])
    assert message(one, torch.tensor([[2, 2], [2, 2]])) == (
        "keep plan covers (1, 2) (layers, heads) but the request has (2, 2)"
    )
    for lengths in ([[-1, 0]], [[2, 0]]):
        bad = KeepPlan(indices=torch.tensor([[[0], [0]]]), lengths=torch.tensor(lengths))
        assert message(bad, torch.tensor([[3, 3]])) == "keep plan lengths must lie in [0, K]"
    full = KeepPlan(indices=torch.tensor([[[0, 1], [0, 2]]]), lengths=torch.tensor([[2, 2]]))
    assert full.to_mask(torch.tensor([[2, 3]])).int().tolist() == [[[1, 1, 0], [1, 0, 1]]]
    # A row whose last valid index is followed by smaller padding is still increasing.
    padded = KeepPlan(indices=torch.tensor([[[3, 0]]]), lengths=torch.tensor([[1]]))
    assert padded.to_mask(torch.tensor([[4]])).int().tolist() == [[[0, 0, 0, 1]]]
    assert message(KeepPlan(torch.tensor([[[1, 1]]]), torch.tensor([[2]])), torch.tensor([[4]])) == (
        "duplicate keep indices for layer 0 head 0 at position 1"
    )
    assert KeepPlan.from_lists([[[]]]).to_mask(torch.tensor([[0]])).shape == (1, 1, 0)


def test_batched_append_over_layers_rows_and_heads() -> None:
    cache = cache_of(2, 2, pages=32)
    a = prefill(cache, "a", 3)  # (l0, h0) [7, 6], (l0, h1) [5, 4], (l1, h0) [3, 2], (l1, h1) [1, 0]
    b = cache.add_request("b")
    assert cache.block_tables[:, a].tolist() == [[[7, 6], [5, 4]], [[3, 2], [1, 0]]]
    # Eight pages [15, ..., 8] in (layer, row as given, head) order: b before a.
    slots = cache.append_slots([b, a], torch.tensor([[0, 1], [3, 4]]))
    assert slots.tolist() == [
        [[[30, 31], [28, 29]], [[13, 26], [9, 24]]],
        [[[22, 23], [20, 21]], [[5, 18], [1, 16]]],
    ]
    assert cache.block_tables.shape[-1] == 4
    assert cache.block_tables[:, b, :, :2].tolist() == [[[15, -1], [14, -1]], [[11, -1], [10, -1]]]
    assert cache.block_tables[:, a, :, :3].tolist() == [[[7, 6, 13], [5, 4, 12]], [[3, 2, 9], [1, 0, 8]]]
    assert cache.seq_lens.tolist() == [[[5, 5], [2, 2]], [[5, 5], [2, 2]]]
    assert (cache.peak_pages("a"), cache.peak_pages("b")) == (12, 4)
    # Compacting layer 1 of a, both heads: (l1, h0) keeps 4 (one page, frees 2 and 9), (l1, h1) keeps 0..3.
    keys = torch.arange(2, dtype=torch.float32).view(1, 1, 1, 2, 1).expand(*slots.shape, 4) + 3
    cache.write(slots[:, 1:], keys[:, 1:], -keys[:, 1:])
    assert cache.apply_keep_plan("a", KeepPlan.from_lists([[[4], [0, 1, 2, 3]]]), layers=[1]) == 2 + 1
    assert global_positions(cache, "a") == [[[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]], [[4], [0, 1, 2, 3]]]
    assert cache.block_tables[:, a, :, :3].tolist() == [[[7, 6, 13], [5, 4, 12]], [[3, -1, -1], [1, 0, -1]]]
    assert cache.pool.allocate(3).tolist() == [2, 9, 8]
    cache.pool.free(torch.tensor([2, 9, 8]))
    assert cache.peak_pages("a") == 12
    assert_consistent(cache)


def test_table_width_doubles_only_when_a_head_needs_more() -> None:
    cache = cache_of(1, 1, pages=16, page_size=4)
    prefill(cache, "a", 5)  # two pages: width 1 -> 2
    assert cache.block_tables.shape[-1] == 2
    prefill(cache, "b", 8)  # two pages again: the width stays
    assert cache.block_tables.shape[-1] == 2
    cache.append_slots([0], torch.tensor([[5, 6, 7, 8]]))  # a needs 3 pages: max(3, 2 * 2)
    assert cache.block_tables.shape[-1] == 4
    assert cache.block_tables[0, :, 0].tolist() == [[1, 0, 4, -1], [3, 2, -1, -1]]


def test_a_ring_can_raise_the_peak() -> None:
    cache = cache_of(1, 1, pages=8)
    prefill(cache, "r", 1)
    assert cache.peak_pages("r") == 1
    assert cache.start_ring("r", 4, torch.ones(1, 1, 1, dtype=torch.bool)) == 1 - 0 - 2
    assert cache.peak_pages("r") == 2 and cache.usage("r").pages == 2


def test_a_one_token_ring_admits_and_promotes() -> None:
    cache = cache_of(1, 1, pages=8, page_size=1)
    row = prefill(cache, "r", 2)
    cache.start_ring("r", 1, torch.zeros(1, 1, 2, dtype=torch.bool))
    assert global_positions(cache, "r") == [[[]]]
    cache.append_slots([row], torch.tensor([[2]]))
    cache.rings.admit(0, [row], torch.tensor([[True]]))
    cache.append_slots([row], torch.tensor([[3]]))  # token 2 leaves the ring, admitted
    assert cache.entry_positions("r")[0].tolist() == [[[2]]]
    _, _, ring_pos = cache.gather("r", 0, 0, region="ring")
    assert ring_pos.tolist() == [3]


def test_an_empty_plan_masks_nothing() -> None:
    plan = KeepPlan.from_mask(torch.zeros(0, 2, 3, dtype=torch.bool))
    assert plan.to_mask(torch.zeros(0, 2, dtype=torch.int64)).shape == (0, 2, 0)


def test_device_mirrors_follow_every_bookkeeping_change() -> None:
    """With the pool on an accelerator the tables have device copies that receive the same updates.

    On the CPU `.to(device)` returns the tensor itself, so this cache gets separate CPU copies to
    play the device's part, and they must equal the bookkeeping after every operation.
    """
    cache = cache_of(2, 2, pages=64, rows=3)
    cache._mirror = cache.rings._mirror = True

    def split() -> None:
        cache.device_block_tables = cache.block_tables.clone()
        cache.device_seq_lens = cache.seq_lens.clone()
        cache.rings.device_tables = cache.rings.tables.clone()

    def check() -> None:
        assert cache.device_block_tables is not cache.block_tables
        assert cache.device_block_tables.shape == cache.block_tables.shape
        assert torch.equal(cache.device_block_tables, cache.block_tables)
        assert torch.equal(cache.device_seq_lens, cache.seq_lens)
        assert torch.equal(cache.rings.device_tables, cache.rings.tables)

    split()
    a = prefill(cache, "a", 5)
    check()
    b = prefill(cache, "b", 3)
    cache.append_slots([a, b], torch.tensor([[5], [3]]))
    check()
    cache.apply_keep_plan("a", KeepPlan.from_lists([[[0, 5], [1]], [[2, 3, 4], []]]), layers=[1, 0])
    check()
    cache.apply_keep_plan("b", KeepPlan.from_lists([[[0], [1, 2]], [[], [3]]]))
    check()
    assert cache.evict([a, a, b], [0, 1, 0], [0, 1, 1], [2, 0, 1]) == 2
    check()
    c = prefill(cache, "c", 6)
    cache.start_ring("c", 4, torch.ones(2, 2, 6, dtype=torch.bool))
    split()  # the ring tables were just created; give them their own device copy again
    cache.append_slots([c, a], torch.tensor([[6], [6]]))
    cache.rings.admit(0, [c], torch.ones(1, 2, dtype=torch.bool))
    check()
    _, _, positions, lengths = cache.gather_layer("a", 0)
    assert lengths.tolist() == [3, 1] and positions.tolist() == [[2, 3, 6], [6, -1, -1]]
    cache.free_request("c")
    check()
    cache.free_request("b")
    cache.free_request("a")
    check()
    assert not bool(cache.device_seq_lens.any()) and bool((cache.device_block_tables == -1).all())


def test_batched_ring_appends_promote_and_clear_per_row() -> None:
    cache = cache_of(2, 2, pages=64, rows=3)
    a, b = prefill(cache, "a", 4), prefill(cache, "b", 5)
    cache.start_ring("a", 4, torch.ones(2, 2, 4, dtype=torch.bool))  # tokens 0..3 in slots 0..3
    cache.start_ring("b", 4, torch.zeros(2, 2, 5, dtype=torch.bool))  # tokens 4, 1, 2, 3; token 0 dropped
    assert cache.rings.flags[:, a].tolist() == [[[True] * 4] * 2] * 2
    assert not bool(cache.rings.flags[:, b].any())
    # Both rings are full. a's token 4 goes to slot 0 (token 0, admitted: promoted), b's token 5 to
    # slot 1 (token 1, not admitted: dropped).
    assert cache.pages_needed_to_append([a, b], 1) == 4
    cache.append_slots([a, b], torch.tensor([[4], [5]]))
    assert cache.rings.flags[:, a].tolist() == [[[False, True, True, True]] * 2] * 2
    assert not bool(cache.rings.flags[:, b].any())
    assert global_positions(cache, "a") == [[[0], [0]], [[0], [0]]]
    assert global_positions(cache, "b") == [[[], []], [[], []]]
    for layer in range(2):
        for head in range(2):
            assert cache.gather("a", layer, head, region="ring")[2].tolist() == [4, 1, 2, 3]
            assert cache.gather("b", layer, head, region="ring")[2].tolist() == [4, 5, 2, 3]
    # A full ring beside one that is not: a's token 1 is promoted, c's empty slot 2 promotes nothing.
    c = prefill(cache, "c", 2)
    cache.start_ring("c", 4, torch.ones(2, 2, 2, dtype=torch.bool))
    cache.append_slots([a, c], torch.tensor([[5], [2]]))
    assert global_positions(cache, "a") == [[[0, 1], [0, 1]], [[0, 1], [0, 1]]]
    assert global_positions(cache, "c") == [[[], []], [[], []]]
    assert_consistent(cache)


def test_start_ring_rounds_the_kept_pages_per_head() -> None:
    cache = cache_of(1, 2, pages=16)
    prefill(cache, "r", 6)  # 3 pages per head
    admitted = torch.zeros(1, 2, 6, dtype=torch.bool)
    admitted[0, 0, 0] = admitted[0, 1, 1] = True
    # One kept token per head is one page per head: 6 held - 2 kept - 4 ring pages.
    assert cache.start_ring("r", 4, admitted) == 0
    assert cache.usage("r").pages == 6 and cache.pool.num_free == 10


def test_a_ring_step_without_promotion_reads_no_page_past_a_full_table() -> None:
    cache = cache_of(1, 1, pages=16, width=2)
    row = prefill(cache, "r", 4)  # width 2 is exactly enough
    cache.start_ring("r", 2, torch.ones(1, 1, 4, dtype=torch.bool))  # 0, 1 global; 2, 3 in the ring
    cache.append_slots([row], torch.tensor([[4]]))  # promotes 2
    cache.append_slots([row], torch.tensor([[5]]))  # promotes 3: the global region fills both pages
    assert cache.block_tables.shape[-1] == 2 and cache.seq_lens[0, row, 0] == 4
    slots = cache.append_slots([row], torch.tensor([[6]]))  # token 4 was never admitted: nothing moves
    assert slots.tolist() == [[[[int(cache.rings.tables[0, row, 0, 0]) * 2]]]]
    assert cache.entry_positions("r")[0].tolist() == [[[0, 1, 2, 3]]]
    _, _, ring_pos = cache.gather("r", 0, 0, region="ring")
    assert ring_pos.tolist() == [6, 5]
    assert_consistent(cache)


def test_defaults() -> None:
    cache = PagedKVCache(1, 1, 8, num_pages=4)
    assert (cache.page_size, cache.max_requests, cache.block_tables.shape[-1]) == (16, 64, 8)
    assert cache.pool.dtype == torch.float16 and cache.device == torch.device("cpu")
    pool = PagePool(2)
    assert (pool.page_size, pool.head_dim, pool.dtype) == (16, 128, torch.float16)
