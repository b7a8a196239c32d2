"""`kvzip`: keep the entries the model needs to reconstruct its context, whatever the question will be.

Paper: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (NeurIPS
2025, arXiv 2505.23416); reference code: the authors' KVzip repository and NVIDIA kvpress's
`KVzipPress` (0.5.x).

Equations, for a prompt of n cached entries, layers l, KV heads g with query heads h in g, chunks
[s, e) of C tokens (`chunk_size`) and S sink entries (`sink_tokens`):

    input_c      = "Repeat the previous context exactly." (chunk 0), or "Repeat the part of the previous
                   context exactly, starting with" + the last O tokens before s (`overlap_tokens`),
                   then the chat template's answer header, then tokens[s:e]
    forward      input_c at positions n, n + 1, ...; its queries attend to the whole cached prompt and
                 causally to input_c's own keys (the prompt's cache is read, never extended)
    A_c[l,h,i,j] = softmax over K_c = {0..S-1} U {s..e-1} U {input_c's keys <= i} of q_i . k_j / sqrt(d)
    score[l,g,j] = max over queries i of input_c and h in g of A_c[l,h,i,j]     (j in [s, e))
    score[l,g,j] = +inf for j < S                                               (sinks always kept)
    keep         = the B_total highest scores over every (layer, KV head, entry) at once
                   (`allocation="global"`, the paper's non-uniform head budgets), with
                   B_total = L * H * B and B = entries per (layer, KV head) from `ratio` / `tokens`

No question is needed: the reconstruction stands in for every future query, so a context can be
compressed before the question exists (kvpress's question-agnostic protocol). The pass itself lives in
the engine (`engine/reconstruction.py`, run by the model runner when the prefill completes): chunk by
chunk, with each chunk's K/V transient, about one more prefill of compute.

Defaults: chunk_size 2048, overlap_tokens 8 (both reference codes), sink_tokens 4 (kvpress's n_sink),
allocation "global" (both reference codes' default). Budget: ratio 0.25 (this project's default for
ratio-budgeted policies; the paper reports ratios 0.1 to 1), or `tokens`.

Divergences:
- Every cached entry is reconstructed and scored, the prompt's chat-template header included. kvpress
  repeats only the context after that header, whose entries past the sinks then score 0 and go first;
  the authors' code keeps the system prompt as its sinks. Here the header competes on its own scores;
  `skip_header=True` is kvpress's way, for parity (`kvpress bench kvpress-parity`): the reconstruction
  starts after as many tokens as the template's text before a user message has (kvpress does not check
  that the prompt opens with it, so on a plain-text prompt its first tokens go unscored).
- Budget arithmetic follows this project (`policies/base.py`): `ratio` keeps L * H * round(ratio * n)
  entries in all; the references keep every score above the int(ratio * N)-th largest, so ties at the
  threshold can keep a few fewer. Ties here go to the lower (layer, head, entry) index.
- `allocation="layer"` (kvpress's `layerwise=True`: each layer H * B, heads free within it) and
  `allocation="head"` (the authors' uniform variant: every (layer, head) B) are one field away.
- Scores are float32 softmax probabilities (the authors' code runs the softmax in the model dtype).
- The context-independent head-level variant of the paper (scores per head, DuoAttention-style) is not
  implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    MAX_WINDOW,
    Budget,
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    check_choice,
    keep_top,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec, ReconstructionSpec

ALLOCATIONS = ("global", "layer", "head")


@dataclass
class KVzipPolicy(KVPolicy):
    """KVzip; equations, defaults and divergences in the module docstring."""

    name = "kvzip"
    decides_across_layers = True  # its global ranking spans the layers, and its pass runs the whole model
    question_agnostic = True
    summary = "entries scored by the attention they get while the model repeats its context (Kim et al. 2025)"
    limits: ClassVar[dict[str, tuple[float, float]]] = {
        "chunk_size": (1, MAX_WINDOW),
        "overlap_tokens": (0, 1024),
    }

    ratio: float | None = 0.25
    tokens: int | None = None
    chunk_size: int = 2048
    sink_tokens: int = 4
    overlap_tokens: int = 8
    allocation: str = "global"
    skip_header: bool = False

    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        self.budget.validate()
        if self.chunk_size < 1:
            raise PolicyConfigError(f"chunk_size must be >= 1 (tokens reconstructed per pass), got {self.chunk_size}")
        if self.sink_tokens < 0:
            raise PolicyConfigError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.overlap_tokens < 0:
            raise PolicyConfigError(f"overlap_tokens must be >= 0, got {self.overlap_tokens}")
        check_choice("allocation", self.allocation, ALLOCATIONS)

    def capture_spec(self) -> CaptureSpec:
        spec = ReconstructionSpec(self.chunk_size, self.sink_tokens, self.overlap_tokens, self.skip_header)
        return CaptureSpec(reconstruction=spec)

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        capture = layer.capture
        if capture is None or capture.reconstruction_scores is None:
            raise RuntimeError("kvzip needs the context-reconstruction scores; this runner did not compute them")
        scores = capture.reconstruction_scores
        if scores.shape != (layer.num_kv_heads, layer.length):
            raise RuntimeError(f"reconstruction scores {tuple(scores.shape)} do not cover the layer's entries")
        # Ranked across heads (and layers) on every tensor-parallel worker alike, each head's alone otherwise.
        return scores.cpu() if self.allocation == "head" else layer.all_heads(scores.cpu())

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(
            select(torch.stack(layer_results), self.budget.per_head(request.length), self.allocation)
        )


def select(scores: torch.Tensor, per_head: int, allocation: str) -> torch.Tensor:
    """Keep mask `[L, H, n]`: the best scores, `per_head` entries per (layer, head) on average.

    "global" ranks all L * H * n scores at once, "layer" each layer's H * n, "head" each head's n.
    """
    layers, heads, n = scores.shape
    rows = {"global": 1, "layer": layers, "head": layers * heads}[allocation]
    flat = scores.reshape(rows, -1)
    budget = torch.full((rows,), per_head * flat.shape[1] // n)
    return keep_top(flat, budget, torch.zeros_like(flat, dtype=torch.bool)).view(layers, heads, n)
