"""Every place where vLLM's runner needs something this platform must supply, in one module.

vLLM's CUDA wheel carries no CPU kernels (`vllm._C` does not load on a CPU build of torch), and its
runner reaches two of them outside the attention backend; a third replacement is for speed:

- `BlockTable.compute_slot_mapping` calls `_COMPUTE_SLOT_MAPPING_KERNEL`, a Triton kernel whose CPU
  fallback is `torch.ops._C.compute_slot_mapping_kernel_impl`. `slot_mapping` below is the same
  computation in torch: token t of request r, at position p, goes to slot
  `block_table[r, p // block_size] * block_size + p % block_size`; the slots past the batch are
  padded with -1.
- `Worker._maybe_get_memory_pool_context` asks for a sleep-mode allocator, which exists for CUDA and
  XPU only: on this platform there is nothing to pool, so weights and KV cache load plainly.
- vLLM's unquantized linear layers (and the vocabulary head) take their GEMM from
  `dispatch_unquantized_gemm`, which gives an out-of-tree platform `F.linear` (MKL's sgemm on a CPU).
  `projection` sends the CPU's to `models/linear.py`, the embedded engine's projection: oneDNN where
  it runs the dtype. Measured on SmolLM2-135M fp32, 16 requests of 256 + 32 tokens offline: the
  projections were 11.4 of 18.8 s with `F.linear`. Once the weights are loaded, `pack_projections`
  packs each projection's weight into oneDNN's blocked layout and drops the plain copy, as vLLM's
  CPU build does (`dispatch_cpu_unquantized_gemm`): a decode step's projections run 1.2x to 1.3x
  faster (`kvpress bench linear --head`), in the same memory. The vocabulary head keeps its plain
  weight too (the embedding may be the same tensor). As in vLLM's CPU build, weights cannot then be
  reloaded in place.

`install()` applies them once per process through `patches.wrap`, which checks that vLLM still has
what it replaces, so a vLLM release that moves one fails here, by name, instead of deep in a step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vllm_kvpress_ext.vllm_plugin.patches import wrap


def slot_mapping(
    num_reqs: int,
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    out: torch.Tensor,
    block_size: int,
    *context_parallel: Any,
) -> None:
    """`out[:num_tokens]` = the cache slot of each scheduled token; `out[num_tokens:max_num_tokens]` = -1."""
    if any(size != 1 for size in context_parallel[:1]):
        raise NotImplementedError("decode context parallelism is not supported on this platform")
    starts = query_start_loc[: num_reqs + 1].to(torch.int64)
    request = torch.repeat_interleave(torch.arange(num_reqs, device=out.device), starts[1:] - starts[:-1])
    token_positions = positions[:num_tokens].to(torch.int64)
    blocks = block_table[request, token_positions // block_size].to(torch.int64)
    out[:num_tokens] = blocks * block_size + token_positions % block_size
    out[num_tokens:max_num_tokens] = -1


class _SlotMappingKernel:
    """Stands where vLLM keeps its slot-mapping kernel object: callable, and warm-up registration a no-op."""

    def __init__(self, replaced: Any) -> None:
        self.replaced = replaced

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __call__(self, *args: Any) -> None:
        slot_mapping(*args)


def _no_memory_pool(self: Any, tag: str | None = None, **kwargs: Any) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


# The attribute of a vLLM layer holding its weight packed for oneDNN (`pack_projections`).
PACKED_WEIGHT = "kvpress_packed_weight"


def projection(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's unquantized GEMM signature, computed by the embedded engine's projection: from the layer's packed
    weight where `pack_projections` made one."""
    from vllm_kvpress_ext.models.linear import linear, packed_linear

    packed = layer.__dict__.get(PACKED_WEIGHT)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return linear(x, weight, bias)


def pack_projections(model: torch.nn.Module) -> int:
    """Pack the weight of every unquantized projection of `model` and of its vocabulary head for oneDNN
    (`models/linear.pack_weight`), dropping the projections' plain weights; returns how many were packed. A
    weight oneDNN cannot run here (its dtype on this CPU) stays as it is, for `linear`."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    from vllm_kvpress_ext.models.linear import pack_weight

    packed_count = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        head = isinstance(layer, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod)
        if not (head or isinstance(method, UnquantizedLinearMethod)):
            continue
        weight = layer.weight
        if not isinstance(weight, torch.Tensor):
            continue
        packed = pack_weight(weight)  # None for a meta tensor, or a dtype oneDNN does not run here
        if packed is None:
            continue
        layer.__dict__[PACKED_WEIGHT] = packed
        if not head:  # nothing else reads a projection's weight once it is packed: free it
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        packed_count += 1
    return packed_count


def _dispatch_projection(*args: Any, **kwargs: Any) -> Any:
    return projection


def install() -> None:
    """Apply the replacements above (idempotent)."""
    import vllm.model_executor.layers.linear as linear_layers
    import vllm.model_executor.layers.vocab_parallel_embedding as vocabulary
    import vllm.v1.worker.block_table as block_table
    from vllm.v1.worker.gpu_worker import Worker

    for module in (linear_layers, vocabulary):
        wrap(module, "dispatch_unquantized_gemm", lambda original: _dispatch_projection, "native.adapter")
    wrap(block_table, "_COMPUTE_SLOT_MAPPING_KERNEL", _SlotMappingKernel, "native.adapter")
    wrap(Worker, "_maybe_get_memory_pool_context", lambda original: _no_memory_pool, "native.adapter")
