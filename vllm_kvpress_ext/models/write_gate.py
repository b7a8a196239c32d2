"""Write gates for KV admission (WG-KV): one small MLP per (layer, KV head) that scores each new key.

Paper: "KV Admission: Learning What to Write for Efficient Long-Context Inference" (Write-Gated KV).
For token j in layer l, KV head h the gate reads the key twice, before and after RoPE:

    x_j = [RMSNorm(k_pre_rope_j) ; RMSNorm(k_j)]                       (2 d inputs)
    g_j = sigmoid(w2 . GELU(W1 x_j + b1) + b2)   in [0, 1]

and the token is *admitted* to the long-lived global cache iff g_j >= tau. Pre-RoPE keys carry the
content, post-RoPE keys its position; both are normalised so the gate sees directions, not the
scale a layer happens to use.

Size. The paper reports gates of about 0.4% of the parameters of an 8B model. At Llama-3-8B scale
(32 layers x 8 KV heads, head_dim 128) that is ~32M / 256 = ~125K parameters per gate, which a
hidden width of 4 x head_dim gives: 2d x 4d + 4d + 4d + 1 = 132K (0.42% of 8B). `hidden = 4 x head_dim`
is therefore the default here. On a tiny model the same width is a larger share of the (tiny) whole,
which is said in the shipped gates' metadata (`parameters`, `model_parameters`).

Divergences (documented choices):
- RMSNorm without a learned scale: the first linear layer can absorb any per-channel scale.
- The output bias starts at `init_bias` (`kvpress train-gate --init-bias`, default +1, g ~ 0.73): gates
  start mostly open, so training starts near full attention and the penalty decides what to drop,
  but not so saturated (the sigmoid's slope at +3 is a quarter of that at +1) that a short run at
  the paper's lr 1e-3 cannot close them.

Gates are stored as safetensors *next to* a model directory (never inside it, so the model
directory stays a plain HF checkpoint), with the shape and training facts in the metadata.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GATE_SUFFIX = ".wgkv.safetensors"
RMS_EPS = 1e-6


def default_gate_path(model_dir: str | Path) -> Path:
    """Where a model's gates live by default: `<model_dir><GATE_SUFFIX>`, beside the directory."""
    model_dir = Path(model_dir).resolve()
    return model_dir.parent / f"{model_dir.name}{GATE_SUFFIX}"


def shipped_gates() -> dict[str, Path]:
    """Gate files shipped in the package for catalog models (`assets/gates/NAME.wgkv.safetensors`), by NAME."""
    from vllm_kvpress_ext.assets import ASSETS_DIR

    folder = ASSETS_DIR / "gates"
    return {p.name[: -len(GATE_SUFFIX)]: p for p in sorted(folder.glob(f"*{GATE_SUFFIX}"))}


def find_gates(model_path: str | Path) -> Path:
    """The gates a model uses by default: beside it if there are some, else those shipped for its catalog entry.

    A pulled catalog model is recognised by its file name (e.g. SmolLM2-135M-Instruct.Q4_1.gguf); its
    shipped default is `assets/gates/<catalog name>.wgkv.safetensors`. Returns the path beside the
    model (which may not exist) when neither is there.
    """
    beside = default_gate_path(model_path)
    if beside.is_file():
        return beside
    from vllm_kvpress_ext.hub.catalog import CATALOG

    name = Path(model_path).name
    for model in CATALOG.values():
        shipped = shipped_gates().get(model.name)
        if name == model.file_name and shipped is not None:
            return shipped
    return beside


