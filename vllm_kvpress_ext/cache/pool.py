"""One page pool shared by every layer and KV head.

A page holds `page_size` tokens of a single (layer, KV head): keys and values side by side,
`kv[num_pages, 2, page_size, head_dim]`, plus the original token position of every slot
(`positions[num_pages, page_size]`). Because layers and heads draw from the same free list, a
policy that keeps 10 tokens in one head and 1000 in another pays for exactly what it keeps.

The free list is an int64 stack: allocating n pages pops n ids, freeing pushes them back, both
O(n) vectorised tensor ops with no Python loop. Every page carries a reference count: a page can be
held by several requests at once (the samples of one prompt share its compressed pages), `share`
adds a holder, `free` drops one, and a page returns to the free list when its last holder lets go.
Counts catch double frees and foreign ids before anything changes.
"""

from __future__ import annotations

import torch

from vllm_kvpress_ext.utils.huge_pages import huge_page_tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_KV_MEMORY = 1 << 30  # a pool's size where its owner is given none: 1 GiB


class PoolExhaustedError(RuntimeError):
    """Raised when an allocation asks for more pages than are free. Nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV page pool exhausted: {requested} pages requested, {free} free")
        self.requested = requested
        self.free = free


class PagePool:
    """Storage and free list for `num_pages` KV pages.

    The free list and bitmap live on the CPU (bookkeeping); K/V storage lives on `device`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        head_dim: int = 128,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype}; choose one of {SUPPORTED_DTYPES}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, 2, page_size, head_dim)
        # On the CPU every decode step reads much of the pool, in no particular order: 2 MB pages.
        cpu = self.device.type == "cpu"
        self.kv = huge_page_tensor(shape, dtype) if cpu else torch.zeros(shape, dtype=dtype, device=self.device)
        self.positions = torch.full((num_pages, page_size), -1, dtype=torch.int32, device=self.device)
        # Pages are handed out from the top of the stack; the initial order makes fresh pools
        # allocate 0, 1, 2, ... which keeps tests readable.
        self._free_stack = torch.arange(num_pages - 1, -1, -1, dtype=torch.int64)
        self._num_free = num_pages
        self._refs = torch.zeros(num_pages, dtype=torch.int32)  # holders of each page; 0 = free
        # Pages with more than one holder: 0 lets the cache skip its copy-on-write checks outright.
        self._num_shared = 0

    @staticmethod
    def bytes_per_page_for(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * page_size * head_dim * element

    @classmethod
    def pages_for_memory(cls, kv_bytes: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """How many pages fit in `kv_bytes` of K/V storage."""
        return kv_bytes // cls.bytes_per_page_for(page_size, head_dim, dtype)

    @property
    def bytes_per_page(self) -> int:
        """K and V bytes of one page (the position side-table is bookkeeping, not counted)."""
        return self.bytes_per_page_for(self.page_size, self.head_dim, self.dtype)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_shared(self) -> int:
        """Pages held by more than one holder."""
        return self._num_shared

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, count: int) -> torch.Tensor:
        """Pop `count` free page ids (int64, CPU), each with one holder. Raises PoolExhaustedError without side
        effects."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > self._num_free:
            raise PoolExhaustedError(count, self._num_free)
        top = self._num_free
        pages = self._free_stack[top - count : top].clone()
        self._num_free = top - count
        self._refs[pages] = 1
        return pages

    def share(self, pages: torch.Tensor) -> None:
        """Add one holder to each listed page (every one in use; an id listed twice gains two)."""
        uniq, times, _ = self._counted(pages, "sharing")
        before = int((self._refs[uniq] > 1).sum())
        self._refs[uniq] += times
        self._num_shared += int((self._refs[uniq] > 1).sum()) - before

    def free(self, pages: torch.Tensor) -> None:
        """Drop one holder of each listed page (an id listed k times drops k); pages left with none return to
        the pool. A page listed more times than it has holders, or not in use, changes nothing and raises."""
        uniq, times, first = self._counted(pages, "freeing")
        if bool((times > self._refs[uniq]).any()):
            raise ValueError("the same page id is freed twice in one call")
        before = int((self._refs[uniq] > 1).sum())
        self._refs[uniq] -= times
        self._num_shared += int((self._refs[uniq] > 1).sum()) - before
        # Pushed in the order they were listed: the last one listed is the next one handed out.
        released = uniq[torch.argsort(first)]
        released = released[self._refs[released] == 0]
        count = released.numel()
        self._free_stack[self._num_free : self._num_free + count] = released
        self._num_free += count

    def _counted(self, pages: torch.Tensor, doing: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(distinct ids, times each is listed, where each is first listed), after checking every id is in
        range and in use."""
        pages = pages.to(device="cpu", dtype=torch.int64).reshape(-1)
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            raise ValueError(f"page id out of range [0, {self.num_pages})")
        uniq, inverse, times = torch.unique(pages, return_inverse=True, return_counts=True)
        if not bool((self._refs[uniq] > 0).all()):
            raise ValueError(f"{doing} a page that is not in use (double free or foreign id)")
        first = torch.full((uniq.numel(),), pages.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(pages.numel()), reduce="amin")
        return uniq, times.to(torch.int32), first

    def refcounts(self, pages: torch.Tensor | None = None) -> torch.Tensor:
        """Holders of each listed page, or a copy of every page's (int32; 0 for a free page)."""
        return self._refs.clone() if pages is None else self._refs[pages.to(device="cpu", dtype=torch.int64)]

    def in_use_mask(self) -> torch.Tensor:
        """A copy of the in-use bitmap (for invariant checks)."""
        return self._refs > 0
