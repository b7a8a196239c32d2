"""Local rings: the last W tokens of every (layer, KV head) of a request served by an admission policy.

An admission policy (WG-KV) decides, token by token, which entries the global region keeps. The decision
is lazy: a token first lives in its request's local ring, at slot `t % W`, with an admission flag per
(layer, KV head); when a later token takes its slot, it moves to the global region if its flag is set
and is dropped otherwise (lazy promotion). `PagedKVCache` owns the pool and the global region and moves
the entries; this class is the rings' bookkeeping, for every request row at once:

- `window[R]`: each row's W, a whole number of pages (0 = no ring);
- `count[R]`: tokens that have passed through the ring (the next one takes slot `count % W`);
- `tables[L, R, H, Pr]`: the ring's page ids (-1 = none). A sliding-window layer has none: its global
  region is already a ring of its own window;
- `flags[L, R, H, Wmax]`: whether the token in a slot goes to the global region when it is overwritten.

The tables live on the CPU; on an accelerator `device_tables` mirrors them for the attention kernels.
Ring pages come from the cache's pool and count with the request's other pages.
"""

from __future__ import annotations

import torch


class LocalRings:
    """The local rings of a cache's request rows (see the module docstring)."""

    def __init__(
        self, num_layers: int, max_requests: int, num_kv_heads: int, page_size: int, device: torch.device
    ) -> None:
        shape = (num_layers, max_requests, num_kv_heads)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.device = device
        self.window = torch.zeros(max_requests, dtype=torch.int64)
        self.count = torch.zeros(max_requests, dtype=torch.int64)
        self.tables = torch.full((*shape, 0), -1, dtype=torch.int32)
        self.flags = torch.zeros((*shape, 0), dtype=torch.bool)
        self._mirror = device.type != "cpu"
        self.device_tables = self.tables.to(device) if self._mirror else self.tables

    def lens(self, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Valid entries per row: min(tokens seen, W); the valid slots are [0, len)."""
        rows_t = torch.arange(self.window.numel()) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
        return torch.minimum(self.count[rows_t], self.window[rows_t])

    def has_ring(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of `rows` have a ring, bool `[B]`."""
        return self.window[rows] > 0

    def pages_of(self, row: int) -> torch.Tensor:
        """The page ids a row's ring holds (int64, every layer and head)."""
        pages = self.tables[:, row]
        return pages[pages >= 0].to(torch.int64)

    def pages_held(self, rows: torch.Tensor) -> torch.Tensor:
        """Ring pages held by each row `[B]`."""
        return (self.tables[:, rows] >= 0).sum(dim=(0, 2, 3))

    def pages_per_head(self, row: int) -> torch.Tensor:
        """Ring pages per (layer, KV head) of a row `[L, H]`."""
        return (self.tables[:, row] >= 0).sum(-1)

    def clear(self, row: int) -> None:
        """Forget a row's ring (its pages were returned to the pool by the caller)."""
        self.tables[:, row] = -1
        self.flags[:, row] = False
        self.window[row] = 0
        self.count[row] = 0
        if self._mirror:
            self.device_tables[:, row] = -1

    def copy(self, parent: int, child: int, pages: torch.Tensor) -> None:
        """Give `child` the parent's ring on `pages`: copies of the parent's `pages_of(parent)`, in that order."""
        parent_pages = self.tables[:, parent]
        table = parent_pages.clone()
        table[parent_pages >= 0] = pages.to(torch.int32)
        self.tables[:, child] = table
        if self._mirror:
            self.device_tables[:, child] = table.to(self.device)
        self.flags[:, child] = self.flags[:, parent]
        self.window[child] = self.window[parent]
        self.count[child] = self.count[parent]

    def install(
        self, row: int, layers: torch.Tensor, pages: torch.Tensor, window: int, count: int, flags: torch.Tensor
    ) -> None:
        """Start a row's ring on `pages[Lr, H, W / page_size]` in `layers`, `count` tokens seen; `flags[Lr, H, m]`
        are the admission flags of its last m = min(count, W) tokens."""
        pages_per_head = window // self.page_size
        if self.tables.shape[-1] < pages_per_head:
            pad = pages_per_head - self.tables.shape[-1]
            self.tables = torch.nn.functional.pad(self.tables, (0, pad), value=-1)
            self.flags = torch.nn.functional.pad(self.flags, (0, pad * self.page_size), value=False)
            self.device_tables = self.tables.to(self.device) if self._mirror else self.tables
        self.tables[layers, row, :, :pages_per_head] = pages.to(torch.int32)
        if self._mirror:
            self.device_tables[layers, row, :, :pages_per_head] = pages.to(device=self.device, dtype=torch.int32)
        in_ring = flags.shape[-1]
        slots = torch.arange(count - in_ring, count) % window
        self.flags[:, row] = False
        self.flags[layers.view(-1, 1, 1), row, torch.arange(self.num_kv_heads).view(1, -1, 1), slots.view(1, 1, -1)] = (
            flags
        )
        self.window[row] = window
        self.count[row] = count

    def promotions(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether the next token of each of `rows` (all with a ring) pushes an admitted token out of its
        full ring into the global region, bool `[L, B, H]`."""
        window = self.window[rows]
        slot = self.count[rows] % window
        full = self.count[rows] >= window
        flags = self.flags[:, rows].gather(-1, slot.view(1, -1, 1, 1).expand(self.num_layers, -1, self.num_kv_heads, 1))
        return flags.squeeze(-1) & full.view(1, -1, 1)

    def take_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """The slots `[L, B, H, 1]` the next token of each of `rows` (all with a ring) overwrites, taken: its
        flags start unset (`admit` sets them) and the rows' counts move on. Read what those slots hold
        (`promotions`) before writing the token."""
        ps = self.page_size
        slot = self.count[rows] % self.window[rows]
        page_index = torch.div(slot, ps, rounding_mode="floor").view(1, -1, 1, 1)
        pages = self.tables[:, rows].gather(-1, page_index.expand(self.num_layers, -1, self.num_kv_heads, 1))
        self.flags[
            torch.arange(self.num_layers).view(-1, 1, 1),
            rows.view(1, -1, 1),
            torch.arange(self.num_kv_heads).view(1, 1, -1),
            slot.view(1, -1, 1),
        ] = False
        self.count[rows] += 1
        return pages.to(torch.int64) * ps + (slot % ps).view(1, -1, 1, 1)

    def admit(self, layer: int, rows: torch.Tensor | list[int], flags: torch.Tensor) -> None:
        """Set the admission flags `[B, H]` of the token each of `rows` just appended in `layer`."""
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        window = self.window[rows]
        if bool((window <= 0).any()):
            raise ValueError("admission flags only apply to requests with a local ring")
        if flags.shape != (rows.numel(), self.num_kv_heads):
            raise ValueError(f"flags must be [B, H] = {(rows.numel(), self.num_kv_heads)}, got {tuple(flags.shape)}")
        slot = (self.count[rows] - 1) % window
        self.flags[layer, rows.view(-1, 1), torch.arange(self.num_kv_heads).view(1, -1), slot.view(-1, 1)] = flags.to(
            device="cpu", dtype=torch.bool
        )

    def positions(self, row: int, pool_positions: torch.Tensor) -> torch.Tensor:
        """Positions of a row's valid ring entries `[L, H, len]`, read from the pool's `pool_positions`, in
        slot order (token t at slot t % W); -1 throughout a layer without a ring (a sliding-window layer)."""
        n = int(self.lens([row])[0])
        e = torch.arange(n)
        tables = self.tables[:, row].to(torch.int64)  # [L, H, Pr]
        pages = tables.gather(-1, torch.div(e, self.page_size, rounding_mode="floor").expand(*tables.shape[:2], n))
        slots = (pages * self.page_size + e % self.page_size).clamp(min=0)
        positions = pool_positions.view(-1)[slots.to(pool_positions.device)].cpu().to(torch.int64)
        return positions.masked_fill(pages < 0, -1)
