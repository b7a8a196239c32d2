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


def suite_bench_model_dir(root: str | Path, seed: int = 0) -> Path:
    """The random benchmark model shape over the synthetic suite's vocabulary, with its tokenizer.

    Its outputs are noise (the weights are random) but it takes text, chat and the suite's prompts,
    so the server, its API and its KV figures can be exercised before a trained model exists.
    """
    from vllm_kvpress_ext.bench.tokenizer import BOS, EOS, VOCABULARY, save_tokenizer

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
        yield bench_model_dir(tmp, seed=seed)
