"""`ModelConfig`: the few numbers the decoder's forward pass needs, parsed from an HF `config.json`.

Why our own dataclass instead of `transformers.PretrainedConfig`: the engine must not depend on how a
given transformers release spells things. `config.json` files in the wild come in two spellings:

- transformers < 5: `rope_theta` and `rope_scaling` (`{"type"|"rope_type": ..., "factor": ...}`) at top level;
- transformers >= 5: `rope_parameters` = `{"rope_type": ..., "rope_theta": ..., "factor": ...}`.

Both parse to the same `ModelConfig`. The per-family quirks (which projections carry a bias, Qwen3's
per-head q/k RMSNorm, Qwen3's default `head_dim` of 128, Qwen's `use_sliding_window` switch) are
resolved here, once, so the layers only see plain booleans and sizes.

Gemma 3 (text) is a Llama-shaped decoder with five differences, each a field here: RMSNorm weights
stored as an offset from 1 (`norm_offset`), a norm after attention and around the MLP as well
(`sandwich_norms`), GELU (tanh) in the MLP, embeddings scaled by sqrt(hidden_size), an attention scale
of `query_pre_attn_scalar ** -0.5`, and a RoPE base of its own for the sliding-window layers
(`local_rope_theta`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelConfigError, ModelFileNotFoundError, UnsupportedModelError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class _FamilyDefaults:
    """What an HF config class assumes when a key is absent from config.json.

    Mirrored so that a sparse config.json means the same here as in transformers.
    """

    model_type: str
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    head_dim: int | None  # None: hidden_size // num_attention_heads


_FAMILY_DEFAULTS: dict[str, _FamilyDefaults] = {
    "LlamaForCausalLM": _FamilyDefaults("llama", 2048, 1, 2, None),
    "MistralForCausalLM": _FamilyDefaults("mistral", 4096 * 32, 1, 2, None),
    "Qwen2ForCausalLM": _FamilyDefaults("qwen2", 32768, None, None, None),
    "Qwen3ForCausalLM": _FamilyDefaults("qwen3", 32768, None, None, 128),
    "Gemma3ForCausalLM": _FamilyDefaults("gemma3_text", 131072, 2, 1, 256),
}
#: The MLP activations the model code runs, by their HF names.
SUPPORTED_ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "silu": ("silu", "swish"),
    "gelu_pytorch_tanh": ("gelu_pytorch_tanh", "gelu_tanh"),
}
_DEFAULT_ROPE_THETA = 10_000.0
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for context extension.

    `rope_type` "default" leaves them alone, "linear" divides all of them by `factor` (position
    interpolation), "llama3" divides only the low frequencies by `factor` and blends the middle band
    (Llama 3.1). The other fields are only read by the types that use them.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"unsupported RoPE type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ModelConfigError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if self.high_freq_factor <= self.low_freq_factor:
                raise ModelConfigError(
                    "llama3 RoPE needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )
            if not self.original_max_position_embeddings or self.original_max_position_embeddings <= 0:
                raise ModelConfigError("llama3 RoPE needs a positive original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code reads from `config.json`, already resolved per family.

    `attention_bias` is the q/k/v projection bias; `o_proj_bias` is separate because Qwen2 biases
    q/k/v but not o, while Llama's `attention_bias` covers all four. `sliding_window` and
    `layer_types` are recorded for the engine: the model delegates attention to a context, so it is
    the context that must honour (or refuse) a window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight), in fp32 (Gemma)
    sandwich_norms: bool = False  # norms after attention and before and after the MLP (Gemma 3)
    embedding_multiplier: float | None = None  # embeddings times this, in the weights' dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # softmax scale is its inverse square root (Gemma)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base, where it differs (Gemma 3)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ModelConfigError(f"unknown layer type(s) {unknown}; known: {FULL_ATTENTION}, {SLIDING_ATTENTION}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelConfigError(f"sliding-window layers need a positive sliding_window, got {self.sliding_window}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ModelConfigError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")

    @property
    def model_type(self) -> str:
        """HF `model_type` of the architecture ("llama", "mistral", "qwen2", "qwen3")."""
        return _FAMILY_DEFAULTS[self.architecture].model_type

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size); query head h reads KV head h // num_kv_groups."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer, or None when it attends to its whole prefix."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's window (None: a global layer that attends to its whole prefix)."""
        return tuple(self.layer_sliding_window(i) for i in range(self.num_hidden_layers))

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar) where the model sets it."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Parse a `config.json` file; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise ModelFileNotFoundError(f"config.json not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse the dict of an HF `config.json` (either RoPE spelling), applying the family's defaults."""
        arch = _architecture(raw, source)
        defaults = _FAMILY_DEFAULTS[arch]
        hidden = _int(raw, "hidden_size", source)
        heads = _int(raw, "num_attention_heads", source)
        num_layers = _int(raw, "num_hidden_layers", source)
        gemma = arch == "Gemma3ForCausalLM"
        act = _activation(raw, gemma, source)

        head_dim = raw.get("head_dim") if raw.get("head_dim") is not None else defaults.head_dim
        if head_dim is None:
            if hidden % heads != 0:
                raise ModelConfigError(
                    f"{source}: no head_dim given and hidden_size ({hidden}) is not a multiple of "
                    f"num_attention_heads ({heads})"
                )
            head_dim = hidden // heads

        kv_heads = raw.get("num_key_value_heads")
        max_pos = int(raw.get("max_position_embeddings") or defaults.max_position_embeddings)
        if gemma:
            rope_theta, rope_scaling, local_theta = _parse_gemma3_rope(raw, max_pos, source)
            _refuse_gemma3_extras(raw, source)
        else:
            (rope_theta, rope_scaling), local_theta = _parse_rope(raw, max_pos, source), None
        qkv_bias, o_bias, mlp_bias, qk_norm = _family_flags(arch, raw)
        sliding_window, layer_types = _parse_sliding_window(arch, raw, num_layers)
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", source),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", defaults.bos_token_id),
            eos_token_ids=token_ids(raw.get("eos_token_id", defaults.eos_token_id)),
            pad_token_id=raw.get("pad_token_id"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            hidden_act=act,
            norm_offset=gemma,
            sandwich_norms=gemma,
            embedding_multiplier=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
            local_rope_theta=local_theta,
        )


