"""`vllm serve model.gguf` (or a catalog name such as `smollm2-135m`) through the plugin.

vLLM (0.32, 0.33) reads no GGUF file: its config resolution (`vllm/transformers_utils/config.py`) looks for a
`config.json` or `params.json` in a directory or hub repository, and its speculators probe parses the
model path itself as a JSON config, so `vllm serve model.gguf` stops with transformers' "not a valid
JSON file" error before any platform or worker runs. The plugin's worker loads the model itself (with
this project's GGUF loader), so the only thing vLLM's front end needs is what it reads from a model
directory: `config.json` (architecture, sizes, context length), `generation_config.json` (the stop
tokens) and the tokenizer files.

`prepare_gguf_model` writes exactly that once per file, under the model cache
(`vllm/<stem>-<size>-<mtime>`, beside the converted tokenizers), plus a marker naming the GGUF file.
vLLM is handed that directory as the model; the worker finds the marker (`gguf_source`) and loads the
file. `--tokenizer` still wins when given; the served model name defaults to what the user typed.

On vLLM's own model runner (`kv_runner: vllm`) vLLM's loader reads the weights, and it reads no GGUF
file: `prepare_gguf_weights` writes the file's weights, dequantised to the served dtype, as
`model.safetensors` in the same directory, once per dtype.

The architectures the plugin's own runner serves (Llama, Mistral, Qwen2, Qwen3) go through this project's
loader, config and weights alike, as that runner loads them (and, for vLLM's runner, as written from them).
Any other architecture whose GGUF files transformers reads (Gemma 2 and 3, Phi-3, ...) is converted by
transformers: its config, its weights dequantised, and its tokenizer. Such a model runs on vLLM's runner
(`config.chosen_runner`). (The embedded
engine reads Gemma 3 files with this project's loader; for vLLM the file's config must be the
`gemma3_text` one transformers writes, which vLLM's Gemma 3 code reads.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.vllm_plugin.config import PROJECT_RUNNER_ARCHITECTURES

MARKER = "kvpress-gguf.json"
WEIGHTS_MARKER = "kvpress-weights.json"  # the dtype `model.safetensors` was written in


class GGUFServeError(ValueError):
    """A GGUF model that cannot be served through vLLM, with the reason."""


def is_gguf_spec(model: str) -> bool:
    """A `.gguf` path or a catalog name that is not a local path (both resolve to a GGUF file)."""
    from vllm_kvpress_ext.hub.catalog import lookup

    return model.lower().endswith(".gguf") or (lookup(model) is not None and not Path(model).exists())


def gguf_source(model_dir: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a prepared directory stands for, or None for an ordinary model directory."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    path = Path(json.loads(marker.read_text())["gguf"])
    if not path.is_file():
        raise GGUFServeError(f"{model_dir} stands for {path}, which no longer exists")
    return path


# The GGUF architectures whose vLLM config the project writes itself (those its own runner serves);
# any other file's config, tokenizer and weights come from transformers' GGUF reader.
_PROJECT_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def prepare_gguf_model(model: str, tokenizer: str | None = None) -> Path:
    """The directory vLLM is given for GGUF file (or catalog name) `model`; written on first use.

    Raises `GGUFServeError` when the file is missing, is not a model this project loads, or carries no
    tokenizer while `tokenizer` (vLLM's `--tokenizer`) is not given either.
    """
    from vllm_kvpress_ext.hub.catalog import cache_dir
    from vllm_kvpress_ext.hub.pull import resolve_model
    from vllm_kvpress_ext.models.errors import ModelLoadError
    from vllm_kvpress_ext.models.gguf_config import gguf_architecture, hf_config_from_gguf
    from vllm_kvpress_ext.models.gguf_file import open_gguf

    path = resolve_model(model).expanduser()
    if not path.is_file():
        raise GGUFServeError(f"GGUF file not found: {path}")
    path = path.resolve()
    stat = path.stat()
    directory = cache_dir() / "vllm" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (directory / MARKER).is_file():
        if tokenizer is None and not (directory / "tokenizer_config.json").is_file():
            raise _no_tokenizer(path)
        return directory
    try:
        gguf = open_gguf(path)
        metadata = gguf.metadata
        if metadata.get("general.architecture") in _PROJECT_GGUF_ARCHITECTURES:
            config = hf_config_from_gguf(metadata, set(gguf.tensor_names()), str(path))
            config["model_type"], _ = gguf_architecture(metadata, str(path))  # AutoConfig picks its class by it
        else:
            config = _transformers_config(path, metadata, scratch=directory.parent)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise GGUFServeError(f"cannot serve {path}: {exc}") from exc
    if "tokenizer.ggml.tokens" not in metadata and tokenizer is None:
        raise _no_tokenizer(path)

    staging = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation: dict[str, Any] = {"eos_token_id": config["eos_token_id"]}
        if config.get("bos_token_id") is not None:
            generation["bos_token_id"] = config["bos_token_id"]
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if "tokenizer.ggml.tokens" in metadata:
            from vllm_kvpress_ext.models.tokenizer import load_tokenizer

            load_tokenizer(path).save_pretrained(str(staging))
        (staging / MARKER).write_text(json.dumps({"gguf": str(path)}) + "\n")
        try:
            staging.rename(directory)
        except OSError:  # another process prepared it meanwhile: theirs is as good
            if not (directory / MARKER).is_file():
                raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    return directory


def _transformers_config(path: Path, metadata: Any, scratch: Path) -> dict[str, Any]:
    """The `config.json` dict transformers derives from a GGUF file of an architecture this project's loader
    does not read; ValueError when transformers reads no GGUF file of that architecture either (the caller
    turns it into a `GGUFServeError` naming the file)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from vllm_kvpress_ext.models.gguf_config import FLOAT_FILE_TYPES

    arch = metadata.get("general.architecture")
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"neither this project nor transformers reads GGUF {arch!r} files")
    with _without_vocabulary(path, scratch) as light:
        config: dict[str, Any] = AutoConfig.from_pretrained(str(light.parent), gguf_file=light.name).to_dict()
    config.pop("quantization_config", None)  # the weights are written dequantised
    config["_name_or_path"] = str(path.parent)  # not the scratch copy's
    if f"{arch}.vocab_size" not in metadata and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])  # as transformers counts it from the file
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if causal_lm is None:
        raise ValueError(f"{config['model_type']!r} is not a causal language model")
    config["architectures"] = [causal_lm]
    config["dtype"] = FLOAT_FILE_TYPES.get(int(metadata.get("general.file_type", -1)), "float32")
    return config


