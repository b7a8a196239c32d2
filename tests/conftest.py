"""Suite-wide: the tests write nothing into the user's model cache.

Every test runs with `KVPRESS_MODEL_CACHE` pointing at a scratch directory. What the user's cache
already holds for the catalog's models (the pulled GGUF files, the tokenizers converted from them, the
directories prepared for vLLM) appears there through symbolic links, so the tests that use a pulled
model find it without pulling or converting it again; anything else a test writes (the tokenizers and
prepared directories of the tiny GGUF files the tests generate) stays in the scratch directory and is
removed with it. A test that needs a cache of its own still sets the variable itself.

Under pytest-xdist (`make test`) each worker process takes its share of the CPUs for torch's threads and
for the servers and subprocesses it starts (`OMP_NUM_THREADS`), so the workers do not oversubscribe the
cores: OpenMP threads spinning beside another process's make both slower.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_kvpress_ext.hub import catalog


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    import torch

    threads = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _link_entries(real: Path, scratch: Path, prefixes: tuple[str, ...]) -> None:
    """Link each entry of `real` whose name starts with one of `prefixes` into `scratch`."""
    if not real.is_dir():
        return
    scratch.mkdir(exist_ok=True)
    for entry in real.iterdir():
        if entry.name.startswith(prefixes):
            (scratch / entry.name).symlink_to(entry)


@pytest.fixture(scope="session", autouse=True)
def scratch_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    real = catalog.cache_dir()
    scratch = tmp_path_factory.mktemp("model-cache")
    for model in catalog.CATALOG.values():
        if (real / model.name).is_dir():
            (scratch / model.name).symlink_to(real / model.name)
    # Converted tokenizers and prepared vLLM directories are named after the file's stem, size and mtime.
    stems = tuple(f"{Path(model.file_name).stem}-" for model in catalog.CATALOG.values())
    _link_entries(real / "tokenizers", scratch / "tokenizers", prefixes=stems)
    _link_entries(real / "vllm", scratch / "vllm", prefixes=stems)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(catalog.CACHE_ENV, str(scratch))
        yield scratch


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's pulled GGUF file; the test is skipped where it is not pulled."""
    from vllm_kvpress_ext.hub import catalog

    entry = catalog.lookup("gemma3-270m")
    assert entry is not None
    path = catalog.cached_path(entry)
    if not path.is_file():
        pytest.skip("Gemma 3 270M is not pulled (kvpress models pull gemma3-270m)")
    return path


@pytest.fixture(scope="session")
def gemma3_transformers(gemma3_gguf: Path) -> Any:  # transformers types its models loosely
    """transformers' Gemma 3 270M in float32: its own model class over the file's weights as transformers'
    GGUF reader dequantises them, read from the directory prepared for vLLM (written once per run; reading
    the GGUF file through transformers directly parses its 262K-token vocabulary twice)."""
    from transformers import AutoModelForCausalLM

    from vllm_kvpress_ext.vllm_plugin.gguf_model import prepare_gguf_model, prepare_gguf_weights

    directory = prepare_gguf_model(str(gemma3_gguf))
    prepare_gguf_weights(directory, "float32")
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
