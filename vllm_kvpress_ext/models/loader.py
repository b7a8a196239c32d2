"""Load a Llama-family model from a local HF-format directory (config.json + safetensors) or a `.gguf` file.

Local files only: nothing here talks to the Hugging Face hub. The model is built on the meta device
(no random init, no second copy of the weights) and every parameter is then assigned straight from
the checkpoint, converted to the requested dtype one tensor at a time. Before any tensor is read,
names and shapes are checked against what config.json implies, so a wrong or truncated checkpoint
fails with a message naming the tensors at fault instead of producing garbage text. A path ending
in `.gguf` is read by `gguf_file.py` (metadata -> config in `gguf_config.py`, tensors in
`gguf_weights.py`) and goes through the same build-on-meta, check, assign steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig, token_ids
from .errors import ModelConfigError, ModelFileNotFoundError, ModelLoadError
from .gguf_config import config_from_gguf
from .gguf_file import GGUFFile, is_gguf_path, open_gguf
from .gguf_weights import gguf_state_dict
from .llama import LlamaFamilyForCausalLM

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES_SHOWN = 5  # how many tensor names an error lists before "... and N more"


def load_model(
    model_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaFamilyForCausalLM:
    """Build the model described by `model_dir/config.json` and fill it from its safetensors.

    `model_dir` may instead be a `.gguf` file: its metadata gives the config, its tensors are
    dequantised (any GGML type the `gguf` package reads) and cast to `dtype` ("auto": the file's
    float type, float32 for quantised files).

    dtype: fp32, bf16 or fp16 (a torch dtype or a name such as "bf16"; "auto" takes config.json's
    `dtype`/`torch_dtype`, else fp32). The returned model is in eval mode with gradients disabled.
    Raises a `ModelLoadError` (a ValueError; `ModelFileNotFoundError` is also a FileNotFoundError)
    naming whatever is missing, unsupported or mismatched.
    """
    if is_gguf_path(model_dir):
        return _load_gguf_model(open_gguf(model_dir), dtype, device)
    directory = _model_directory(model_dir)
    config = load_config(directory)
    target_dtype = resolve_dtype(dtype, config)
    tensor_files = find_tensor_files(directory)

    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wanted = _match_checkpoint(tensor_files, expected, config, directory)

    state: dict[str, torch.Tensor] = {}
    for path, names in _group_by_file(wanted).items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for checkpoint_name, param_name in names:
                state[param_name] = f.get_tensor(checkpoint_name).to(device=device, dtype=target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Parse `config.json`; stop tokens from `generation_config.json` are appended to `eos_token_ids`.

    Chat models (Llama 3 Instruct, Qwen) list their end-of-turn tokens only in
    generation_config.json, and the engine must stop on those too. A `.gguf` path reads the
    file's metadata instead (end-of-turn tokens included).
    """
    if is_gguf_path(model_dir):
        gguf = open_gguf(model_dir)
        return config_from_gguf(gguf.metadata, set(gguf.tensor_names()), str(gguf.path))
    directory = _model_directory(model_dir)
    config = ModelConfig.from_json_file(directory / CONFIG_NAME)
    generation_path = directory / GENERATION_CONFIG_NAME
    if not generation_path.is_file():
        return config
    try:
        extra = token_ids(json.loads(generation_path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ModelConfigError(f"{generation_path} is not a valid generation config: {e}") from e
    merged = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=merged)


def _load_gguf_model(gguf: GGUFFile, dtype: torch.dtype | str, device: str | torch.device) -> LlamaFamilyForCausalLM:
    config = config_from_gguf(gguf.metadata, set(gguf.tensor_names()), str(gguf.path))
    target_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = gguf_state_dict(gguf, config, expected, target_dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a dtype or a name; "auto" means the checkpoint's own dtype (fp32 if unknown)."""
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name == "auto":
            name = (config.torch_dtype if config and config.torch_dtype else "float32").removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16 or 'auto'")
        return _DTYPES[name]
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def find_tensor_files(model_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it.

    A single `model.safetensors` wins; otherwise `model.safetensors.index.json` lists the shards.
    Names are read from the files themselves, so an index that disagrees with its shards cannot
    send us to the wrong file.
    """
    directory = Path(model_dir)
    single = directory / SAFETENSORS_NAME
    index = directory / SAFETENSORS_INDEX_NAME
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = _shards_from_index(index)
    else:
        others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        found = f" (found: {', '.join(others)}; convert them to {SAFETENSORS_NAME})" if others else ""
        raise ModelFileNotFoundError(
            f"no safetensors weights in {directory}: expected {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME}{found}"
        )
    located: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                located.setdefault(name, path)
    return located


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ModelFileNotFoundError(f"{index} lists shard file(s) that are missing: {_listing(missing)}")
    return shards


def _model_directory(model_dir: str | os.PathLike[str]) -> Path:
    directory = Path(model_dir).expanduser()
    if not directory.exists():
        raise ModelFileNotFoundError(
            f"model directory not found: {directory} (models load from a local HF-format directory; "
            "nothing is downloaded)"
        )
    if not directory.is_dir():
        raise ModelLoadError(f"model path is not a directory: {directory}")
    return directory


def _param_name(checkpoint_name: str) -> str:
    """HF checkpoint name -> our parameter name: the decoder lives at top level, not under `model.`."""
    return checkpoint_name.removeprefix("model.")


def _checkpoint_name(param_name: str) -> str:
    return param_name if param_name.startswith("lm_head.") else f"model.{param_name}"


def _is_ignorable(checkpoint_name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that hold nothing we need.

    Old Llama checkpoints saved the RoPE `inv_freq` buffers (we recompute them), and some tied
    checkpoints store `lm_head.weight` as a copy of the embedding.
    """
    if checkpoint_name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and checkpoint_name == "lm_head.weight"


def _match_checkpoint(
    files: dict[str, Path], expected: dict[str, tuple[int, ...]], config: ModelConfig, directory: Path
) -> dict[str, tuple[Path, str]]:
    """Check names and shapes; return {checkpoint name: (file, parameter name)} for what to load."""
    by_param = {_param_name(n): n for n in files if not _is_ignorable(n, config)}
    missing = [_checkpoint_name(p) for p in expected if p not in by_param]
    unexpected = [n for p, n in by_param.items() if p not in expected]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) that config.json requires: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) this model does not use: {_listing(unexpected)}")
    if problems:
        raise ModelLoadError(f"checkpoint in {directory} does not match its config.json: " + "; ".join(problems))

    wanted = {name: (files[name], param) for param, name in by_param.items()}
    mismatched = []
    for path, names in _group_by_file(wanted).items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name, param in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[param]:
                    mismatched.append(f"{name} has shape {list(shape)}, expected {list(expected[param])}")
    if mismatched:
        raise ModelLoadError(
            f"checkpoint in {directory} has {len(mismatched)} tensor(s) whose shape does not match config.json: "
            + _listing(mismatched)
        )
    return wanted


def _group_by_file(wanted: dict[str, tuple[Path, str]]) -> dict[Path, list[tuple[str, str]]]:
    """Open each shard once and read all of its tensors, rather than reopening per tensor."""
    groups: dict[Path, list[tuple[str, str]]] = {}
    for name, (path, param) in wanted.items():
        groups.setdefault(path, []).append((name, param))
    return groups


def _listing(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:_NAMES_SHOWN])
    return shown + (f" ... and {len(items) - _NAMES_SHOWN} more" if len(items) > _NAMES_SHOWN else "")