def _rms_normalise(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


class WriteGates(nn.Module):
    """All gates of a model: weights batched as `[L, H, ...]` so one layer's heads run in one einsum."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int | None = None, init_bias: float = 3.0
    ) -> None:
        super().__init__()
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_kv_heads and head_dim must be >= 1")
        hidden = 4 * head_dim if hidden is None else hidden
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.hidden = num_layers, num_kv_heads, head_dim, hidden
        self.w1 = nn.Parameter(torch.randn(num_layers, num_kv_heads, 2 * head_dim, hidden) / math.sqrt(2 * head_dim))
        self.b1 = nn.Parameter(torch.zeros(num_layers, num_kv_heads, hidden))
        self.w2 = nn.Parameter(torch.randn(num_layers, num_kv_heads, hidden) * (0.1 / math.sqrt(hidden)))
        self.b2 = nn.Parameter(torch.full((num_layers, num_kv_heads), float(init_bias)))

    def logits(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid gate values `[n, H]` for keys `[n, H, d]` of `layer` (fp32)."""
        x = torch.cat([_rms_normalise(k_pre_rope), _rms_normalise(k)], dim=-1)  # [n, H, 2d]
        w1, b1, w2, b2 = (p[layer].float() for p in (self.w1, self.b1, self.w2, self.b2))
        h = F.gelu(torch.einsum("nhi,hio->nho", x, w1) + b1)
        return torch.einsum("nho,ho->nh", h, w2) + b2

    def forward(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Gate values g `[n, H]` in [0, 1]."""
        return torch.sigmoid(self.logits(layer, k_pre_rope, k))

    @torch.no_grad()
    def part(self, first_layer: int, num_layers: int, first_head: int, num_heads: int) -> WriteGates:
        """The gates of layers [first_layer, first_layer + num_layers) and KV heads [first_head, first_head +
        num_heads) only (made once): a pipeline stage's layers, a tensor-parallel worker's heads."""
        if first_layer < 0 or num_layers < 1 or first_layer + num_layers > self.num_layers:
            raise ValueError(
                f"layers [{first_layer}, {first_layer + num_layers}) are not among these gates' {self.num_layers}"
            )
        if first_head < 0 or num_heads < 1 or first_head + num_heads > self.num_kv_heads:
            raise ValueError(
                f"heads [{first_head}, {first_head + num_heads}) are not among these gates' {self.num_kv_heads}"
            )
        key = (first_layer, num_layers, first_head, num_heads)
        if key == (0, self.num_layers, 0, self.num_kv_heads):
            return self
        parts: dict[tuple[int, int, int, int], WriteGates] = self.__dict__.setdefault("_parts", {})
        if key not in parts:
            part = WriteGates(num_layers, num_heads, self.head_dim, self.hidden).to(self.w1.device)
            layers, heads = slice(first_layer, first_layer + num_layers), slice(first_head, first_head + num_heads)
            for name in ("w1", "b1", "w2", "b2"):
                getattr(part, name).copy_(getattr(self, name)[layers, heads])
            parts[key] = part
        return parts[key]

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, where: str = "gates") -> None:
        """Raise a clear error when these gates were made for a model of another shape."""
        have = (self.num_layers, self.num_kv_heads, self.head_dim)
        want = (num_layers, num_kv_heads, head_dim)
        if have != want:
            raise ValueError(
                f"{where} are for a model with (layers, KV heads, head_dim) = {have}, but the model has {want}"
            )

    def save(
        self, path: str | Path, metadata: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
    ) -> Path:
        """Write the gates as safetensors in `dtype` (they are always loaded back as fp32)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden": self.hidden,
            "parameters": sum(p.numel() for p in self.parameters()),
        }
        meta = {"format": "wgkv-gates-v1", "shape": json.dumps(shape), "info": json.dumps(metadata or {})}
        tensors = {name: p.detach().to(dtype).contiguous().cpu() for name, p in self.named_parameters()}
        save_file(tensors, str(path), metadata=meta)
        return path


def gate_metadata(path: str | Path) -> dict[str, Any]:
    """The training facts stored with gates (`info`), e.g. the window and lambda they were trained with."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    return dict(json.loads(meta.get("info", "{}")))


def load_gates(path: str | Path, device: torch.device | str = "cpu") -> WriteGates:
    """Gates saved by `WriteGates.save`; a missing or foreign file raises a clear error."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no write gates at {path} (train them with `kvpress train-gate MODEL_DIR --out {path}`)"
        )
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        if meta.get("format") != "wgkv-gates-v1":
            raise ValueError(f"{path} is not a write-gate file (format {meta.get('format')!r})")
        shape = json.loads(meta["shape"])
        gates = WriteGates(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], shape["hidden"])
        # Shipped gates may be fp16: the gates always run in fp32.
        state = {name: handle.get_tensor(name).float() for name in handle.keys()}  # noqa: SIM118 - not a dict
    gates.load_state_dict(state)
    return gates.to(device).eval()


class GateStore:
    """Loaded write gates, each file loaded once per device, for as long as the store's owner lives.

    The model runner owns one (so every request of an engine shares its gates and two engines never
    share theirs). An entry is keyed by the resolved path, the device and the file's size and
    modification time: gates rewritten in place (`kvpress train-gate` again) are loaded afresh, never
    served stale.
    """

    def __init__(self) -> None:
        self._loaded: dict[tuple[Path, str], tuple[tuple[int, int], WriteGates]] = {}

    def __len__(self) -> int:
        return len(self._loaded)

    def get(self, path: str | Path, device: torch.device | str = "cpu") -> WriteGates:
        """The gates in `path` on `device`, loaded now if this store does not hold the file's current version."""
        resolved = Path(path).resolve()
        stat = resolved.stat() if resolved.is_file() else None
        version = (stat.st_size, stat.st_mtime_ns) if stat is not None else (-1, -1)
        key = (resolved, str(torch.device(device)))
        held = self._loaded.get(key)
        if held is not None and held[0] == version:
            return held[1]
        gates = load_gates(resolved, device)  # a missing or foreign file raises here
        self._loaded[key] = (version, gates)
        return gates


def write_gated_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    gates: torch.Tensor,
    window: int,
    scale: float,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The student attention gates are trained with: softmax(q k^T * scale + log m) v, causal.

    query `[B, T, Hq, d]`, keys/values `[B, T, Hkv, d]`, gates `[B, T, Hkv]`. m[i, j] = 1 inside the
    local window (i - j < window) and g_j outside it, so a gate only matters once its token has left
    the window. `eps` keeps log(g) finite for training; with eps = 0 and binary gates this is exactly
    the vertical-slash mask (log 0 = -inf). Returns `[B, T, Hq, d]` in fp32.
    """
    batch, length, num_q_heads, _ = query.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    i = torch.arange(length, device=query.device).view(length, 1)
    j = torch.arange(length, device=query.device).view(1, length)
    local = (i - j < window) & (j <= i)  # [T, T]
    log_gate = torch.log(gates.float() + eps).transpose(1, 2).unsqueeze(2)  # [B, Hkv, 1, T] per key column
    bias = torch.where(local, torch.zeros((), device=query.device), log_gate)
    bias = bias.masked_fill(j > i, float("-inf"))  # [B, Hkv, T, T]
    q = query.float().view(batch, length, num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, d]
    k = keys.float().transpose(1, 2)  # [B, Hkv, T, d]
    v = values.float().transpose(1, 2)
    scores = torch.einsum("bhgtd,bhsd->bhgts", q, k) * scale + bias.unsqueeze(2)
    out = torch.einsum("bhgts,bhsd->bhgtd", torch.softmax(scores, dim=-1), v)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, length, num_q_heads, -1)


__all__ = [
    "GATE_SUFFIX",
    "WriteGates",
    "default_gate_path",
    "find_gates",
    "gate_metadata",
    "load_gates",
    "shipped_gates",
    "write_gated_attention",
]
