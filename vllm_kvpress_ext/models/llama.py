"""`LlamaFamilyForCausalLM`: one model class for Llama 2/3, Mistral, Qwen2, Qwen3 and Gemma 3 (text).

The families differ only in flags that `ModelConfig` already resolved (biases, q/k norm, head_dim,
RoPE scaling, tied embeddings; Gemma 3's norms, activation, embedding scale and second RoPE base), so a
single class covers them. It runs a flat varlen batch
of new tokens and leaves caching and attention to the `AttentionContext` it is given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn

from .base import AttentionContext
from .config import ModelConfig, RopeScaling
from .layers import DecoderLayer, norm
from .linear import Linear, linear
from .rope import RotaryEmbedding


class DecoderLayers(nn.ModuleList):
    """An `nn.ModuleList` whose items type-check as `DecoderLayer`.

    Policies reach into layers (`model.layers[l].self_attn.project_queries(...)`); with a plain
    ModuleList every such call would need a cast to pass mypy.
    """

    def __getitem__(self, idx: int) -> DecoderLayer:  # type: ignore[override]
        return cast(DecoderLayer, super().__getitem__(idx))

    def __iter__(self) -> Iterator[DecoderLayer]:
        return cast(Iterator[DecoderLayer], super().__iter__())


class LlamaFamilyForCausalLM(nn.Module):
    """Decoder-only LM with HF-compatible weights (names map by dropping HF's leading `model.`).

    With `tie_word_embeddings` there is no `lm_head`: logits reuse `embed_tokens.weight`, so the
    tie survives any later `.to()` and the checkpoint needs no `lm_head.weight`.

    `rotary` is the global layers' RoPE (the one policies rotate queries with: they compress global
    layers only); a model with `local_rope_theta` gives its sliding-window layers a second one.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary = (
            RotaryEmbedding(config.head_dim, config.local_rope_theta, RopeScaling())
            if config.local_rope_theta is not None
            else None
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(
            DecoderLayer(config, i, self._rotary_of(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = norm(config, config.hidden_size)
        self.lm_head: Linear | None = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext) -> Tensor:
        """Final hidden states [T, D] (after the final norm) for new tokens input_ids [T] at positions [T].

        Positions are absolute within each token's own sequence (they restart at 0 for every new
        sequence in the batch); cos/sin are computed once and shared by all layers.
        """
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:
            # In the weights' dtype, as Gemma was trained: sqrt(640) rounds to 25.25 in bf16.
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, dtype=hidden.dtype)
        local = self.local_rotary.cos_sin(positions, dtype=hidden.dtype) if self.local_rotary is not None else None
        for layer in self.layers:
            layer_cos, layer_sin = (cos, sin) if local is None or layer.self_attn.rotary is self.rotary else local
            hidden = layer(hidden, layer_cos, layer_sin, ctx)
        return self.norm(hidden)

    def _rotary_of(self, layer_idx: int) -> RotaryEmbedding:
        if self.local_rotary is not None and self.config.layer_sliding_window(layer_idx) is not None:
            return self.local_rotary
        return self.rotary

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [T, vocab] for final hidden states [T, D]; callers slice to the rows they sample."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