def rope_of_hf_config(raw: Mapping[str, Any], source: str) -> tuple[int, float, RopeScaling]:
    """(head_dim, theta, scaling) of a `config.json` whose RoPE is the Llama family's: full width, in the
    "rotate_half" layout, of a type the project computes; for models whose attention the project's model code
    does not run but whose RoPE a policy needs. Raises ModelConfigError otherwise."""
    heads = _int(raw, "num_attention_heads", source)
    head_dim = int(raw.get("head_dim") or _int(raw, "hidden_size", source) // heads)
    max_pos = int(raw.get("max_position_embeddings") or 2048)
    theta, scaling = _parse_rope(raw, max_pos, source)
    return head_dim, theta, scaling


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """Normalise an HF `eos_token_id` (int, list of ints or null) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not archs:
        raise UnsupportedModelError(
            f"{source} has no 'architectures' entry; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise UnsupportedModelError(
        f"unsupported architecture {', '.join(map(str, archs))} in {source}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _int(raw: Mapping[str, Any], key: str, source: str) -> int:
    """A required integer key: a clear error beats silently assuming some 7B model's size."""
    value = raw.get(key)
    if value is None:
        raise ModelConfigError(f"{source}: missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(f"{source}: {key!r} must be an integer, got {value!r}")
    return value


def _activation(raw: Mapping[str, Any], gemma: bool, source: str) -> str:
    """The MLP activation's canonical name; Gemma spells the key `hidden_activation`."""
    act = (raw.get("hidden_activation") or raw.get("hidden_act")) if gemma else raw.get("hidden_act", "silu")
    act = act or ("gelu_pytorch_tanh" if gemma else "silu")
    for name, spellings in SUPPORTED_ACTIVATIONS.items():
        if act in spellings and (name == "gelu_pytorch_tanh") == gemma:
            return name
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    raise ModelConfigError(f"{source}: hidden activation {act!r} is not supported (this family uses {expected!r})")


def _parse_gemma3_rope(raw: Mapping[str, Any], max_pos: int, source: str) -> tuple[float, RopeScaling, float]:
    """(global theta, global scaling, sliding layers' theta) from either spelling.

    transformers >= 5 writes `rope_parameters` per layer type; older files give `rope_theta` and
    `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(FULL_ATTENTION), Mapping):
        full = dict(params[FULL_ATTENTION])
        local = dict(params.get(SLIDING_ATTENTION) or {})
        theta, scaling = _parse_rope({"rope_parameters": full}, max_pos, source)
        local_theta, local_scaling = _parse_rope({"rope_parameters": local}, max_pos, source)
        if local_scaling.rope_type != "default":
            raise ModelConfigError(f"{source}: scaled RoPE in the sliding-window layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = _parse_rope({k: v for k, v in raw.items() if k != "rope_parameters"}, max_pos, source)
    return theta, scaling, float(raw.get("rope_local_base_freq", _DEFAULT_ROPE_THETA))


def _refuse_gemma3_extras(raw: Mapping[str, Any], source: str) -> None:
    """Gemma 3 switches the model code does not implement: a clear error rather than wrong logits."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelConfigError(f"{source}: {key}={raw[key]} is not supported (Gemma 3 sets it to null)")
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{source}: bidirectional attention (an encoder's) is not supported")


def _parse_rope(raw: Mapping[str, Any], max_pos: int, source: str) -> tuple[float, RopeScaling]:
    """Read theta and scaling from either spelling.

    transformers 5 gives `rope_scaling` precedence over `rope_parameters` and takes `rope_theta` from
    inside the dict before the top-level key; we follow the same order.
    """
    params: dict[str, Any] = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{source}: per-layer-type RoPE parameters are not supported by the Llama family")
    theta = float(params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor={partial} is not supported (only 1.0)")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    def need(key: str) -> float:
        if params.get(key) is None:
            raise ModelConfigError(f"{source}: RoPE type {rope_type!r} needs {key!r}")
        return float(params[key])

    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=need("factor"))
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=need("factor"),
        low_freq_factor=need("low_freq_factor"),
        high_freq_factor=need("high_freq_factor"),
        original_max_position_embeddings=int(original) if original else max_pos,
    )


def _family_flags(arch: str, raw: Mapping[str, Any]) -> tuple[bool, bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias, per-head q/k RMSNorm) as each HF family hard-wires them."""
    attention_bias = bool(raw.get("attention_bias", False))
    if arch == "LlamaForCausalLM":
        return attention_bias, attention_bias, bool(raw.get("mlp_bias", False)), False
    if arch == "Qwen2ForCausalLM":
        return True, False, False, False
    if arch == "Qwen3ForCausalLM":
        return attention_bias, attention_bias, False, True
    if arch == "Gemma3ForCausalLM":
        return attention_bias, attention_bias, False, True
    return False, False, False, False  # Mistral: no biases whatever the config says


def _parse_sliding_window(arch: str, raw: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Which layers use a sliding window, following each family's switch.

    Mistral slides every layer whenever `sliding_window` is set; Qwen2/3 only when
    `use_sliding_window` is true, and then only layers >= `max_window_layers` (or as `layer_types`
    says). Gemma 3 slides the layers `layer_types` names, or all but every `sliding_window_pattern`-th
    (6) when a file predates `layer_types`. Llama never slides.
    """
    window = raw.get("sliding_window")
    if arch == "Gemma3ForCausalLM":
        window = int(window if window is not None else 4096)
        layer_types = raw.get("layer_types")
        if layer_types:
            return window, tuple(str(t) for t in layer_types)
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return window, tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers))
    if arch == "LlamaForCausalLM" or window is None:
        return None, (FULL_ATTENTION,) * num_layers
    if arch == "MistralForCausalLM":
        return int(window), (SLIDING_ATTENTION,) * num_layers
    if not raw.get("use_sliding_window", False):
        return None, (FULL_ATTENTION,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        return int(window), tuple(str(t) for t in layer_types)
    first_sliding = int(raw.get("max_window_layers", 28))
    return int(window), tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers))
