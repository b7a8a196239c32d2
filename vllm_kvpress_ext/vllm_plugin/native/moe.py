"""Mixture-of-experts layers of vLLM's model code on the plugin's CPU platform, in plain torch.

vLLM's `FusedMoE` picks its experts kernel by platform. On an out-of-tree platform it picks none
(`UnquantizedMoeBackend.OOT`: "OOT handles internally") and expects the platform to register its own
`UnquantizedFusedMoEMethod` (`CustomOp.register_oot`, the interface other out-of-tree platforms use), and
its default router calls `topk_softmax`, an op only vLLM's CUDA build has (no CPU kernel). So:

- `TorchExpertsMethod` is registered in place of vLLM's `UnquantizedFusedMoEMethod` in the worker process
  (`register`; never at import, so a process running vLLM's own platforms keeps vLLM's method). It runs
  the experts a step's tokens chose one expert at a time: each expert's tokens through its gate/up
  projection (`w13`, gate rows first, as vLLM stores them), SiLU-and-multiply, its down projection (`w2`),
  weighted by the router and summed per token;
- `FusedTopKRouter._compute_routing` computes the routing in torch on a CPU tensor (softmax or sigmoid over
  the router logits in fp32, the top k, renormalised when the model says so), vLLM's op elsewhere.

What runs: models whose MoE layers are plain top-k routed experts with SiLU (Qwen3-MoE, Mixtral:
`native.support.SUPPORTED_MOE`). Shared experts, grouped or biased routing (DeepSeek, Qwen2-MoE) and quantized experts
are refused at start (`vllm_plugin/config.py`). The loop over experts reads every chosen expert's weights
once per step, what a fused kernel reads too; it is not tuned further.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from vllm_kvpress_ext.vllm_plugin.patches import wrap


class TorchExpertsMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with the experts computed in torch (the weights stay as vLLM loaded them)."""

    # What `register_oot` names it: vLLM's class name, under which `CustomOp.__new__` finds the replacement.
    name = UnquantizedFusedMoEMethod.__name__

    @property
    def is_monolithic(self) -> bool:
        return False  # routing first (the router above), then `apply` with the chosen experts

    def forward_native(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        if shared_experts is not None or getattr(layer, "expert_map", None) is not None:
            raise NotImplementedError("shared experts and expert parallelism are not run on this platform")
        return routed_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)

    # The plugin's platform runs every custom op on its torch path; were one enabled, it would come here.
    forward_oot = forward_native


def routed_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over each token's chosen experts e = ids[t, k].

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows, then up rows); w2 `[E, H, I]`; topk_weights and ids `[T, k]`."""
    out = torch.zeros_like(x)
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_weights = topk_weights.reshape(-1).to(x.dtype)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    order = torch.argsort(flat_ids, stable=True)
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        chosen = order[start : start + count]
        start += count
        tokens = token_of[chosen]
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, down * flat_weights[chosen].unsqueeze(1))
    return out


def _torch_routing(original: Any) -> Any:
    def compute_routing(
        self: FusedTopKRouter,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        indices_type: torch.dtype | None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not router_logits.is_cpu:
            return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        logits = router_logits.float()
        if self.scoring_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        elif self.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            raise ValueError(f"unsupported MoE scoring function {self.scoring_func!r}")
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.to(indices_type or torch.int32)

    return compute_routing


def register() -> None:
    """Put `TorchExpertsMethod` and the torch routing in place in this process (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get(UnquantizedFusedMoEMethod.__name__) is not TorchExpertsMethod:
        UnquantizedFusedMoEMethod.register_oot(TorchExpertsMethod, name=UnquantizedFusedMoEMethod.__name__)
    wrap(FusedTopKRouter, "_compute_routing", _torch_routing, "native.moe")
