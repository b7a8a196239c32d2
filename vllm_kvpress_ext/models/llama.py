"""`LlamaFamilyForCausalLM`: one model class for Llama 2/3, Mistral, Qwen2 and Qwen3.

The four families differ only in flags that `ModelConfig` already resolved (biases, q/k norm,
head_dim, RoPE scaling, tied embeddings), so a single class covers them. It runs a flat varlen batch
of new tokens and leaves caching and attention to the `AttentionContext` it is given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from torch import Tensor, nn

from .base import AttentionContext
from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm
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
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Linear | None = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext) -> Tensor:
        """Final hidden states [T, D] (after the final norm) for new tokens input_ids [T] at positions [T].

        Positions are absolute within each token's own sequence (they restart at 0 for every new
        sequence in the batch); cos/sin are computed once and shared by all layers.
        """
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, ctx)
        return self.norm(hidden)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [T, vocab] for final hidden states [T, D]; callers slice to the rows they sample."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
