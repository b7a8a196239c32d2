"""Page sharing: reference counts in the pool, forked rows, copy-on-write.

Every entry written carries a unique id in its key (and minus it in its value), so a gather proves
exactly which writes a row sees.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache, PagePool, PoolExhaustedError

L, H, D, PS = 2, 2, 4, 4


def make_cache(num_pages: int = 64, rows: int = 4) -> PagedKVCache:
    return PagedKVCache(L, H, D, num_pages=num_pages, page_size=PS, max_requests=rows, dtype=torch.float32)


class Writer:
    def __init__(self) -> None:
        self.uid = itertools.count(1)

    def append(self, cache: PagedKVCache, rows: list[int], positions: torch.Tensor) -> torch.Tensor:
        slots = cache.append_slots(rows, positions)
        ids = torch.tensor([float(next(self.uid)) for _ in range(slots.numel())]).view(slots.shape)
        keys = ids.unsqueeze(-1).expand(*slots.shape, D).contiguous()
        cache.write(slots, keys, -keys)
        return ids


def contents(cache: PagedKVCache, rid: str) -> list[list[int]]:
    return [cache.gather(rid, layer, head)[0][:, 0].to(torch.int64).tolist() for layer in range(L) for head in range(H)]


def check_conservation(cache: PagedKVCache) -> None:
    tables = cache.block_tables
    held = torch.arange(tables.shape[-1]) < ((cache.seq_lens.to(torch.int64) + PS - 1) // PS).unsqueeze(-1)
    pages = torch.cat([tables[held], cache.ring_tables[cache.ring_tables >= 0]]).to(torch.int64)
    refs = torch.bincount(pages, minlength=cache.pool.num_pages).to(torch.int32)
    assert torch.equal(cache.pool.refcounts(), refs)
    assert cache.pool.num_used == int((refs > 0).sum())
    free = cache.pool._free_stack[: cache.pool.num_free]
    assert torch.unique(free).numel() == free.numel() and not bool((refs[free] > 0).any())


def test_pool_reference_counts_and_errors() -> None:
    pool = PagePool(4, page_size=1, head_dim=1)
    pages = pool.allocate(2)
    pool.share(pages)
    pool.share(pages[:1])
    assert pool.refcounts(pages).tolist() == [3, 2] and pool.num_shared == 2
    assert pool.free(pages) == 0 and pool.num_free == 2  # still referenced
    assert pool.free(torch.cat([pages, pages[:1]])) == 2 and pool.num_free == 4
    with pytest.raises(ValueError, match="not in use"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="sharing a page that is not in use"):
        pool.share(pages[:1])
    fresh = pool.allocate(1)
    with pytest.raises(ValueError, match="freed more times than it is referenced"):
        pool.free(torch.cat([fresh, fresh]))
    assert pool.refcounts(fresh).tolist() == [1] and pool.num_free == 3


def test_fork_gathers_exactly_what_the_parent_held_without_new_pages() -> None:
    cache, w = make_cache(), Writer()
    row = cache.add_request("p")
    w.append(cache, [row], torch.arange(10).view(1, -1))
    cache.apply_keep_plan("p", KeepPlan.from_mask(torch.rand(L, H, 10) < 0.6))
    used = cache.pool.num_used
    cache.fork_request("p", "c")
    assert cache.pool.num_used == used  # shared, not copied
    assert contents(cache, "c") == contents(cache, "p")
    assert torch.equal(cache.entry_positions("c")[0], cache.entry_positions("p")[0])
    for rid in ("p", "c"):
        usage = cache.usage(rid)
        assert usage.pages == used and usage.private_pages == 0
        assert usage.bytes == used * cache.pool.bytes_per_page // 2
    cache.free_request("p")
    assert cache.pool.num_used == used and cache.usage("c").private_pages == used
    cache.free_request("c")
    assert cache.pool.num_used == 0


def test_appends_into_a_shared_partial_page_stay_private() -> None:
    cache, w = make_cache(), Writer()
    row = cache.add_request("p")
    w.append(cache, [row], torch.arange(6).view(1, -1))  # two pages per head, the second half full
    used = cache.pool.num_used
    parent_before = contents(cache, "p")
    child = cache.fork_request("p", "c")
    # The child's next token lands in the shared partial page: one private copy per (layer, head).
    assert cache.pages_needed_to_append([child], 1) == L * H
    assert cache.pages_needed_to_append([child, row], 1) == 2 * L * H
    w.append(cache, [child], torch.tensor([[6]]))
    assert cache.pool.num_used == used + L * H
    assert contents(cache, "p") == parent_before
    assert cache.pages_needed_to_append([row], 1) == 0  # the parent's page is private again
    w.append(cache, [row], torch.tensor([[6]]))
    parent, child_view = contents(cache, "p"), contents(cache, "c")
    for p_list, c_list in zip(parent, child_view, strict=True):
        assert p_list[:6] == c_list[:6] and p_list[6] != c_list[6]
    check_conservation(cache)


def test_copy_on_write_needs_pages_and_fails_cleanly_on_a_full_pool() -> None:
    cache, w = make_cache(num_pages=L * H * 2), Writer()
    row = cache.add_request("p")
    w.append(cache, [row], torch.arange(6).view(1, -1))
    child = cache.fork_request("p", "c")
    assert cache.pool.num_free == 0
    tables, lens, refs = cache.block_tables.clone(), cache.seq_lens.clone(), cache.pool.refcounts()
    with pytest.raises(PoolExhaustedError):
        cache.append_slots([child], torch.tensor([[6]]))
    keep = torch.zeros(L, H, 6, dtype=torch.bool)
    keep[..., 1:] = True  # every entry moves one slot down, inside shared pages
    with pytest.raises(PoolExhaustedError):
        cache.apply_keep_plan("c", KeepPlan.from_mask(keep))
    with pytest.raises(PoolExhaustedError):
        cache.evict([child], [0], [0], [0])
    assert torch.equal(cache.block_tables, tables) and torch.equal(cache.seq_lens, lens)
    assert torch.equal(cache.pool.refcounts(), refs)
    # Dropping only the tail moves nothing: no copy is needed, the shared tail page loses one reference.
    tail = torch.ones(L, H, 6, dtype=torch.bool)
    tail[..., 4:] = False
    cache.apply_keep_plan("c", KeepPlan.from_mask(tail))
    assert cache.pool.num_free == 0 and cache.usage("c").pages == L * H
    check_conservation(cache)


def test_compaction_and_eviction_of_a_fork_leave_the_parent_alone() -> None:
    cache, w = make_cache(), Writer()
    row = cache.add_request("p")
    w.append(cache, [row], torch.arange(11).view(1, -1))
    parent_before = contents(cache, "p")
    child = cache.fork_request("p", "c")
    keep = torch.rand(L, H, 11) < 0.5
    cache.apply_keep_plan("c", KeepPlan.from_mask(keep))
    expected = [
        [e for e, k in zip(lst, keep[i // H, i % H].tolist(), strict=True) if k] for i, lst in enumerate(parent_before)
    ]
    assert contents(cache, "c") == expected
    assert contents(cache, "p") == parent_before
    cache.evict([row, row], [0, 1], [1, 0], [0, 3])
    assert contents(cache, "c") == expected
    del child
    check_conservation(cache)


def test_fork_copies_the_ring_and_refuses_start_ring_on_shared_pages() -> None:
    cache, w = make_cache(), Writer()
    row = cache.add_request("p")
    w.append(cache, [row], torch.arange(6).view(1, -1))
    cache.fork_request("p", "plain")
    with pytest.raises(ValueError, match="shares pages"):
        cache.start_ring("plain", 4, torch.ones(L, H, 6, dtype=torch.bool))
    cache.free_request("plain")
    cache.start_ring("p", 4, torch.ones(L, H, 6, dtype=torch.bool))
    child = cache.fork_request("p", "c")

    def ring(rid: str) -> list[list[float]]:
        return [cache.gather(rid, layer, head, "ring")[0][:, 0].tolist() for layer in range(L) for head in range(H)]

    assert ring("c") == ring("p")
    w.append(cache, [child], torch.tensor([[6]]))
    cache.admit(0, [child], torch.ones(1, H, dtype=torch.bool))
    assert ring("c") != ring("p")
    check_conservation(cache)


def test_fork_errors() -> None:
    cache = make_cache(rows=2)
    cache.add_request("p")
    with pytest.raises(KeyError, match="not in the cache"):
        cache.fork_request("nope", "c")
    with pytest.raises(ValueError, match="already in the cache"):
        cache.fork_request("p", "p")
    cache.fork_request("p", "c")
    with pytest.raises(RuntimeError, match="rows"):
        cache.fork_request("p", "d")


@pytest.mark.parametrize("seed", [0, 1])
def test_thousands_of_random_cycles_leak_nothing(seed: int) -> None:
    """Random fork / append / compact / evict / free cycles; conservation after every one."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache, w = make_cache(num_pages=48, rows=6), Writer()
    live: dict[str, int] = {}
    names = itertools.count()
    for _ in range(1500):
        op = rng.choice(["add", "fork", "append", "compact", "evict", "free"])
        try:
            if op == "add" and len(live) < 6:
                rid = f"r{next(names)}"
                row = cache.add_request(rid)
                try:
                    w.append(cache, [row], torch.arange(rng.randint(1, 9)).view(1, -1))
                except PoolExhaustedError:
                    cache.free_request(rid)
                    continue
                live[rid] = row
            elif op == "fork" and live and len(live) < 6:
                rid = f"r{next(names)}"
                live[rid] = cache.fork_request(rng.choice(sorted(live)), rid)
            elif op == "append" and live:
                chosen = rng.sample(sorted(live), rng.randint(1, len(live)))
                pos = torch.tensor([[int(cache.seq_lens[:, live[r]].max())] for r in chosen])
                w.append(cache, [live[r] for r in chosen], pos)
            elif op == "compact" and live:
                rid = rng.choice(sorted(live))
                n = int(cache.seq_lens[:, live[rid]].max())
                lens = cache.seq_lens[:, live[rid]].to(torch.int64)
                keep = (torch.rand(L, H, n) < 0.7) & (torch.arange(n) < lens.unsqueeze(-1))
                cache.apply_keep_plan(rid, KeepPlan.from_mask(keep))
            elif op == "evict" and live:
                rid = rng.choice(sorted(live))
                layer, head = rng.randrange(L), rng.randrange(H)
                n = int(cache.seq_lens[layer, live[rid], head])
                if n:
                    cache.evict([live[rid]], [layer], [head], [rng.randrange(n)])
            elif op == "free" and live:
                rid = rng.choice(sorted(live))
                cache.free_request(rid)
                del live[rid]
        except PoolExhaustedError:
            pass
        check_conservation(cache)
    for rid in list(live):
        cache.free_request(rid)
    assert cache.pool.num_free == cache.pool.num_pages
