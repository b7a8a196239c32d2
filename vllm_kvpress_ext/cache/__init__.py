"""The paged per-head KV cache: one page pool, ragged block tables, local rings, compaction."""

from vllm_kvpress_ext.cache.manager import CacheUsage, PagedKVCache, RequestCapacityError
from vllm_kvpress_ext.cache.plan import InvalidPlanError, KeepPlan
from vllm_kvpress_ext.cache.pool import PagePool, PoolExhaustedError

__all__ = [
    "CacheUsage",
    "InvalidPlanError",
    "KeepPlan",
    "PagePool",
    "PagedKVCache",
    "PoolExhaustedError",
    "RequestCapacityError",
]
