"""Tensor and pipeline parallelism over the plugin's pool: what workers exchange so that they act as one.

vLLM's parallel model code gives each of N workers 1/N of every layer's query and KV heads, and each worker's
pool holds its own KV heads; pipeline stages hold consecutive layers. These must still agree across the workers,
and only these cross them (over vLLM's groups, on their CPU side: gloo), never a cache entry:

- **Decisions that cross heads.** A policy gathers its per-head scores, counts or statistics
  (`policies/base.HeadShard`), decides for every head as one worker would, and each worker keeps its heads'
  part. A layer's scores are `[heads, n]` floats: `n * heads * 4` bytes per layer per request.
- **A replicated head's query group.** With more workers than KV heads, vLLM replicates each head and gives each
  replica part of its query heads. Before a policy runs, the replicas join what they captured per query head
  (`join_replicas`: the window's queries, their moments, KVzip's scores, a decode step's attention), so each sees
  the whole group and they keep the same entries, those one worker keeps.
- **A policy's pass over the layers, across pipeline stages.** A policy that decides across layers scores each
  stage's layers after the stages before, from the state they relay, and plans on the last (`relay_stages`).
- **Which requests failed.** A request that fails on one worker (its pool ran out, a policy raised) is failed
  on every worker of every stage before any policy runs (`agree_on_failures`), so that all of them run the same
  requests' compressions, and their gathers pair up.
- **What the scheduler is told.** vLLM hands the scheduler one worker's output only; its pool report is made the
  tightest of all workers' (`merged_report`): the fewest free pages, the most pages any request needs next, and
  a request's KV figures summed over the workers that hold its heads. The reports are gathered over the
  engine's whole group, so pipeline stages, whose pools hold their own layers, are merged alike. A usual step
  moves numbers only (`report_numbers`); a step where something else changed moves the whole reports.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_kvpress_ext.policies.base import HeadShard
from vllm_kvpress_ext.vllm_plugin.report import PoolReport


@dataclass
class ExchangeStats:
    """What this worker's policies exchanged since it started (`kvpress bench tensor-parallel` reads it)."""

    gathers: int = 0
    bytes_sent: int = 0  # this worker's part of each gather
    seconds: float = 0.0


EXCHANGED = ExchangeStats()


def _group() -> Any:
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _stage_group() -> Any:
    """This worker and the workers of the other pipeline stages that hold the same heads."""
    from vllm.distributed import get_pp_group

    return get_pp_group()


def _engine_group() -> Any:
    """Every worker of this engine: its tensor-parallel workers of every pipeline stage."""
    from vllm.distributed import get_world_group

    return get_world_group()


def _gathered(local: torch.Tensor) -> list[torch.Tensor]:
    """Every worker's `local` (the same shape on each), in worker order, over the tensor-parallel group."""
    start = time.perf_counter()
    group = _group()
    local = local.detach().cpu()
    parts = [torch.empty_like(local) for _ in range(group.world_size)]
    dist.all_gather(parts, local.contiguous(), group=group.cpu_group)
    EXCHANGED.gathers += 1
    EXCHANGED.bytes_sent += local.numel() * local.element_size()
    EXCHANGED.seconds += time.perf_counter() - start
    return parts


def gather_heads(tensor: torch.Tensor, replicas: int = 1) -> torch.Tensor:
    """Every worker's `[heads, ...]` (the same shape on each) joined into `[all heads, ...]` in worker order, which
    is head order. Where `replicas` workers hold each head, their tensors are equal (`join_replicas` gave each the
    head's whole query group), and the first replica's stands for the head."""
    kind = tensor.dtype
    parts = _gathered(tensor.to(torch.uint8) if kind == torch.bool else tensor)  # gloo moves no bools
    return torch.cat(parts[::replicas], dim=0).to(kind).to(tensor.device)


def join_replicas(tensors: list[tuple[torch.Tensor, int]], replicas: int) -> list[torch.Tensor]:
    """Each `(tensor, dim)`, whose `dim` runs over this worker's query heads of its KV head, joined along `dim` with
    the same tensor of the other workers holding that head (vLLM gives each replica an equal, consecutive part of
    the head's query group): the whole group's, in query-head order. One gather for all of them, in the widest of
    their float types (float32 at least), which holds each of them exactly."""
    if not tensors:
        return []
    wide = functools.reduce(torch.promote_types, (tensor.dtype for tensor, _ in tensors), torch.float32)
    flat = torch.cat([tensor.detach().cpu().to(wide).reshape(-1) for tensor, _ in tensors])
    parts = _gathered(flat)
    first = int(_group().rank_in_group) // replicas * replicas
    group = parts[first : first + replicas]
    joined: list[torch.Tensor] = []
    offset = 0
    for tensor, dim in tensors:
        size = tensor.numel()
        pieces = [part[offset : offset + size].view(tensor.shape) for part in group]
        joined.append(torch.cat(pieces, dim=dim).to(dtype=tensor.dtype, device=tensor.device))
        offset += size
    return joined


