"""Random-weight benchmark models, written as ordinary HF directories."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_kvpress_ext.models.writer import llama_config, random_model, save_model

# A small GQA Llama: big enough that attention and the cache matter, small enough for a 2-core CPU.
BENCH_MODEL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "max_position_embeddings": 16384,
}


def bench_model_dir(root: str | Path | None = None, seed: int = 0) -> Path:
    """Write the random benchmark model into `root` (a fresh temporary directory by default)."""
    from vllm_kvpress_ext.tasks.tokenizer import save_tokenizer

    out = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kvpress-bench-model-"))
    config = llama_config(**BENCH_MODEL)  # type: ignore[arg-type]
    save_model(random_model(config, seed=seed), config, out)
    save_tokenizer(out)  # its ids fit the vocabulary; KVzip's reconstruction pass renders a text prompt
    return out


def suite_bench_model_dir(root: str | Path, seed: int = 0) -> Path:
    """The random benchmark model shape over the synthetic suite's vocabulary, with its tokenizer.

    Its outputs are noise (the weights are random) but it takes text, chat and the suite's prompts,
    so the server, its API and its KV figures can be exercised before a trained model exists.
    """
    from vllm_kvpress_ext.tasks.tokenizer import BOS, EOS, VOCABULARY, save_tokenizer

    out = Path(root)
    save_tokenizer(out)
    config = llama_config(
        **{**BENCH_MODEL, "vocab_size": len(VOCABULARY)},  # type: ignore[arg-type]
        bos_token_id=VOCABULARY.index(BOS),
        eos_token_id=VOCABULARY.index(EOS),
    )
    return save_model(random_model(config, seed=seed), config, out)


@contextmanager
def model_or_bench_model(model: str | None, seed: int = 0) -> Iterator[Path]:
    """`model` as a path, or the random benchmark model in a temporary directory removed afterwards."""
    if model:
        yield Path(model)
        return
    with tempfile.TemporaryDirectory(prefix="kvpress-bench-model-") as tmp:
        # One level down: files a bench writes beside the model (WG-KV's gates) go with the directory.
        yield bench_model_dir(Path(tmp) / "model", seed=seed)


# Llama-3-8B's shape (32 layers, GQA 32/8, head_dim 128, 128K vocabulary), for GPU benches with random
# weights: no weights are downloaded, so outputs are noise but every tensor and KV page has its real size.
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
SHAPES = {"bench": BENCH_MODEL, "llama3-8b": LLAMA3_8B}


def shaped_model_dir(shape: str, root: str | Path, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> Path:
    """Write a random-weight model of a named shape, its tensors drawn on `device` in `dtype`.

    Drawing on the device keeps an 8B-parameter model's set-up to seconds on a GPU; the file is the
    same ordinary HF directory every other model is.
    """
    import torch
    from safetensors.torch import save_file

    from vllm_kvpress_ext.models.config import ModelConfig
    from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
    from vllm_kvpress_ext.models.loader import _checkpoint_name, resolve_dtype
    from vllm_kvpress_ext.tasks.tokenizer import save_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    config = {**llama_config(**SHAPES[shape]), "torch_dtype": str(resolve_dtype(dtype)).removeprefix("torch.")}  # type: ignore[arg-type]
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(ModelConfig.from_dict(config))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, param in model.state_dict().items():
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=resolve_dtype(dtype), device=device)
        else:
            value = (torch.randn(param.shape, generator=gen, device=device) * 0.02).to(resolve_dtype(dtype))
        tensors[_checkpoint_name(name)] = value.cpu()
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # A tokenizer (the synthetic suite's; its ids fit any shape's vocabulary): KVzip's reconstruction pass
    # renders a text prompt, so a model without one cannot run every policy.
    save_tokenizer(out)
    return out


@contextmanager
def model_of_shape(model: str | None, shape: str, dtype: str, device: str, seed: int = 0) -> Iterator[Path]:
    """`model` as a path; else the random model of `shape` (`SHAPES`), written to a temporary directory
    removed afterwards, its tensors drawn on `device`."""
    if model or shape == "bench":
        with model_or_bench_model(model, seed) as model_dir:
            yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix=f"kvpress-{shape}-model-") as tmp:
        start = time.perf_counter()
        model_dir = shaped_model_dir(shape, tmp, dtype, device, seed)
        print(f"wrote a random {shape} model in {time.perf_counter() - start:.0f} s")
        yield model_dir


def write_untrained_gates(model_dir: str | Path) -> Path:
    """Untrained WG-KV write gates beside a random-weight bench model (initial bias +3: nearly every key admitted).

    No gate is meaningful on random weights; what a bench measures of WG-KV there is its ring + global
    layout (and its cap, when set), not what a trained gate would choose. Never call it on a user's model.
    """
    import torch

    from vllm_kvpress_ext.models import load_config
    from vllm_kvpress_ext.models.write_gate import WriteGates, default_gate_path
    from vllm_kvpress_ext.policies.wgkv import DEFAULT_WINDOW

    path = default_gate_path(model_dir)
    if not path.exists():
        config = load_config(model_dir)
        torch.manual_seed(0)
        gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, init_bias=3.0)
        gates.save(path, metadata={"local_window": DEFAULT_WINDOW, "note": "untrained (bench)"})
    return path


def runnable_policies(names: Iterable[str], model_dir: str | Path) -> list[str]:
    """`names` less WG-KV when the model has no write gates, beside it or shipped (a line says why it is skipped)."""
    from vllm_kvpress_ext.models.write_gate import find_gates

    kept = []
    for name in names:
        if name == "wgkv" and not find_gates(model_dir).exists():
            print(f"wgkv: skipped, no write gates at {find_gates(model_dir)} (train them: kvpress train-gate)")
            continue
        kept.append(name)
    return kept
