"""Random-weight benchmark models, written as ordinary HF directories."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
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
    out = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kvpress-bench-model-"))
    config = llama_config(**BENCH_MODEL)  # type: ignore[arg-type]
    return save_model(random_model(config, seed=seed), config, out)


@contextmanager
def model_or_bench_model(model: str | None, seed: int = 0) -> Iterator[Path]:
    """`model` as a path, or the random benchmark model in a temporary directory removed afterwards."""
    if model:
        yield Path(model)
        return
    with tempfile.TemporaryDirectory(prefix="kvpress-bench-model-") as tmp:
        yield bench_model_dir(tmp, seed=seed)