def head_shard(size: int, num_kv_heads: int, total_kv_heads: int) -> HeadShard | None:
    """This worker's place among the model's `total_kv_heads` KV heads (`num_kv_heads` of them here) when `size`
    workers split them, or None on one worker. With more workers than KV heads, vLLM gives each worker one head,
    each head to `replicas` workers."""
    if size == 1:
        return None
    rank = int(_group().rank_in_group)
    if size > total_kv_heads:
        replicas = size // total_kv_heads
        gather = functools.partial(gather_heads, replicas=replicas)
        return HeadShard(rank // replicas, 1, total_kv_heads, gather, replicas=replicas)
    return HeadShard(rank * num_kv_heads, num_kv_heads, total_kv_heads, gather_heads)


def _all(value: Any, group: Any = None) -> list[Any]:
    group = group or _group()
    values: list[Any] = [None] * group.world_size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values


def agree_on_failures(failed: dict[str, str]) -> dict[str, str]:
    """The requests that failed on another worker of the engine (any tensor-parallel worker of any pipeline stage)
    this step and not here, with the reason given there."""
    group = _engine_group()
    counts = torch.tensor([len(failed)], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group.cpu_group)
    if int(counts) == 0:  # the usual step: one integer crossed, nothing failed anywhere
        return {}
    elsewhere: dict[str, str] = {}
    for other in _all(failed, group):
        for request_id, message in other.items():
            if request_id not in failed:
                elsewhere.setdefault(request_id, message)
    return elsewhere


def relay_stages(work: Callable[[Any], Any]) -> Any:
    """`work` run on each pipeline stage in turn, given what the stage before returned (None on the first); what
    the last stage's returned, on every stage (`engine/compression.StageRelay`). One object gather per stage."""
    group = _stage_group()
    carried = None
    for stage in range(group.world_size):
        # Pickled once here, so that its size is counted without pickling it again; the gather moves the bytes.
        mine = pickle.dumps(work(carried)) if stage == group.rank_in_group else b""
        start = time.perf_counter()  # the wait for the stages before counts: the exchange makes this stage wait
        carried = pickle.loads(_all(mine, group)[stage])
        EXCHANGED.seconds += time.perf_counter() - start
        EXCHANGED.gathers += 1
        EXCHANGED.bytes_sent += len(mine)
    return carried


def compressed_layers_per_stage(count: int) -> list[int]:
    """Every pipeline stage's number of compressed (not sliding-window) layers, in stage order."""
    return [int(n) for n in _all(count, _stage_group())]


_SUMMED = ("kv_bytes", "kv_bytes_peak", "kv_tokens_kept", "kv_tokens_full")


def _merged_figures(figures: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """One request's KV figures from every worker's: its heads are spread over them, so bytes and tokens add up
    (each head once, where `replicas` workers hold it); the workers compress side by side (the slowest one's time)
    and are preempted together."""
    merged = dict(figures[0])
    for name in _SUMMED:
        merged[name] = sum(f[name] for f in figures) // replicas
    full = merged["kv_tokens_full"]
    merged["kv_retention"] = round(merged["kv_tokens_kept"] / full, 6) if full else 1.0
    merged["compression_seconds"] = max(f["compression_seconds"] for f in figures)
    return merged


def merged_report(
    report: PoolReport, replicas: int = 1, kept_blocks: Callable[[], frozenset[int]] | None = None
) -> PoolReport:
    """`report` as the scheduler must read it: every worker's report gathered and merged (`merge_reports`).

    `report.prefix_blocks` says whether this worker's kept blocks changed since its last report, and `kept_blocks`
    gives all of them (asked only on a step where some worker's changed). A usual step moves numbers only: every
    worker's page counts and its requests' figures in one float tensor (`report_numbers`), after a few integers
    that show the workers hold the same requests and that nothing else changed. A step where a request failed, a
    worker's kept blocks changed, or the workers' requests differ gathers the whole reports instead (pickled
    objects, several times the cost).
    """
    group = _engine_group()
    shape = torch.tensor([_carries_objects(report), report.prefix_blocks is not None, _requests_signature(report)])
    shapes = [torch.empty_like(shape) for _ in range(group.world_size)]
    dist.all_gather(shapes, shape, group=group.cpu_group)
    everywhere = torch.stack(shapes)
    if everywhere[:, :2].any() or not bool((everywhere[:, 2] == shape[2]).all()):
        blocks_changed = bool(everywhere[:, 1].any())  # then each worker's whole set: they are intersected
        all_kept = kept_blocks() if blocks_changed and kept_blocks is not None else None
        sent = dataclasses.replace(report, prefix_blocks=all_kept)
        return merge_reports(_all(sent, group), replicas)
    numbers = report_numbers(report)
    parts = [torch.empty_like(numbers) for _ in range(group.world_size)]
    dist.all_gather(parts, numbers, group=group.cpu_group)
    return merge_reports([report_from_numbers(report, part) for part in parts], replicas)


def _carries_objects(report: PoolReport) -> bool:
    """Whether `report` holds anything `report_numbers` does not carry."""
    return bool(report.failed or report.prefix_keys or report.prefix_added or report.prefix_sessions) or (
        report.prefix_stats is not None
    )


def _requests_signature(report: PoolReport) -> int:
    """The running requests' ids, in order, as one integer: equal on workers that hold the same requests."""
    return zlib.crc32("\n".join(report.pages_held).encode())


_HEADER = 4  # pages_total, pages_free, prefix_evictable, compresses_layerwise
_FIGURES = ("kv_bytes", "kv_bytes_peak", "kv_tokens_kept", "kv_tokens_full", "kv_retention", "compression_seconds")
_FLOATS = ("kv_retention", "compression_seconds")
_PER_REQUEST = 2 + len(_FIGURES)  # pages held, decode pages, figures (-1 where absent)


def report_numbers(report: PoolReport) -> torch.Tensor:
    """The numbers in `report` that differ between tensor-parallel workers, as float64 (exact for integers below
    2**53), in the order of its requests (`pages_held`, which holds every running request)."""
    values: list[float] = [report.pages_total, report.pages_free, report.prefix_evictable, report.compresses_layerwise]
    for request_id, held in report.pages_held.items():
        figures = report.kv.get(request_id)
        values += [held, report.decode_pages.get(request_id, -1)]
        values += [figures[name] for name in _FIGURES] if figures is not None else [-1] * len(_FIGURES)
    return torch.tensor(values, dtype=torch.float64)


def report_from_numbers(local: PoolReport, numbers: torch.Tensor) -> PoolReport:
    """Another worker's report, from its `report_numbers` and this worker's `local` report of the same requests."""
    values = numbers.tolist()
    other = dataclasses.replace(
        local,
        pages_total=int(values[0]),
        pages_free=int(values[1]),
        prefix_evictable=int(values[2]),
        compresses_layerwise=bool(values[3]),
        prefix_blocks=None,  # numbers travel only when no worker's kept blocks changed
        pages_held={},
        decode_pages={},
        kv={},
    )
    for index, request_id in enumerate(local.pages_held):
        start = _HEADER + index * _PER_REQUEST
        held, decode, *figures = values[start : start + _PER_REQUEST]
        other.pages_held[request_id] = int(held)
        if decode >= 0:
            other.decode_pages[request_id] = int(decode)
        if figures[0] >= 0 and request_id in local.kv:
            numbers_of = {
                name: value if name in _FLOATS else int(value) for name, value in zip(_FIGURES, figures, strict=True)
            }
            other.kv[request_id] = {**local.kv[request_id], **numbers_of}
    return other


def merge_reports(reports: list[PoolReport], replicas: int = 1) -> PoolReport:
    """The workers' reports (the first is the one vLLM hands the scheduler) as one: the tightest worker's pool,
    every worker's failures, and each request's figures over all of its heads (`replicas` workers hold each)."""
    first = reports[0]
    merged = dataclasses.replace(first)
    merged.pages_total = min(r.pages_total for r in reports)
    merged.pages_free = min(r.pages_free for r in reports)
    # Pipeline stages may hold different numbers of layers: a prompt's pages are counted for the largest.
    merged.num_layers = max(r.num_layers for r in reports)
    merged.pages_per_token_block = max(r.pages_per_token_block for r in reports)
    merged.failed = {k: v for r in reversed(reports) for k, v in r.failed.items()}
    merged.pages_held = {k: max(r.pages_held.get(k, 0) for r in reports) for k in first.pages_held}
    merged.decode_pages = {k: max(r.decode_pages.get(k, 0) for r in reports) for k in first.decode_pages}
    merged.kv = {
        k: _merged_figures([r.kv[k] for r in reports], replicas) for k in first.kv if all(k in r.kv for r in reports)
    }
    merged.compresses_layerwise = all(r.compresses_layerwise for r in reports)
    merged.prefix_evictable = min(r.prefix_evictable for r in reports)
    if first.prefix_blocks is not None:
        # Each worker reports every block it keeps (`NativePool.report`): one is readable only where all keep it.
        merged.prefix_blocks = frozenset.intersection(*[r.prefix_blocks or frozenset() for r in reports])
    return merged
