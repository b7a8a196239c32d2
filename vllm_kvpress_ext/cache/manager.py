"""Per-request, per-(layer, KV head) ragged page lists over one shared page pool.

Layout of the bookkeeping (R = `max_requests` rows, one per running request):

- global region: `block_tables[L, R, H, P]` page ids (-1 = none) and `seq_lens[L, R, H]` entries.
  Entry e of (l, r, h) lives at slot `block_tables[l, r, h, e // page_size] * page_size + e % page_size`.
- local ring (optional, per request, `rings`: cache/rings.py): pages holding the last W tokens of
  every (layer, head), token t at ring slot `t % W`, each with a flag that says whether it is admitted
  to the global region when a later token overwrites it (lazy promotion). This class moves the entries;
  `LocalRings` keeps the rings' tables, counts and flags.

Kernels take `block_tables[l]` ([R, H, P]) and `seq_lens[l]` ([R, H]) for one layer and treat
each (request, head) as its own sequence. Every mutation is a handful of vectorised tensor ops
over all (layer, request, head) triples at once: there is no Python loop over layers, heads or
requests, which keeps decode-step bookkeeping well under a millisecond for large batches.

Bookkeeping tensors live on the CPU; when the pool lives on an accelerator, `device_block_tables`
and `device_seq_lens` mirror them and receive the same scatter updates (no full re-upload).

Every operation validates and counts the pages it needs *before* changing anything, so a
`PoolExhaustedError` or `InvalidPlanError` leaves the cache exactly as it was.

Sliding-window layers (`layer_windows`, Gemma 3's local layers) hold a ring of their window W in the
global region itself: token t of the row lives at entry `t % W`, so `seq_lens` never exceeds W and each
token overwrites the one its layer can no longer attend to. Every entry such a layer holds is one its
next query reads, which is why the attention kernels need no window mask for decode. An append longer
than W writes only its last W tokens (the earlier ones get slot -1, skipped by `write`). No policy
compacts or evicts these layers; their entries are in ring order, not position order.

Rows may share pages (`fork_request`: the samples of one prompt read its compressed pages). A shared
page is never written: any write into one (a decode token landing in a shared partial last page, a
compaction or eviction moving entries into it) first gives the writing row its own copy
(copy-on-write, `_unshare`), counted with the operation's other pages before anything changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from vllm_kvpress_ext.attention import ops
from vllm_kvpress_ext.attention.reference import gather_paged
from vllm_kvpress_ext.cache.plan import InvalidPlanError, KeepPlan
from vllm_kvpress_ext.cache.pool import PagePool, PoolExhaustedError
from vllm_kvpress_ext.cache.rings import LocalRings


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x + d - 1, d, rounding_mode="floor")


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten the ranges [starts[i], starts[i] + counts[i]) into (group index, value) pairs."""
    total = int(counts.sum())
    group = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return group, starts[group] + offsets


def _first_of_each(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct values of `key`, the index of one occurrence of each)."""
    uniq, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((uniq.numel(),), key.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(key.numel()), reduce="amin")
    return uniq, first


class RequestCapacityError(RuntimeError):
    """All request rows of the cache are taken."""


@dataclass(frozen=True)
class CacheUsage:
    """What one request holds. `pages` counts whole pages it reads (partial last pages included); `bytes`
    is its share of their memory: a page held by k requests counts 1/k to each, so the requests' bytes
    add up to the pool's."""

    pages: int
    bytes: int
    tokens: int
    global_tokens: torch.Tensor  # int64 [L, H]
    ring_tokens: int  # per (layer, head)