def _no_tokenizer(path: Path) -> GGUFServeError:
    return GGUFServeError(
        f"{path} carries no tokenizer (no tokenizer.ggml.* metadata); give vLLM one with --tokenizer DIR"
    )


def prepare_gguf_weights(directory: Path, dtype: Any = "auto") -> Path:
    """`model.safetensors` in a prepared directory: its GGUF file's weights, dequantised to `dtype` ("auto":
    the loader's choice for the file), for vLLM's own loader. Written once per dtype, atomically."""
    import safetensors.torch
    import torch

    from vllm_kvpress_ext.models import load_model
    from vllm_kvpress_ext.models.writer import save_model

    source = gguf_source(directory)
    if source is None:
        raise GGUFServeError(f"{directory} is not a prepared GGUF directory")
    weights, marker = directory / "model.safetensors", directory / WEIGHTS_MARKER
    wanted = None if dtype in (None, "auto") else str(dtype).removeprefix("torch.")
    if weights.is_file() and marker.is_file():
        written = json.loads(marker.read_text()).get("dtype")
        if wanted is None or written == wanted:
            return weights
    config = json.loads((directory / "config.json").read_text())
    staging = directory / f".weights.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if config["architectures"][0] in PROJECT_RUNNER_ARCHITECTURES:
            model = load_model(source, dtype=dtype if wanted is not None else "auto")
            with torch.no_grad():
                save_model(model, config, staging)
        else:
            model = _transformers_model(source, directory, wanted or config["dtype"])
            tensors = model.state_dict()
            if config.get("tie_word_embeddings"):
                tensors.pop("lm_head.weight", None)  # the embedding, once: vLLM ties it back
            staging.mkdir()
            safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, staging / "model.safetensors")
        written_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        os.replace(staging / "model.safetensors", weights)
        marker.write_text(json.dumps({"dtype": written_dtype}) + "\n")
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    return weights


def export_model_directory(model: str, out: Path, dtype: str = "float32") -> Path:
    """An ordinary model directory at `out` for GGUF file (or catalog name) `model`: the prepared directory's config,
    generation config, tokenizer and weights dequantised to `dtype` (`prepare_gguf_model`, `prepare_gguf_weights`),
    without the markers that tie it to the file, the config's dtype the weights'. What vLLM without this project,
    transformers or any other HF loader reads; `out` must not exist yet, or be empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFServeError(f"{out} exists and is not an empty directory; name a new one")
    directory = prepare_gguf_model(model)
    prepare_gguf_weights(directory, dtype)
    out.mkdir(parents=True, exist_ok=True)
    for item in sorted(directory.iterdir()):
        if item.name in (MARKER, WEIGHTS_MARKER) or not item.is_file():
            continue
        shutil.copy2(item, out / item.name)
    # The prepared config names the file's own dtype; a loader left to `auto` takes the weights' from it.
    config = json.loads((out / "config.json").read_text())
    written = json.loads((directory / WEIGHTS_MARKER).read_text())["dtype"]
    for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
        config[key] = written
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _transformers_model(source: Path, directory: Path, dtype: str) -> Any:
    """transformers' model of a GGUF file, its weights dequantised to `dtype`, its config the one prepared in
    `directory`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory))
    with _without_vocabulary(source, directory.parent) as light:
        return AutoModelForCausalLM.from_pretrained(
            str(light.parent), gguf_file=light.name, config=config, dtype=getattr(torch, dtype)
        )


