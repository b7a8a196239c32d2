"""Property-based tests of the paged per-head cache against a plain-Python model of it.

Every entry written carries a unique id in its key and minus that id in its value, so reading the
cache back proves that exactly the written-and-kept entries are there, in the expected order.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm_kvpress_ext.cache import InvalidPlanError, KeepPlan, PagedKVCache, PagePool, PoolExhaustedError

L, H, D, PS, PAGES, ROWS = 2, 2, 4, 4, 40, 4
WINDOW = 8


class Entry(tuple[int, int]):
    """(uid, position)"""


class RequestModel:
    def __init__(self, row: int) -> None:
        self.row = row
        self.next_pos = 0
        self.global_: list[list[list[tuple[int, int]]]] = [[[] for _ in range(H)] for _ in range(L)]
        self.window = 0
        self.ring: list[list[list[tuple[int, int, bool] | None]]] = []
        self.count = 0
        self.compressed = False


def snapshot(cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
    return (
        cache.block_tables.clone(),
        cache.seq_lens.clone(),
        cache.rings.tables.clone(),
        cache.rings.flags.clone(),
        cache.rings.count.clone(),
        torch.tensor(cache.pool.num_free),
    )


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(
            L, H, D, num_pages=PAGES, page_size=PS, max_requests=ROWS, dtype=torch.float32, initial_pages_per_head=1
        )
        self.requests: dict[int, RequestModel] = {}
        self.uids = itertools.count(1)
        self.ids = itertools.count()

    @initialize()
    def start(self) -> None:
        pass

    def _fill(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        uid = torch.tensor([next(self.uids) for _ in range(slots.numel())], dtype=torch.float32).view(slots.shape)
        keys = uid.unsqueeze(-1).expand(*slots.shape, D).contiguous()
        self.cache.write(slots, keys, -keys)
        return uid.to(torch.int64)

    @precondition(lambda self: len(self.requests) < ROWS)
    @rule(length=st.integers(1, 24))
    def add_and_prefill(self, length: int) -> None:
        rid = next(self.ids)
        row = self.cache.add_request(rid)
        before = snapshot(self.cache)
        try:
            slots = self.cache.append_slots([row], torch.arange(length).view(1, -1))
        except PoolExhaustedError:
            assert same(before, snapshot(self.cache))
            self.cache.free_request(rid)
            return
        model = RequestModel(row)
        uid = self._fill(slots)  # [L, 1, H, n]
        for layer, head in itertools.product(range(L), range(H)):
            model.global_[layer][head] = [(int(uid[layer, 0, head, j]), j) for j in range(length)]
        model.next_pos = length
        self.requests[rid] = model

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.requests)), min_size=1, unique=True))
        rows = [self.requests[r].row for r in rids]
        positions = torch.tensor([[self.requests[r].next_pos] for r in rids])
        before = snapshot(self.cache)
        try:
            slots = self.cache.append_slots(rows, positions)
        except PoolExhaustedError:
            assert same(before, snapshot(self.cache))
            return
        uid = self._fill(slots)  # [L, B, H, 1]
        ring_b = [b for b, r in enumerate(rids) if self.requests[r].window]
        flags = {}
        if ring_b:
            for layer in range(L):
                f = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(ring_b) * H, max_size=len(ring_b) * H)))
                flags[layer] = f.view(len(ring_b), H)
                self.cache.rings.admit(layer, [rows[b] for b in ring_b], flags[layer])
        for b, rid in enumerate(rids):
            m = self.requests[rid]
            for layer, head in itertools.product(range(L), range(H)):
                new = (int(uid[layer, b, head, 0]), m.next_pos)
                if m.window:
                    slot = m.count % m.window
                    old = m.ring[layer][head][slot]
                    if old is not None and old[2]:
                        m.global_[layer][head].append((old[0], old[1]))
                    admitted = bool(flags[layer][ring_b.index(b), head])
                    m.ring[layer][head][slot] = (new[0], new[1], admitted)
                else:
                    m.global_[layer][head].append(new)
            if m.window:
                m.count += 1
            m.next_pos += 1

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def keep_plan(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        m = self.requests[rid]
        lists = [
            [
                sorted(data.draw(st.sets(st.integers(0, max(0, len(m.global_[layer][head]) - 1)), max_size=12)))
                if m.global_[layer][head]
                else []
                for head in range(H)
            ]
            for layer in range(L)
        ]
        plan = KeepPlan.from_lists(lists)
        used = self.cache.pool.num_used
        freed = self.cache.apply_keep_plan(rid, plan)
        assert self.cache.pool.num_used == used - freed
        for layer, head in itertools.product(range(L), range(H)):
            old = m.global_[layer][head]
            m.global_[layer][head] = [old[i] for i in lists[layer][head]]
        m.compressed = True

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def bad_keep_plan(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        m = self.requests[rid]
        layer, head = data.draw(st.integers(0, L - 1)), data.draw(st.integers(0, H - 1))
        n = len(m.global_[layer][head])
        kind = data.draw(st.sampled_from(["range", "unsorted", "duplicate", "shape"]))
        lists: list[list[list[int]]] = [[list(range(len(m.global_[x][y]))) for y in range(H)] for x in range(L)]
        if kind == "range":
            lists[layer][head] = [n]
        elif kind == "unsorted" and n >= 2:
            lists[layer][head] = [1, 0]
        elif kind == "duplicate" and n >= 1:
            lists[layer][head] = [0, 0]
        elif kind == "shape":
            lists = lists[:1] if L > 1 else lists + lists
        else:
            return
        before = snapshot(self.cache)
        with pytest.raises(InvalidPlanError):
            self.cache.apply_keep_plan(rid, KeepPlan.from_lists(lists))
        assert same(before, snapshot(self.cache))

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        candidates = [
            (rid, layer, head, e)
            for rid, m in self.requests.items()
            for layer in range(L)
            for head in range(H)
            for e in range(len(m.global_[layer][head]))
        ]
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=10))
        used = self.cache.pool.num_used
        freed = self.cache.evict(
            [self.requests[c[0]].row for c in chosen],
            [c[1] for c in chosen],
            [c[2] for c in chosen],
            [c[3] for c in chosen],
        )
        assert self.cache.pool.num_used == used - freed
        by_head: dict[tuple[int, int, int], list[int]] = {}
        for rid, layer, head, e in chosen:
            by_head.setdefault((rid, layer, head), []).append(e)
        for (rid, layer, head), drops in by_head.items():
            entries = self.requests[rid].global_[layer][head]
            new_len = len(entries) - len(drops)
            holes = sorted(e for e in drops if e < new_len)
            sources = [e for e in range(new_len, len(entries)) if e not in drops]
            for hole, source in zip(holes, sources, strict=True):
                entries[hole] = entries[source]
            del entries[new_len:]
            self.requests[rid].compressed = True

    @precondition(lambda self: any(not m.compressed and not m.window for m in self.requests.values()))
    @rule(data=st.data())
    def start_ring(self, data: st.DataObject) -> None:
        rid = data.draw(
            st.sampled_from(sorted(r for r, m in self.requests.items() if not m.compressed and not m.window))
        )
        m = self.requests[rid]
        n = len(m.global_[0][0])
        admitted = torch.tensor(
            data.draw(st.lists(st.booleans(), min_size=L * H * n, max_size=L * H * n)), dtype=torch.bool
        ).view(L, H, n)
        before = snapshot(self.cache)
        try:
            self.cache.start_ring(rid, WINDOW, admitted)
        except PoolExhaustedError:
            assert same(before, snapshot(self.cache))
            return
        m.window, m.count = WINDOW, n
        m.ring = [[[None] * WINDOW for _ in range(H)] for _ in range(L)]
        in_ring = min(n, WINDOW)
        for layer, head in itertools.product(range(L), range(H)):
            old = m.global_[layer][head]
            for t in range(n - in_ring, n):
                m.ring[layer][head][t % WINDOW] = (old[t][0], old[t][1], bool(admitted[layer, head, t]))
            m.global_[layer][head] = [old[t] for t in range(n - in_ring) if admitted[layer, head, t]]

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.cache.free_request(rid)
        del self.requests[rid]
        if not self.requests:
            assert self.cache.pool.num_used == 0

    @invariant()
    def pages_are_owned_once(self) -> None:
        cache = self.cache
        tables = cache.block_tables
        page_col = torch.arange(tables.shape[-1])
        held = page_col < ((cache.seq_lens.to(torch.int64) + PS - 1) // PS).unsqueeze(-1)
        assert bool((tables[held] >= 0).all()), "a held page slot has no page"
        assert bool((tables[~held] == -1).all()), "a page id lingers past a head's length"
        pages = torch.cat([tables[held].to(torch.int64), cache.rings.tables[cache.rings.tables >= 0].to(torch.int64)])
        assert pages.numel() == torch.unique(pages).numel(), "a page is in two places"
        in_use = cache.pool.in_use_mask()
        assert int(in_use.sum()) == cache.pool.num_used == pages.numel()
        assert bool(in_use[pages].all())
        assert cache.pool.num_used + cache.pool.num_free == PAGES

    @invariant()
    def contents_match(self) -> None:
        for rid, m in self.requests.items():
            for layer, head in itertools.product(range(L), range(H)):
                k, v, pos = self.cache.gather(rid, layer, head)
                expected = m.global_[layer][head]
                assert k[:, 0].to(torch.int64).tolist() == [e[0] for e in expected]
                assert torch.equal(v, -k)
                assert pos.tolist() == [e[1] for e in expected]
                if m.window:
                    k, _, pos = self.cache.gather(rid, layer, head, region="ring")
                    ring = m.ring[layer][head][: min(m.count, m.window)]
                    assert k[:, 0].to(torch.int64).tolist() == [e[0] for e in ring if e is not None]
                    assert pos.tolist() == [e[1] for e in ring if e is not None]


CacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheMachine = CacheMachine.TestCase


def test_pool_exhaustion_is_typed_and_harmless() -> None:
    cache = PagedKVCache(1, 1, 4, num_pages=2, page_size=4, max_requests=2, dtype=torch.float32)
    row = cache.add_request("a")
    cache.append_slots([row], torch.arange(8).view(1, -1))
    with pytest.raises(PoolExhaustedError) as info:
        cache.append_slots([row], torch.tensor([[8]]))
    assert info.value.requested == 1 and info.value.free == 0
    assert str(info.value) == "KV page pool exhausted: 1 pages requested, 0 free"
    assert int(cache.seq_lens[0, row, 0]) == 8


def test_lazy_promotion_keeps_admitted_plus_last_window() -> None:
    torch.manual_seed(0)
    window, steps = 8, 40
    cache = PagedKVCache(1, 2, 4, num_pages=64, page_size=4, max_requests=1, dtype=torch.float32)
    row = cache.add_request("r")
    prompt = 5
    slots = cache.append_slots([row], torch.arange(prompt).view(1, -1))
    cache.write(slots, torch.zeros(*slots.shape, 4), torch.zeros(*slots.shape, 4))
    admitted = torch.rand(1, 2, prompt) < 0.5
    cache.start_ring("r", window, admitted)
    flags = {t: admitted[0, :, t] for t in range(prompt)}
    for t in range(prompt, prompt + steps):
        slots = cache.append_slots([row], torch.tensor([[t]]))
        cache.write(slots, torch.zeros(*slots.shape, 4), torch.zeros(*slots.shape, 4))
        flags[t] = torch.rand(2) < 0.3
        cache.rings.admit(0, [row], flags[t].view(1, 2))
    total = prompt + steps
    for head in range(2):
        _, _, global_pos = cache.gather("r", 0, head)
        _, _, ring_pos = cache.gather("r", 0, head, region="ring")
        expected_global = [t for t in range(total - window) if bool(flags[t][head])]
        assert sorted(global_pos.tolist()) == expected_global
        assert sorted(ring_pos.tolist()) == list(range(total - window, total))


def test_bad_arguments_raise_clear_errors() -> None:
    cache = PagedKVCache(1, 1, 4, num_pages=8, page_size=4, max_requests=1, dtype=torch.float32)
    row = cache.add_request("a")
    with pytest.raises(ValueError, match="already"):
        cache.add_request("a")
    with pytest.raises(RuntimeError, match="rows"):
        cache.add_request("b")
    with pytest.raises(KeyError, match="not in the cache"):
        cache.free_request("zzz")
    cache.append_slots([row], torch.arange(4).view(1, -1))
    with pytest.raises(InvalidPlanError, match="out of range"):
        cache.evict([row], [0], [0], [4])
    with pytest.raises(InvalidPlanError, match="twice"):
        cache.evict([row, row], [0, 0], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.start_ring("a", 6, torch.zeros(1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        PagedKVCache(1, 1, 4, num_pages=8, dtype=torch.int8)


def test_bookkeeping_queries_by_hand() -> None:
    """Every read-only query on one hand-built request, against values worked out by hand."""
    cache = PagedKVCache(2, 2, 4, num_pages=64, page_size=4, max_requests=2, dtype=torch.float32)
    assert cache.pages_for_prompt(1) == 4 and cache.pages_for_prompt(8) == 8 and cache.pages_for_prompt(9) == 12
    assert PagePool.pages_for_memory(1000, 4, 4, torch.float32) == 1000 // (2 * 4 * 4 * 4)
    row = cache.add_request("r")
    assert cache.pages_needed_to_append([row], 6) == 2 * 2 * 2
    slots = cache.append_slots([row], torch.arange(6).view(1, -1))
    cache.write(slots, torch.randn(*slots.shape, 4), torch.randn(*slots.shape, 4))
    assert cache.pages_needed_to_append([row], 2) == 0  # entries 6 and 7 fill the second pages
    assert cache.pages_needed_to_append([row], 3) == 2 * 2  # entry 8 opens a third page everywhere
    keep = torch.zeros(2, 2, 6, dtype=torch.bool)
    keep[0, 0, [0, 2, 5]] = True
    keep[0, 1] = True
    keep[1, 0, [1]] = True
    keep[1, 1, [3, 4]] = True
    plan = KeepPlan.from_mask(keep)
    assert plan.indices.tolist() == [
        [[0, 2, 5, -1, -1, -1], [0, 1, 2, 3, 4, 5]],
        [[1, -1, -1, -1, -1, -1], [3, 4, -1, -1, -1, -1]],
    ]
    assert plan.lengths.tolist() == [[3, 6], [1, 2]]
    cache.apply_keep_plan("r", plan)
    positions, lengths = cache.entry_positions("r")
    assert lengths.tolist() == [[3, 6], [1, 2]]
    assert positions.tolist() == [
        [[0, 2, 5, -1, -1, -1], [0, 1, 2, 3, 4, 5]],
        [[1, -1, -1, -1, -1, -1], [3, 4, -1, -1, -1, -1]],
    ]
    _, _, layer_positions, layer_lengths = cache.gather_layer("r", 1)
    assert layer_positions.tolist() == [[1, -1], [3, 4]] and layer_lengths.tolist() == [1, 2]
    assert cache.pages_per_head("r").tolist() == [[1, 2], [1, 1]]
    assert cache.usage("r").pages == 5


def test_keep_plan_from_mask_edges() -> None:
    empty = KeepPlan.from_mask(torch.zeros(1, 2, 0, dtype=torch.bool))
    assert empty.indices.shape == (1, 2, 0) and empty.lengths.tolist() == [[0, 0]]
    nothing = KeepPlan.from_mask(torch.zeros(1, 1, 3, dtype=torch.bool))
    assert nothing.indices.shape == (1, 1, 0) and nothing.lengths.tolist() == [[0]]
    for bad in (torch.ones(2, 3, dtype=torch.bool), torch.ones(1, 2, 3, dtype=torch.int64)):
        with pytest.raises(InvalidPlanError, match=r"keep mask must be a bool tensor \[L, H, n\]"):
            KeepPlan.from_mask(bad)


def test_usage_counts_the_ring_and_page_sizes_by_hand() -> None:
    assert PagePool.bytes_per_page_for(16, 64, torch.float16) == 2 * 16 * 64 * 2  # K and V, 2 bytes each
    assert PagePool.bytes_per_page_for(4, 8, torch.float32) == 2 * 4 * 8 * 4
    cache = PagedKVCache(1, 2, 8, num_pages=32, page_size=4, max_requests=1, dtype=torch.float32)
    row = cache.add_request("r")
    slots = cache.append_slots([row], torch.arange(12).view(1, -1))
    cache.write(slots, torch.randn(*slots.shape, 8), torch.randn(*slots.shape, 8))
    admitted = torch.zeros(1, 2, 12, dtype=torch.bool)
    admitted[0, 0, :4] = True  # head 0 admits every token older than the ring, head 1 only one of them
    admitted[0, 1, 2] = True
    cache.start_ring("r", 8, admitted)
    usage = cache.usage("r")
    # Ring: the last 8 tokens in 2 pages per head; global: 4 tokens (1 page) in head 0, 1 token (1 page) in head 1.
    assert usage.ring_tokens == 8 and usage.global_tokens.tolist() == [[4, 1]]
    assert usage.pages == 2 * 2 + 1 + 1 == cache.pool.num_used
    assert usage.tokens == 4 + 1 + 8 * 2
    assert usage.bytes == usage.pages * 2 * 4 * 8 * 4
    assert cache.pages_per_head("r").tolist() == [[3, 3]]


def test_keep_plan_from_lists_pads_exactly() -> None:
    plan = KeepPlan.from_lists([[[0, 2], torch.tensor([1])], [[], [3, 4, 5]]])
    assert plan.indices.tolist() == [[[0, 2, -1], [1, -1, -1]], [[-1, -1, -1], [3, 4, 5]]]
    assert plan.lengths.tolist() == [[2, 1], [0, 3]] and plan.indices.dtype == torch.int64
    assert KeepPlan.from_lists([[[], []]]).indices.shape == (1, 2, 0)
