"""Files shipped inside the package: the default model and its WG-KV write gates.

`default_model/` is an ordinary HF directory (config.json, model.safetensors, tokenizer,
generation_config.json) trained by `kvpress train-model` on the synthetic suite; its gates sit
beside it as `default_model.wgkv.safetensors` (gates never live inside a model directory). How it
was trained, on what hardware and how well it does: docs/model.md.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"


def default_model_dir() -> Path:
    """The bundled model's directory; a clear error when the package was installed without it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled model is missing from {DEFAULT_MODEL_DIR}; reinstall the package or pass a model directory"
        )
    return DEFAULT_MODEL_DIR


__all__ = ["ASSETS_DIR", "DEFAULT_MODEL_DIR", "default_model_dir"]