@contextlib.contextmanager
def _without_vocabulary(path: Path, scratch: Path) -> Iterator[Path]:
    """A copy of GGUF file `path` less its array-valued `tokenizer.*` fields, for transformers' GGUF reader,
    in a scratch directory under `scratch`: those arrays are all that makes its header parse slow
    (`GGUFFile.write_without_fields`), and the config and weights it derives need none of them (the
    vocabulary's size is added back by the caller, and the tokenizer is converted from the original file).
    `scratch` is the model cache's `vllm` directory, not the temporary directory: the copy is as large as
    the file, and a container's `/tmp` is often a small memory-backed or size-limited volume."""
    from vllm_kvpress_ext.models.gguf_file import open_gguf

    gguf = open_gguf(path)
    arrays = [key for key, value in gguf.metadata.items() if key.startswith("tokenizer.") and isinstance(value, list)]
    # transformers warns that it cannot count the vocabulary; the callers set its size themselves.
    reader_log = logging.getLogger("transformers.modeling_gguf_pytorch_utils")
    level = reader_log.level
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".light-", dir=scratch) as light:
        reader_log.setLevel(logging.ERROR)
        try:
            yield gguf.write_without_fields(Path(light) / path.name, drop=arrays)
        finally:
            reader_log.setLevel(level)


def adapt_engine_args(engine_args: Any) -> None:
    """Point `engine_args` at the prepared directory of its GGUF model (no-op for any other model); on vLLM's
    own runner, with the weights written for vLLM's loader."""
    model = str(engine_args.model)
    if not is_gguf_spec(model):
        return
    tokenizer = engine_args.tokenizer if engine_args.tokenizer not in (None, model) else None
    directory = prepare_gguf_model(model, tokenizer)
    from vllm.platforms import current_platform

    from vllm_kvpress_ext.vllm_plugin.config import chosen_runner

    architectures = json.loads((directory / "config.json").read_text())["architectures"]
    additional = getattr(engine_args, "additional_config", None) or {}
    if chosen_runner(additional, architectures, on_gpu=current_platform.is_cuda()) == "vllm":
        prepare_gguf_weights(directory, getattr(engine_args, "dtype", "auto"))
    engine_args.model = str(directory)
    engine_args.tokenizer = tokenizer or str(directory)
    if not engine_args.served_model_name:
        engine_args.served_model_name = model  # what clients name it: the path or catalog name typed


def refuse_without_plugin(engine_args: Any) -> None:
    """vLLM alone cannot read a GGUF file: say how to serve it instead of failing on its JSON parse."""
    model = str(engine_args.model)
    if model.lower().endswith(".gguf"):
        raise GGUFServeError(
            f"vLLM reads no GGUF files ({model}); vllm-kvpress-ext serves them when it is active: "
            "add --kv-policy (--kv-policy full serves the file uncompressed)"
        )


def install_gguf_models() -> None:
    """Wrap `EngineArgs.create_engine_config` once per process: both `vllm serve` and offline `vllm.LLM`
    build their config there, before vLLM first reads the model path (its speculators probe).

    With `HF_HUB_OFFLINE=1`, `EngineArgs.__post_init__` runs earlier still and asks the hub cache for
    the model by name (`get_model_path`), which fails for a catalog name; the wrapper installed here
    hands a GGUF spec back unchanged so `create_engine_config` can resolve it from the model cache.
    """
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvpress_ext.vllm_plugin.patches import wrap

    def wrap_get_model_path(original: Any) -> Any:
        def get_model_path(model: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm_kvpress_ext.vllm_plugin.activation import plugin_active

            if plugin_active() and is_gguf_spec(str(model)):
                return model  # resolved (pulled at most once, then from the local cache) by adapt_engine_args
            return original(model, *args, **kwargs)

        return get_model_path

    def wrap_create(original: Any) -> Any:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm_kvpress_ext.vllm_plugin.activation import mode, plugin_active

            if plugin_active():
                adapt_engine_args(self)
            elif mode() != "off":
                refuse_without_plugin(self)
            return original(self, *args, **kwargs)

        return create_engine_config

    wrap(EngineArgs, "create_engine_config", wrap_create, "gguf_model")
    wrap(arg_utils, "get_model_path", wrap_get_model_path, "gguf_model")