class PagedKVCache:
    """Ragged per-head paged KV cache for many requests, with optional local rings."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        max_requests: int = 64,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        initial_pages_per_head: int = 8,
        layer_windows: Sequence[int | None] | None = None,
    ) -> None:
        if num_layers <= 0 or num_kv_heads <= 0:
            raise ValueError("num_layers and num_kv_heads must be positive")
        windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        if len(windows) != num_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"layer_windows must give {num_layers} positive windows or None, got {layer_windows}")
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        self.pool = PagePool(num_pages, page_size, head_dim, dtype, device)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.max_requests = max_requests
        self.device = self.pool.device
        shape = (num_layers, max_requests, num_kv_heads)
        self.block_tables = torch.full((*shape, max(1, initial_pages_per_head)), -1, dtype=torch.int32)
        self.seq_lens = torch.zeros(shape, dtype=torch.int32)
        self.rings = LocalRings(num_layers, max_requests, num_kv_heads, page_size, self.device)
        self._mirror = self.device.type != "cpu"
        self.device_block_tables = self.block_tables.to(self.device) if self._mirror else self.block_tables
        self.device_seq_lens = self.seq_lens.to(self.device) if self._mirror else self.seq_lens
        # High-water mark of pages each row has held since it was added: updated at every allocation
        # (the only event that can raise it), so it is exact, not sampled.
        self._peak_pages = torch.zeros(max_requests, dtype=torch.int64)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._row_of: dict[Hashable, int] = {}
        # Per layer: its window (0 = a global layer), and the sliding layers' indices.
        self.layer_windows = torch.tensor([w or 0 for w in windows], dtype=torch.int64)
        self.sliding_layers = (self.layer_windows > 0).nonzero().reshape(-1)
        self.global_layers = (self.layer_windows == 0).nonzero().reshape(-1)

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_layers.numel() > 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: Hashable) -> int:
        """Reserve a row for a new request and return it."""
        if request_id in self._row_of:
            raise ValueError(f"request {request_id!r} is already in the cache")
        if not self._free_rows:
            raise RequestCapacityError(f"all {self.max_requests} request rows are in use")
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row

    def row_of(self, request_id: Hashable) -> int:
        try:
            return self._row_of[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in the cache") from None

    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    def free_request(self, request_id: Hashable) -> None:
        """Return every page of the request to the pool and release its row."""
        row = self.row_of(request_id)
        pages = self.block_tables[:, row]
        self.pool.free(torch.cat([pages[pages >= 0].to(torch.int64), self.rings.pages_of(row)]))
        self.block_tables[:, row] = -1
        self.seq_lens[:, row] = 0
        if self._mirror:
            self.device_block_tables[:, row] = -1
            self.device_seq_lens[:, row] = 0
        self.rings.clear(row)
        self._peak_pages[row] = 0
        del self._row_of[request_id]
        self._free_rows.append(row)

    def fork_request(self, parent_id: Hashable, child_id: Hashable) -> int:
        """A new row for `child_id` reading the parent's global pages (shared, copy-on-write); return it.

        A local ring is rewritten at every decode step, so the child gets its own copy of it (its pages
        are allocated here: PoolExhaustedError, with nothing changed, when they do not fit).
        """
        parent = self.row_of(parent_id)
        ring_held = self.rings.pages_of(parent)
        if ring_held.numel() > self.pool.num_free:
            raise PoolExhaustedError(ring_held.numel(), self.pool.num_free)
        child = self.add_request(child_id)
        pages = self.block_tables[:, parent]
        self.pool.share(pages[pages >= 0].to(torch.int64))
        self.block_tables[:, child] = pages
        self.seq_lens[:, child] = self.seq_lens[:, parent]
        if self._mirror:
            self.device_block_tables[:, child] = self.device_block_tables[:, parent]
            self.device_seq_lens[:, child] = self.device_seq_lens[:, parent]
        if ring_held.numel():
            copies = self.pool.allocate(ring_held.numel())
            self._copy_pages(ring_held, copies)
            self.rings.copy(parent, child, copies)
        self._note_peak(torch.tensor([child]))
        return child

    def add_request_on_pages(self, request_id: Hashable, pages: torch.Tensor) -> int:
        """A new row for `request_id` on `k` full blocks of a prefix: `pages[L, H, k]`, block b's page in every
        (layer, KV head), shared (copy-on-write). A global layer holds all `k * page_size` entries. A sliding
        layer of window W is a ring, which holds only the last W of them: block b goes to ring page
        `b % (W / page_size)`, so W must be a whole number of pages. Return the row."""
        num_layers, num_heads, count = pages.shape
        if (num_layers, num_heads) != (self.num_layers, self.num_kv_heads):
            raise ValueError(
                f"pages for {num_layers} layers x {num_heads} heads, the cache has {self.num_layers} x "
                f"{self.num_kv_heads}"
            )
        table = pages.to(torch.int32).clone()
        lens = torch.full((num_layers, 1, num_heads), count * self.page_size)
        for layer in self.sliding_layers.tolist():
            window = int(self.layer_windows[layer])
            if window % self.page_size:
                raise ValueError(f"a window of {window} tokens is not whole pages of {self.page_size}")
            ring_pages = window // self.page_size
            blocks = torch.arange(max(0, count - ring_pages), count)
            table[layer] = -1
            table[layer][:, blocks % ring_pages] = pages[layer][:, blocks].to(torch.int32)
            lens[layer] = min(count * self.page_size, window)
        row = self.add_request(request_id)
        self._ensure_table_width(count)
        held = table[table >= 0].to(torch.int64)
        self.pool.share(held)
        rows = torch.tensor([row])
        self.block_tables[:, row, :, :count] = table
        if self._mirror:
            self.device_block_tables[:, row, :, :count] = table.to(self.device)
        self._write_lens(rows, lens)
        self._note_peak(rows)
        return row

    def _copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (K, V and positions) `src[i]` -> `dst[i]`, the `dst` pages distinct."""
        src_d, dst_d = src.to(self.device, torch.int64), dst.to(self.device, torch.int64)
        self.pool.kv.index_copy_(0, dst_d, torch.index_select(self.pool.kv, 0, src_d))
        self.pool.positions.index_copy_(0, dst_d, torch.index_select(self.pool.positions, 0, src_d))

    def _shared_cells(
        self, l_idx: torch.Tensor, r_idx: torch.Tensor, h_idx: torch.Tensor, p_idx: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Of the table cells (l, r, h, page index) about to be written, the distinct ones whose page is shared."""
        if l_idx.numel() == 0 or self.pool.num_shared == 0:  # nothing shared: every decode step's common case
            empty = l_idx[:0]
            return empty, empty, empty, empty
        key = ((l_idx * self.max_requests + r_idx) * self.num_kv_heads + h_idx) * self.block_tables.shape[-1] + p_idx
        _, first = _first_of_each(key)
        l_idx, r_idx, h_idx, p_idx = l_idx[first], r_idx[first], h_idx[first], p_idx[first]
        pages = self.block_tables[l_idx, r_idx, h_idx, p_idx].to(torch.int64)
        shared = self.pool.refcounts(pages) > 1
        return l_idx[shared], r_idx[shared], h_idx[shared], p_idx[shared]

    def _distinct_cells(self, cells: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        l_idx, r_idx, h_idx, p_idx = cells
        key = ((l_idx * self.max_requests + r_idx) * self.num_kv_heads + h_idx) * self.block_tables.shape[-1] + p_idx
        _, first = _first_of_each(key)
        return l_idx[first], r_idx[first], h_idx[first], p_idx[first]

    def _unshare(self, cells: tuple[torch.Tensor, ...]) -> None:
        """Give each cell (from `_shared_cells`) a private copy of its page; the caller checked the free pages."""
        l_idx, r_idx, h_idx, p_idx = cells
        if l_idx.numel() == 0:
            return
        old = self.block_tables[l_idx, r_idx, h_idx, p_idx].to(torch.int64)
        new = self.pool.allocate(old.numel())
        self._copy_pages(old, new)
        self._write_table(l_idx, r_idx, h_idx, p_idx, new.to(torch.int32))
        self.pool.free(old)  # drops this row's hold; the other holders keep the page

    def _tail_cells(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Shared partial last pages that appending `counts[L, B, H]` entries to `rows` would write into."""
        if self.pool.num_shared == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty, empty
        lens = self.seq_lens[:, rows].to(torch.int64)
        into = (counts > 0) & (lens % self.page_size != 0)
        l_idx, b_idx, h_idx = into.nonzero().unbind(-1)
        p_idx = torch.div(lens[l_idx, b_idx, h_idx], self.page_size, rounding_mode="floor")
        return self._shared_cells(l_idx, rows[b_idx], h_idx, p_idx)

    # ------------------------------------------------------------------ appending

    def pages_needed_to_append(self, rows: torch.Tensor, num_tokens: int) -> int:
        """Pages an `append_slots(rows, ...)` of `num_tokens` tokens per row would allocate."""
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        counts = self._append_counts(rows, num_tokens)
        return int(self._growth(rows, counts).sum()) + self._tail_cells(rows, counts)[0].numel()

    def pages_to_append(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """New pages `[B]` an append of `num_tokens` tokens to each row allocates, shared pages aside.

        A (layer, KV head) takes a page when its last one is full: for a local ring's row only when the
        token its ring drops is promoted, for a sliding-window layer only until it holds its window. Rows
        that share their last page with another (a fork) also copy it first: `pages_needed_to_append`
        counts those copies for a batch.
        """
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        return self._growth(rows, self._append_counts(rows, num_tokens)).sum(dim=(0, 2))

    def _growth(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Pages `[L, B, H]` each (layer, row, head) adds to hold `counts` more global entries."""
        lens = self.seq_lens[:, rows].to(torch.int64)
        return _ceil_div(lens + counts, self.page_size) - _ceil_div(lens, self.page_size)

    def _append_counts(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Entries each (l, b, h) adds to its *global* region: `num_tokens`, or for ring rows the promotions."""
        counts = torch.full((self.num_layers, rows.numel(), self.num_kv_heads), num_tokens, dtype=torch.int64)
        ring_rows = self.rings.has_ring(rows).nonzero().reshape(-1)
        if ring_rows.numel():
            counts[:, ring_rows] = self.rings.promotions(rows[ring_rows]).to(torch.int64)
        if self.has_sliding_layers:
            # A sliding layer grows until it holds its window; after that each token replaces one.
            sliding = self.sliding_layers
            lens = self.seq_lens[sliding][:, rows].to(torch.int64)
            room = self.layer_windows[sliding].view(-1, 1, 1) - lens
            counts[sliding] = room.clamp(min=0, max=num_tokens)
        return counts

    def append_slots(self, rows: torch.Tensor | list[int], positions: torch.Tensor) -> torch.Tensor:
        """Reserve slots for `n` new tokens in every (layer, KV head) of each row.

        `positions[B, n]` are the tokens' positions in their sequences (stored with the entries).
        Returns flat slot ids `[L, B, H, n]` (int64, on the pool's device) to pass to `write`.
        Rows with a local ring take one token at a time (decode); their token goes to ring slot
        `t % W`, and the token it replaces is first copied to the global region if admitted.
        Raises PoolExhaustedError (cache unchanged) when the pages do not fit.
        """
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(rows.numel(), -1)
        num_tokens = positions.shape[1]
        is_ring = self.rings.has_ring(rows)
        if bool(is_ring.any()) and num_tokens != 1:
            raise ValueError("requests with a local ring append one token per step")
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("a request row appears twice in one append")
        layers, batch, heads = self.num_layers, rows.numel(), self.num_kv_heads
        counts = self._append_counts(rows, num_tokens)
        overwritten = self._ring_overwrites(rows, positions)
        self._unshare_before_growing(rows, counts, overwritten)
        starts = self._grow(rows, counts)  # [L, B, H] first new global entry
        ps = self.page_size

        # Global entries: token j of (l, b, h) is entry starts + j.
        entries = starts.unsqueeze(-1) + torch.arange(num_tokens)  # [L, B, H, n]
        l_idx = torch.arange(layers).view(-1, 1, 1, 1)
        r_idx = rows.view(1, -1, 1, 1)
        h_idx = torch.arange(heads).view(1, 1, -1, 1)
        # Only the first `counts` tokens of a (layer, row, head) grow it (a ring row promotes 0 or 1, a sliding
        # layer grows until its window is full); the others index entry 0 and get their slots below.
        grows = torch.arange(num_tokens) < counts.unsqueeze(-1)
        safe_entries = torch.where(grows, entries, torch.zeros_like(entries))
        pages = self.block_tables[l_idx, r_idx, h_idx, torch.div(safe_entries, ps, rounding_mode="floor")]
        slots = pages.to(torch.int64) * ps + safe_entries % ps

        if bool(is_ring.any()):
            ring_b = is_ring.nonzero().reshape(-1)
            # The slots the rows' new tokens take; the new tokens are not admitted until `admit` says so.
            ring_slots = self.rings.take_slots(rows[ring_b])  # [L, Br, H, 1]
            promote = counts[:, ring_b].bool()  # [L, Br, H]
            promote[self.sliding_layers] = False  # a sliding layer's own ring holds its window: no local ring there
            if bool(promote.any()):
                src = ring_slots[..., 0][promote].to(self.device)
                dst = slots[:, ring_b, :, 0][promote].to(self.device)
                self._copy_slots(src, dst, disjoint=True)  # ring pages and global pages never coincide
            slots[:, ring_b] = ring_slots

        if self.has_sliding_layers:
            slots[self.sliding_layers] = self._sliding_slots(rows, positions)
        device_slots = slots.to(self.device)
        token_pos = positions.view(1, batch, 1, num_tokens).expand(layers, batch, heads, num_tokens)
        written = device_slots.reshape(-1)
        token_pos = token_pos.reshape(-1).to(device=self.device, dtype=torch.int32)
        if self.has_sliding_layers:
            kept = written >= 0
            written, token_pos = written[kept], token_pos[kept]
        self.pool.positions.view(-1)[written] = token_pos
        return device_slots

    def _sliding_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots `[Ls, B, H, n]` of an append's tokens in the sliding layers (after `_grow`): token t at entry
        `t % W`; -1 for a token a later token of the same append replaces (it is never attended from the cache)."""
        windows = self.layer_windows[self.sliding_layers].view(-1, 1, 1, 1)
        entries = positions.view(1, rows.numel(), 1, -1) % windows  # [Ls, B, 1, n]
        superseded = positions.view(1, rows.numel(), 1, -1) <= positions[:, -1:].view(1, -1, 1, 1) - windows
        entries = entries.expand(-1, -1, self.num_kv_heads, -1)
        layer_index = self.sliding_layers.view(-1, 1, 1, 1)
        pages = self.block_tables[
            layer_index,
            rows.view(1, -1, 1, 1),
            torch.arange(self.num_kv_heads).view(1, 1, -1, 1),
            torch.div(entries, self.page_size, rounding_mode="floor"),
        ].to(torch.int64)
        slots = pages * self.page_size + entries % self.page_size
        return slots.masked_fill(superseded.expand_as(slots), -1)

    def _ring_overwrites(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Shared pages an append overwrites in place in sliding layers (entries below the current length)."""
        if not self.has_sliding_layers or self.pool.num_shared == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty, empty
        sliding = self.sliding_layers
        windows = self.layer_windows[sliding].view(-1, 1, 1, 1)
        lens = self.seq_lens[sliding][:, rows].to(torch.int64).unsqueeze(-1)  # [Ls, B, H, 1]
        entries = (positions.view(1, rows.numel(), 1, -1) % windows).expand(-1, -1, self.num_kv_heads, -1)
        live = positions.view(1, rows.numel(), 1, -1) > positions[:, -1:].view(1, -1, 1, 1) - windows
        into = (entries < lens) & live
        l_idx, b_idx, h_idx, n_idx = into.nonzero().unbind(-1)
        p_idx = torch.div(entries[l_idx, b_idx, h_idx, n_idx], self.page_size, rounding_mode="floor")
        return self._shared_cells(sliding[l_idx], rows[b_idx], h_idx, p_idx)

    def append_layer_slots(self, layer: int, row: int, positions: torch.Tensor) -> torch.Tensor:
        """Reserve slots for `n` new tokens in every KV head of one layer of one row; `[H, n]` slots.

        Layer-wise prefill compression allocates a layer's pages only when the forward pass reaches
        it, after the earlier layers have been compressed, so the full prompt KV of all layers never
        coexists. Rows with a local ring are refused (their prompt goes through `start_ring`).
        Raises PoolExhaustedError (cache unchanged) when the pages do not fit.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if int(self.rings.window[row]):
            raise ValueError("requests with a local ring cannot append layer by layer")
        if int(self.layer_windows[layer]):
            raise ValueError("a sliding-window layer's ring cannot be appended to layer by layer")
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        num_tokens = positions.numel()
        rows = torch.tensor([row], dtype=torch.int64)
        counts = torch.zeros((self.num_layers, 1, self.num_kv_heads), dtype=torch.int64)
        counts[layer] = num_tokens
        self._unshare_before_growing(rows, counts)
        starts = self._grow(rows, counts)[layer, 0]  # [H]
        ps = self.page_size
        entries = starts.unsqueeze(-1) + torch.arange(num_tokens)  # [H, n]
        pages = self.block_tables[layer, row].gather(-1, torch.div(entries, ps, rounding_mode="floor"))
        slots = (pages.to(torch.int64) * ps + entries % ps).to(self.device)
        self.pool.positions.view(-1)[slots.reshape(-1)] = (
            positions.expand(self.num_kv_heads, -1).reshape(-1).to(device=self.device, dtype=torch.int32)
        )
        return slots

    def _unshare_before_growing(
        self, rows: torch.Tensor, counts: torch.Tensor, overwritten: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        """Copy-on-write of the shared pages an append writes into (partial last pages, and the pages sliding
        layers overwrite, `overwritten`); PoolExhaustedError (nothing changed) when those copies and the
        append's new pages do not fit together."""
        cells = self._tail_cells(rows, counts)
        if overwritten is not None and overwritten[0].numel():
            cells = self._distinct_cells(tuple(torch.cat([a, b]) for a, b in zip(cells, overwritten, strict=True)))
        if cells[0].numel() == 0:
            return
        lens = self.seq_lens[:, rows].to(torch.int64)
        growth = int((_ceil_div(lens + counts, self.page_size) - _ceil_div(lens, self.page_size)).sum())
        needed = growth + cells[0].numel()
        if needed > self.pool.num_free:
            raise PoolExhaustedError(needed, self.pool.num_free)
        self._unshare(cells)

    def _grow(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Add `counts[L, B, H]` global entries to each (l, rows[b], h); return their first entry index."""
        ps = self.page_size
        lens = self.seq_lens[:, rows].to(torch.int64)
        new_lens = lens + counts
        have = _ceil_div(lens, ps)
        need = _ceil_div(new_lens, ps)
        delta = (need - have).reshape(-1)
        total = int(delta.sum())
        if total > self.pool.num_free:
            raise PoolExhaustedError(total, self.pool.num_free)
        if total:
            self._ensure_table_width(int(need.max()))
            pages = self.pool.allocate(total)
            group, page_index = _ranges(have.reshape(-1), delta)
            _layers, batch, heads = lens.shape
            l_idx = group // (batch * heads)
            r_idx = rows[(group // heads) % batch]
            h_idx = group % heads
            self._write_table(l_idx, r_idx, h_idx, page_index, pages.to(torch.int32))
        self._write_lens(rows, new_lens)
        if total:
            self._note_peak(rows)
        return lens

    def _pages_held(self, rows: torch.Tensor) -> torch.Tensor:
        """Pages held by each row `[B]`: global pages (partial last pages whole) plus ring pages."""
        global_pages = _ceil_div(self.seq_lens[:, rows].to(torch.int64), self.page_size).sum(dim=(0, 2))
        return global_pages + self.rings.pages_held(rows)

    def _note_peak(self, rows: torch.Tensor) -> None:
        self._peak_pages[rows] = torch.maximum(self._peak_pages[rows], self._pages_held(rows))

    def _ensure_table_width(self, width: int) -> None:
        current = self.block_tables.shape[-1]
        if width <= current:
            return
        new_width = max(width, 2 * current)
        pad = (0, new_width - current)
        self.block_tables = torch.nn.functional.pad(self.block_tables, pad, value=-1)
        if self._mirror:
            self.device_block_tables = torch.nn.functional.pad(self.device_block_tables, pad, value=-1)
        else:
            self.device_block_tables = self.block_tables

    def _write_table(
        self, l_idx: torch.Tensor, r_idx: torch.Tensor, h_idx: torch.Tensor, p_idx: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.block_tables[l_idx, r_idx, h_idx, p_idx] = values
        if self._mirror:
            dev = self.device
            self.device_block_tables[l_idx.to(dev), r_idx.to(dev), h_idx.to(dev), p_idx.to(dev)] = values.to(dev)

    def _write_lens(self, rows: torch.Tensor, lens: torch.Tensor, layers: torch.Tensor | None = None) -> None:
        """Set `seq_lens` of `rows` to `lens[L', B, H]`, L' = `layers` (default: every layer)."""
        if layers is None:
            self.seq_lens[:, rows] = lens.to(torch.int32)
            if self._mirror:
                self.device_seq_lens[:, rows.to(self.device)] = lens.to(device=self.device, dtype=torch.int32)
            return
        index = (layers.view(-1, 1), rows.view(1, -1))
        self.seq_lens[index] = lens.to(torch.int32)
        if self._mirror:
            dev = self.device
            self.device_seq_lens[layers.view(-1, 1).to(dev), rows.view(1, -1).to(dev)] = lens.to(
                device=dev, dtype=torch.int32
            )

    # ------------------------------------------------------------------ data

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `keys`/`values` (`[..., head_dim]`) at flat `slots` (`[...]`, from `append_slots`).

        Runs `attention.ops.write_kv`: the Triton kernel for a CUDA pool, the torch reference otherwise.
        """
        if keys.shape != values.shape or keys.shape[:-1] != slots.shape:
            raise ValueError(
                f"write shapes disagree: slots {tuple(slots.shape)}, keys {tuple(keys.shape)}, "
                f"values {tuple(values.shape)}"
            )
        ops.write_kv(self.pool.kv, slots, keys.to(self.device), values.to(self.device))

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor, disjoint: bool = False) -> None:
        """Copy K, V and positions from flat slots `src` to `dst` (reads happen before writes).

        Runs `attention.ops.copy_slots` (kernel on a CUDA pool, reference otherwise). `disjoint` says no
        slot is both a source and a destination (eviction's tail-into-hole moves, ring promotions), which
        lets the kernel copy in one pass; order-preserving compaction must leave it False.
        """
        ops.copy_slots(self.pool.kv, self.pool.positions, src, dst, disjoint=disjoint)

    # ------------------------------------------------------------------ compaction

    def apply_keep_plan(self, request_id: Hashable, plan: KeepPlan, layers: list[int] | None = None) -> int:
        """Keep only the plan's entries of the request's global region; return the pages freed.

        Kept entries are packed, in order, into the head's first pages; the pages past the new
        length go back to the pool. No free page is needed, so this works on a full pool.
        `layers` (distinct, in any order) restricts the plan to those layers, plan row i covering
        `layers[i]`; the others are untouched. Layer-wise prefill compression uses it to compact a
        layer as soon as its forward pass is over, and to re-compress earlier layers.
        """
        row = self.row_of(request_id)
        layer_ids = self._layer_ids(layers)
        if bool((self.layer_windows[layer_ids] > 0).any()):
            raise InvalidPlanError("a keep plan cannot cover a sliding-window layer: its ring keeps its window")
        lens = self.seq_lens[layer_ids, row].to(torch.int64)  # [L', H]
        keep = plan.to_mask(lens)  # validates; raises before any change
        return self._compact(torch.tensor([row]), keep.unsqueeze(1), None if layers is None else layer_ids)

    def _layer_ids(self, layers: list[int] | None) -> torch.Tensor:
        if layers is None:
            return torch.arange(self.num_layers)
        ids = torch.as_tensor(layers, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0 or bool(((ids < 0) | (ids >= self.num_layers)).any()):
            raise InvalidPlanError(f"layers must be a non-empty list in [0, {self.num_layers}), got {layers}")
        if torch.unique(ids).numel() != ids.numel():
            raise InvalidPlanError(f"layers must be distinct, got {layers}")
        return ids

    def _compact(self, rows: torch.Tensor, keep: torch.Tensor, layers: torch.Tensor | None = None) -> int:
        """Order-preserving compaction of `keep[L', B, H, n]` (n >= every current length).

        Dimension 0 of `keep` covers `layers` (default: every layer, in order).
        """
        layer_ids = torch.arange(self.num_layers) if layers is None else layers
        lens = self.seq_lens[layer_ids][:, rows].to(torch.int64)
        new_lens = keep.sum(-1)
        new_index = keep.cumsum(-1) - 1
        src_entry = keep.nonzero()  # [M, 4]: l (into layer_ids), b, h, e
        li, b_idx, h_idx, e = src_entry.unbind(-1)
        dst_e = new_index[li, b_idx, h_idx, e]
        moving = dst_e != e
        if bool(moving.any()):
            l_idx = layer_ids[li[moving]]
            r_idx = rows[b_idx[moving]]
            self._unshare_or_raise(
                self._shared_cells(
                    l_idx, r_idx, h_idx[moving], torch.div(dst_e[moving], self.page_size, rounding_mode="floor")
                )
            )
            src = self._slot(l_idx, r_idx, h_idx[moving], e[moving])
            dst = self._slot(l_idx, r_idx, h_idx[moving], dst_e[moving])
            self._copy_slots(src.to(self.device), dst.to(self.device))
        return self._truncate(rows, lens, new_lens, layers)

    def _unshare_or_raise(self, cells: tuple[torch.Tensor, ...]) -> None:
        """Copy-on-write before entries move into shared pages (PoolExhaustedError, nothing changed, without room)."""
        if cells[0].numel() > self.pool.num_free:
            raise PoolExhaustedError(cells[0].numel(), self.pool.num_free)
        self._unshare(cells)

    def _slot(self, l_idx: torch.Tensor, r_idx: torch.Tensor, h_idx: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        page = self.block_tables[l_idx, r_idx, h_idx, torch.div(e, ps, rounding_mode="floor")].to(torch.int64)
        return page * ps + e % ps

    def _truncate(
        self, rows: torch.Tensor, lens: torch.Tensor, new_lens: torch.Tensor, layers: torch.Tensor | None = None
    ) -> int:
        """Shrink lengths `[L', B, H]` of `layers` (default: all) to `new_lens` and free the pages past them."""
        ps = self.page_size
        layer_ids = torch.arange(self.num_layers) if layers is None else layers
        have = _ceil_div(lens, ps).reshape(-1)
        keep_pages = _ceil_div(new_lens, ps).reshape(-1)
        group, page_index = _ranges(keep_pages, have - keep_pages)
        _layers, batch, heads = lens.shape
        l_idx = layer_ids[group // (batch * heads)]
        r_idx = rows[(group // heads) % batch]
        h_idx = group % heads
        freed = self.block_tables[l_idx, r_idx, h_idx, page_index].to(torch.int64)
        self.pool.free(freed)
        self._write_table(l_idx, r_idx, h_idx, page_index, torch.full_like(freed, -1, dtype=torch.int32))
        self._write_lens(rows, new_lens, layers)
        return freed.numel()

    def truncate_request(self, request_id: Hashable, end_position: int) -> int:
        """Drop every global entry at position `end_position` or later; return the page references dropped.

        Meant for a row forked from a longer one (a later turn attaching to part of an earlier turn's
        cache): those entries must form the tail of each (layer, head) list, as decode appends leave
        them when nothing was evicted after `end_position`, else `InvalidPlanError` and nothing changes.
        Pages past a head's new length lose this row's reference; a shared partial last page stays
        shared until the row writes into it (copy-on-write then).
        """
        row = self.row_of(request_id)
        if self.rings.pages_of(row).numel():
            raise InvalidPlanError("a row with a local ring cannot be truncated by position")
        positions, lens = self.entry_positions(request_id)
        if self.has_sliding_layers:
            wrapped = positions[self.sliding_layers].amax(dim=(1, 2)) >= self.layer_windows[self.sliding_layers]
            if bool(wrapped.any()):
                raise InvalidPlanError(
                    "a sliding-window layer has replaced tokens older than its window: it cannot be cut back"
                )
        late = positions >= end_position  # padding is -1: never late
        new_lens = lens - late.sum(-1)
        entry = torch.arange(positions.shape[-1])
        if bool((late != (entry >= new_lens.unsqueeze(-1)) & (entry < lens.unsqueeze(-1))).any()):
            raise InvalidPlanError(f"entries at position {end_position} or later are not the tail of every head")
        rows = torch.tensor([row])
        return self._truncate(rows, lens.unsqueeze(1), new_lens.unsqueeze(1))

    def evict(
        self,
        rows: torch.Tensor | list[int],
        layers: torch.Tensor | list[int],
        heads: torch.Tensor | list[int],
        entries: torch.Tensor | list[int],
    ) -> int:
        """Drop global entries given as parallel (row, layer, head, entry) lists; return pages freed.

        Meant for decode-time eviction: the surviving entries past each head's new length move
        into the holes (order is not preserved; stored keys carry RoPE, so attention is unaffected,
        and stored positions travel with them), then whole trailing pages are freed.
        """
        r = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        ls = torch.as_tensor(layers, dtype=torch.int64).reshape(-1)
        hs = torch.as_tensor(heads, dtype=torch.int64).reshape(-1)
        es = torch.as_tensor(entries, dtype=torch.int64).reshape(-1)
        if not (r.numel() == ls.numel() == hs.numel() == es.numel()):
            raise InvalidPlanError("evict needs rows, layers, heads and entries of equal length")
        if r.numel() == 0:
            return 0
        active = torch.zeros(self.max_requests, dtype=torch.bool)
        active[list(self._row_of.values())] = True
        if bool(((r < 0) | (r >= self.max_requests)).any()) or not bool(
            active[r.clamp(0, self.max_requests - 1)].all()
        ):
            raise InvalidPlanError("evict names a request row that is not in use")
        if bool(((ls < 0) | (ls >= self.num_layers) | (hs < 0) | (hs >= self.num_kv_heads)).any()):
            raise InvalidPlanError("evict names a layer or head out of range")
        if bool((self.layer_windows[ls] > 0).any()):
            raise InvalidPlanError("evict names a sliding-window layer: its ring keeps its window")
        lens = self.seq_lens[ls, r, hs].to(torch.int64)
        if bool(((es < 0) | (es >= lens)).any()):
            bad = int(((es < 0) | (es >= lens)).nonzero()[0])
            raise InvalidPlanError(
                f"evict entry {int(es[bad])} out of range for row {int(r[bad])} layer {int(ls[bad])} "
                f"head {int(hs[bad])} (length {int(lens[bad])})"
            )
        # One integer key per (row, layer, head, entry) to sort and compare.
        stride_e = int(self.seq_lens.max()) + 1
        group = (ls * self.max_requests + r) * self.num_kv_heads + hs
        key = group * stride_e + es
        key, order = torch.sort(key)
        if bool((key[1:] == key[:-1]).any()):
            raise InvalidPlanError("evict names the same entry twice")
        group, r, ls, hs, es = group[order], r[order], ls[order], hs[order], es[order]

        uniq_group, drop_group, dropped = torch.unique_consecutive(group, return_inverse=True, return_counts=True)
        g_first = torch.cumsum(dropped, 0) - dropped
        g_r, g_l, g_h = r[g_first], ls[g_first], hs[g_first]
        g_len = self.seq_lens[g_l, g_r, g_h].to(torch.int64)
        g_new = g_len - dropped
        # Holes: dropped entries below the new length. Sources: kept entries at or above it.
        hole = es < g_new[drop_group]
        tail_group, tail_e = _ranges(g_new, dropped)
        tail_key = uniq_group[tail_group] * stride_e + tail_e
        tail_kept = ~torch.isin(tail_key, key)
        src_g, src_e = tail_group[tail_kept], tail_e[tail_kept]
        dst_g = drop_group[hole]
        dst_e = es[hole]
        if src_e.numel():
            holes = torch.div(dst_e, self.page_size, rounding_mode="floor")
            self._unshare_or_raise(self._shared_cells(g_l[dst_g], g_r[dst_g], g_h[dst_g], holes))
            src = self._slot(g_l[src_g], g_r[src_g], g_h[src_g], src_e)
            dst = self._slot(g_l[dst_g], g_r[dst_g], g_h[dst_g], dst_e)
            # Sources lie at or past each head's new length, holes below it: never the same slot.
            self._copy_slots(src.to(self.device), dst.to(self.device), disjoint=True)
        # Truncate each touched (l, r, h): free pages past the new length.
        ps = self.page_size
        have, keep_pages = _ceil_div(g_len, ps), _ceil_div(g_new, ps)
        pg, page_index = _ranges(keep_pages, have - keep_pages)
        freed = self.block_tables[g_l[pg], g_r[pg], g_h[pg], page_index].to(torch.int64)
        self.pool.free(freed)
        self._write_table(g_l[pg], g_r[pg], g_h[pg], page_index, torch.full_like(freed, -1, dtype=torch.int32))
        self.seq_lens[g_l, g_r, g_h] = g_new.to(torch.int32)
        if self._mirror:
            dev = self.device
            self.device_seq_lens[g_l.to(dev), g_r.to(dev), g_h.to(dev)] = g_new.to(device=dev, dtype=torch.int32)
        return freed.numel()

    # ------------------------------------------------------------------ local ring

    def start_ring(self, request_id: Hashable, window: int, admitted: torch.Tensor) -> int:
        """Turn a freshly prefilled request into local ring + global cache; return pages freed (net).

        `admitted[L, H, n]` flags every prompt token (n = prompt length). Each head's global region
        holds prompt entries in position order: the whole prompt, or (after a chunked prefill that
        dropped what its gates did not admit, `drop_unadmitted`) any subset of it that ends with the
        last min(n, W) tokens. Those move into the ring (token t at ring slot t % W) with their flags;
        older tokens stay in the global region only if admitted. From then on each decode token
        enters the ring, and the token it overwrites is promoted to the global region only if its
        flag is set (lazy promotion). On a model with sliding-window layers only the global layers get a
        local ring: a sliding layer's own ring already holds its window, and its flags are ignored.
        """
        row = self.row_of(request_id)
        ps = self.page_size
        if window <= 0 or window % ps:
            raise ValueError(f"ring window must be a positive multiple of page_size {ps}, got {window}")
        if int(self.rings.window[row]):
            raise ValueError(f"request {request_id!r} already has a ring")
        ringed = self.global_layers
        all_positions, all_lens = self.entry_positions(request_id)  # [L, H, N], [L, H]
        positions, lens = all_positions[ringed], all_lens[ringed]
        n = int(positions.max()) + 1 if positions.numel() else 0
        if admitted.shape != (self.num_layers, self.num_kv_heads, n) or admitted.dtype != torch.bool:
            raise InvalidPlanError(
                f"admitted must be bool [L, H, n] = {(self.num_layers, self.num_kv_heads, n)}, "
                f"got {admitted.dtype} {tuple(admitted.shape)}"
            )
        admitted = admitted.cpu()[ringed]
        in_ring = min(n, window)
        # The ring's tokens are each head's last `in_ring` entries: positions n - in_ring .. n - 1.
        tail = lens.unsqueeze(-1) - in_ring + torch.arange(in_ring)  # [Lg, H, m] entry indices
        if bool((tail < 0).any()) or not bool(
            (positions.gather(-1, tail.clamp(min=0)) == torch.arange(n - in_ring, n)).all()
        ):
            raise InvalidPlanError(
                f"start_ring needs the last {in_ring} prompt tokens, in order, at the end of every head"
            )
        ring_pages_per_head = window // ps
        valid = positions >= 0
        older = valid & (positions < n - in_ring)
        keep = older & admitted.gather(-1, positions.clamp(min=0))
        pages_after_compaction = int(_ceil_div(keep.sum(-1), ps).sum())
        layers, heads = ringed.numel(), self.num_kv_heads
        pages_needed = layers * heads * ring_pages_per_head
        available = self.pool.num_free + int(_ceil_div(lens, ps).sum()) - pages_after_compaction
        if pages_needed > available:
            raise PoolExhaustedError(pages_needed, available)

        # Read the ring's tokens before compaction can overwrite them.
        e = torch.arange(n - in_ring, n)  # the ring's positions
        l_idx = ringed.view(-1, 1, 1).expand(layers, heads, in_ring)
        h_idx = torch.arange(heads).view(1, -1, 1).expand(layers, heads, in_ring)
        src = self._slot(l_idx, torch.full_like(l_idx, row), h_idx, tail).reshape(-1).to(self.device)
        src_page, src_off = torch.div(src, ps, rounding_mode="floor"), src % ps
        ring_kv = self.pool.kv[src_page, :, src_off].clone()
        ring_pos = self.pool.positions[src_page, src_off].clone()

        self._compact(torch.tensor([row]), keep.unsqueeze(1), ringed)

        pages = self.pool.allocate(pages_needed).view(layers, heads, ring_pages_per_head)
        ring_slot = e.view(1, 1, -1).expand(layers, heads, in_ring) % window  # [Lg, H, m]
        local_l = torch.arange(layers).view(-1, 1, 1).expand(layers, heads, in_ring)
        dst_page = pages[local_l, h_idx, torch.div(ring_slot, ps, rounding_mode="floor")]
        dst = (dst_page * ps + ring_slot % ps).reshape(-1).to(self.device)
        ops.write_kv(self.pool.kv, dst, ring_kv[:, 0], ring_kv[:, 1], self.pool.positions, ring_pos)
        self.rings.install(row, ringed, pages, window, n, admitted[..., n - in_ring :])
        self._note_peak(torch.tensor([row]))
        return int(_ceil_div(lens, ps).sum()) - pages_after_compaction - pages_needed

    def drop_unadmitted(self, request_id: Hashable, window: int, admitted: torch.Tensor) -> int:
        """Between prefill chunks: keep the admitted entries and the last `window` tokens; return pages freed.

        `admitted[L, H, n]` flags prompt positions 0..n-1, the prefix prefilled so far. An entry at
        position p stays iff `admitted[l, h, p]` or `p >= n - window`: what the rest of the prompt can
        still attend to under the vertical-slash mask (the band reaches back `window - 1` tokens from
        the next query, n), and everything `start_ring` will keep. Order is preserved.
        """
        positions, _ = self.entry_positions(request_id)
        n = admitted.shape[-1]
        if admitted.dtype != torch.bool or admitted.shape[:2] != (self.num_layers, self.num_kv_heads):
            raise InvalidPlanError(f"admitted must be bool [L, H, n], got {admitted.dtype} {tuple(admitted.shape)}")
        if positions.numel() and int(positions.max()) >= n:
            raise InvalidPlanError(
                f"admitted covers {n} positions, but the request holds position {int(positions.max())}"
            )
        ringed = self.global_layers  # a sliding layer's own ring holds just its window
        positions = positions[ringed]
        valid = positions >= 0
        keep = valid & ((positions >= n - window) | admitted.cpu()[ringed].gather(-1, positions.clamp(min=0)))
        if bool((keep == valid).all()):
            return 0
        return self.apply_keep_plan(request_id, KeepPlan.from_mask(keep), layers=ringed.tolist())

    # ------------------------------------------------------------------ reading back

    def gather(self, request_id: Hashable, layer: int, head: int, region: str = "global") -> tuple[torch.Tensor, ...]:
        """K `[n, d]`, V `[n, d]` and positions `[n]` of one (layer, head) region, in storage order."""
        row = self.row_of(request_id)
        ps = self.page_size
        if region == "global":
            n = int(self.seq_lens[layer, row, head])
            pages = self.block_tables[layer, row, head]
        elif region == "ring":
            n = int(self.rings.lens([row])[0])
            pages = self.rings.tables[layer, row, head]
        else:
            raise ValueError(f"region must be 'global' or 'ring', got {region!r}")
        e = torch.arange(n)
        page = pages[torch.div(e, ps, rounding_mode="floor")].to(torch.int64).to(self.device)
        off = (e % ps).to(self.device)
        kv = self.pool.kv[page, :, off]
        return kv[:, 0], kv[:, 1], self.pool.positions[page, off]

    def gather_layer(self, request_id: Hashable, layer: int) -> tuple[torch.Tensor, ...]:
        """Global region of one layer, padded: K, V `[H, N, d]`, positions `[H, N]` (-1 as padding), lengths `[H]`."""
        row = self.row_of(request_id)
        lens = self.device_seq_lens[layer, row]
        keys, values, positions, valid = gather_paged(
            self.pool.kv, self.pool.positions, self.device_block_tables[layer, row], lens
        )
        return keys, values, positions.masked_fill(~valid, -1), lens

    def entry_positions(self, request_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of every global entry of a request, `[L, H, N]` (-1 as padding), and lengths `[L, H]`."""
        row = self.row_of(request_id)
        lens = self.seq_lens[:, row].to(torch.int64)
        n = int(lens.max()) if lens.numel() else 0
        e = torch.arange(n)
        valid = e < lens.unsqueeze(-1)
        pages = (
            self.block_tables[:, row]
            .to(torch.int64)
            .gather(-1, torch.div(e, self.page_size, rounding_mode="floor").expand(*lens.shape, n))
        )
        slots = torch.where(valid, pages * self.page_size + e % self.page_size, torch.zeros_like(pages))
        positions = self.pool.positions.view(-1)[slots.to(self.device)].cpu().to(torch.int64)
        return positions.masked_fill(~valid, -1), lens

    def ring_positions(self, request_id: Hashable) -> torch.Tensor:
        """Positions of the valid local-ring entries of a request, `[L, H, ring_len]` (ring_len 0 without a ring;
        -1 throughout a layer without one, a sliding-window layer).

        Ring slots are not kept in position order (token t sits at slot t % W); the order here is slot order.
        """
        return self.rings.positions(self.row_of(request_id), self.pool.positions)

    # ------------------------------------------------------------------ accounting

    def usage(self, request_id: Hashable) -> CacheUsage:
        return self.usages([request_id])[0]

    def usages(self, request_ids: Sequence[Hashable]) -> list[CacheUsage]:
        """`usage` of each request, in one pass over their rows (a served step reports every request's)."""
        if not request_ids:
            return []
        rows = torch.tensor([self.row_of(request_id) for request_id in request_ids], dtype=torch.int64)
        lens = self.seq_lens[:, rows].to(torch.int64).transpose(0, 1).contiguous()  # [R, L, H]
        rings = self.rings.tables[:, rows].transpose(0, 1)  # [R, L, H, Pr]
        pages = _ceil_div(lens, self.page_size).sum(dim=(1, 2)) + (rings >= 0).sum(dim=(1, 2, 3))
        ring_tokens = self.rings.lens(rows)
        ringed = (rings[:, :, 0, :1] >= 0).sum(dim=(1, 2))  # layers with a local ring (not sliding ones)
        tokens = lens.sum(dim=(1, 2)) + ring_tokens * ringed * self.num_kv_heads
        held = torch.cat([self.block_tables[:, rows].transpose(0, 1).flatten(1), rings.flatten(1)], dim=1)
        listed = held >= 0
        holders = self.pool.refcounts(held.clamp(min=0)).double()
        share = torch.where(listed, 1.0 / holders, 0.0).sum(dim=1)
        bytes_held = torch.round(share * self.pool.bytes_per_page)
        return [
            CacheUsage(
                pages=int(pages[i]),
                bytes=int(bytes_held[i]),
                tokens=int(tokens[i]),
                global_tokens=lens[i],
                ring_tokens=int(ring_tokens[i]),
            )
            for i in range(len(request_ids))
        ]

    def peak_pages(self, request_id: Hashable) -> int:
        """Most pages the request has held at once since it was added (exact: updated at every allocation)."""
        return int(self._peak_pages[self.row_of(request_id)])

    def pages_per_head(self, request_id: Hashable) -> torch.Tensor:
        """Pages held per (layer, head) `[L, H]`, ring included."""
        row = self.row_of(request_id)
        return _ceil_div(self.seq_lens[:, row].to(torch.int64), self.page_size) + self.rings.pages_per_head(row)

    def pages_for_prompt(self, num_tokens: int) -> int:
        """Pages a fresh request needs to hold `num_tokens` uncompressed tokens in every layer and head
        (a sliding-window layer holds at most its window)."""
        held = torch.where(self.layer_windows > 0, self.layer_windows.clamp(max=num_tokens), num_tokens)
        return self.num_kv_heads * int(_ceil_div(held, self.page_size).sum())
