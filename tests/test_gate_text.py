"""`kvpress train-gate --data text`: natural text found on the machine, held-out split, fp16 gate files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.models.write_gate import WriteGates, gate_metadata, load_gates
from vllm_kvpress_ext.train import text_corpus
from vllm_kvpress_ext.train.text_corpus import Document, local_documents, text_windows

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "


@pytest.fixture()
def doc_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /usr/share/doc: 40 packages with a README each, one too short, one duplicated."""
    root = tmp_path / "doc"
    for i in range(40):
        (root / f"pkg{i}").mkdir(parents=True)
        (root / f"pkg{i}" / "README.md").write_text(f"Package {i}. " + SENTENCE * (10 + i))
    (root / "tiny").mkdir()
    (root / "tiny" / "README").write_text("too short")
    (root / "copy").mkdir()
    (root / "copy" / "README.txt").write_text((root / "pkg3" / "README.md").read_text())
    (root / "pkg0" / "changelog.gz").write_bytes(b"\x1f\x8b")
    monkeypatch.setattr(text_corpus, "DEBIAN_DOC_ROOT", root)
    return root


class WordTokenizer:
    """One id per distinct word (enough to cut windows), 0 as end of text."""

    eos_token_id = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [self.ids.setdefault(w, len(self.ids) + 1) for w in text.split()]}


def test_local_documents_reads_docs_skips_short_compressed_and_duplicate_files(doc_root: Path) -> None:
    docs = local_documents(("debian",))
    names = [d.name for d in docs]
    # In path order; the short README and the compressed file are left out, and of pkg3's README and its
    # copy only the first one met (copy/ sorts first) is kept.
    assert names == sorted(names) and len(docs) == 40
    assert set(names) == {"debian:copy/README.txt"} | {f"debian:pkg{i}/README.md" for i in range(40) if i != 3}
    assert docs[0].text.startswith("Package 3.")
    held = [d for d in docs if d.held_out]
    assert 0 < len(held) < len(docs)
    # The split depends on the name only.
    assert Document(held[0].name, "other text").held_out


def test_local_documents_rejects_unknown_sources() -> None:
    with pytest.raises(ValueError, match="unknown text source"):
        local_documents(("python", "web"))
    with pytest.raises(ValueError, match="unknown text source"):
        local_documents(())


def test_python_and_pip_sources_find_text_on_any_installation() -> None:
    python = local_documents(("python",))
    pip = local_documents(("pip",))
    assert any(d.name == "python:json/__init__.py" for d in python)
    assert any(d.name.startswith("pip:torch-") for d in pip)
    assert all(len(d.text) >= text_corpus.MIN_CHARS for d in python + pip)


def test_text_windows_cut_training_and_held_out_streams(doc_root: Path) -> None:
    windows = text_windows(WordTokenizer(), 32, ("debian",))
    assert windows.train.shape[1] == windows.held_out.shape[1] == 32
    facts = windows.facts
    assert facts["train_documents"] + facts["held_out_documents"] == 40
    assert facts["train_windows"] == len(windows.train) == facts["train_tokens"] // 32
    assert int((windows.train == 0).sum()) > 0  # documents are joined by the end-of-text token
    with pytest.raises(ValueError, match="not enough local text"):
        text_windows(WordTokenizer(), 100_000, ("debian",))


def test_gates_saved_in_fp16_load_as_fp32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gates = WriteGates(2, 2, 8, hidden=16)
    path = gates.save(tmp_path / "g.safetensors", {"lambda": 0.1}, dtype=torch.float16)
    loaded = load_gates(path)
    assert loaded.w1.dtype == torch.float32
    assert torch.equal(loaded.w1, gates.w1.detach().half().float())
    assert path.stat().st_size < 0.6 * gates.save(tmp_path / "g32.safetensors").stat().st_size
    assert gate_metadata(path)["lambda"] == 0.1


def test_train_gate_on_text_reduces_its_loss_and_evaluates_held_out(
    tmp_path: Path, doc_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_kvpress_ext.train import gate

    model_dir = write_suite_model(tmp_path / "model", hidden=64, max_positions=256)
    monkeypatch.setattr("vllm_kvpress_ext.models.tokenizer.load_tokenizer", lambda path: _bounded(WordTokenizer()))
    config = gate.GateTrainConfig(
        model_dir=str(model_dir),
        out=str(tmp_path / "g.wgkv.safetensors"),
        data="text",
        text_sources=("debian",),
        lam=0.5,
        local_window=8,
        steps=12,
        batch_size=2,
        context_len=48,
        lr=3e-2,
        warmup=2,
        eval_samples=3,
        save_dtype="float16",
    )
    path, summary = gate.train_gates(config, progress=False)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["data"]["data"] == "text" and summary["data"]["held_out_documents"] > 0
    held = summary["held_out"]
    assert held["samples"] == 3 and held["tokens"] == 3 * 48
    assert 0.0 <= held["top1_agreement"] <= 1.0 and held["cross_entropy_gated"] > 0
    assert len(summary["admitted_per_layer_head"]) == 2
    assert load_gates(path).num_layers == 2


def _bounded(tokenizer: WordTokenizer, vocab: int = 200) -> Any:
    """The suite model's vocabulary is small: fold word ids into it (1..vocab-1, 0 = end of text)."""

    class Bounded:
        eos_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            ids = tokenizer(text)["input_ids"]
            return {"input_ids": [1 + i % (vocab - 1) for i in ids]}

    return Bounded()


def test_train_gate_rejects_bad_text_configs(tmp_path: Path) -> None:
    from vllm_kvpress_ext.train.gate import GateTrainConfig, train_gates

    model_dir = write_suite_model(tmp_path / "model", hidden=64, max_positions=256)
    out = str(tmp_path / "g")
    bad: list[tuple[dict[str, Any], str]] = [
        ({"data": "web"}, "data must be one of suite, text"),
        ({"text_sources": ("nope",)}, "unknown text source"),
        ({"save_dtype": "int8"}, "save dtype must be one of"),
        ({"eval_samples": 0}, "eval samples must be >= 1"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            train_gates(GateTrainConfig(model_dir=str(model_dir), out=out, **fields), progress=False)
    gguf = tmp_path / "model.bin"
    gguf.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_gates(GateTrainConfig(model_dir=str(gguf), out=out), progress=False)


def test_gates_shipped_for_catalog_models_are_found_for_the_pulled_file(tmp_path: Path) -> None:
    from vllm_kvpress_ext.hub.catalog import CATALOG
    from vllm_kvpress_ext.models.write_gate import default_gate_path, find_gates, shipped_gates
    from vllm_kvpress_ext.policies import WGKVPolicy

    shipped = shipped_gates()
    assert {"smollm2-135m", "smollm2-135m-lambda0.02", "smollm2-135m-lambda0.3"} <= set(shipped)
    pulled = tmp_path / CATALOG["smollm2-135m"].file_name  # where `kvpress models pull` puts it (no need to exist)
    assert find_gates(pulled) == shipped["smollm2-135m"]
    assert WGKVPolicy().gate_path(pulled) == shipped["smollm2-135m"]
    assert WGKVPolicy(gates="smollm2-135m-lambda0.3").gate_path(pulled) == shipped["smollm2-135m-lambda0.3"]
    # Gates beside the file win over the shipped ones; another model gets no shipped gates.
    WriteGates(30, 3, 64, hidden=8).save(default_gate_path(pulled))
    assert find_gates(pulled) == default_gate_path(pulled)
    other = tmp_path / "other.gguf"
    assert find_gates(other) == default_gate_path(other) and not find_gates(other).exists()
    # Every shipped file has its model's shape (SmolLM2: 30 layers x 3 KV heads of 64; Gemma 3 270M: 18 x 1 of
    # 256) and records its training and held-out figures.
    shapes = {"smollm2-135m": (30, 3, 64), "gemma3-270m": (18, 1, 256)}
    assert {"gemma3-270m", "gemma3-270m-lambda0.08"} <= set(shipped)
    for name, path in shipped.items():
        shape = next(shape for model, shape in shapes.items() if name == model or name.startswith(f"{model}-lambda"))
        gates = load_gates(path)
        assert (gates.num_layers, gates.num_kv_heads, gates.head_dim) == shape, name
        info = gate_metadata(path)
        assert info["data"]["data"] == "text" and info["local_window"] == 64
        assert len(info["admitted_per_layer_head"]) == shape[0] and len(info["admitted_per_layer_head"][0]) == shape[1]
        assert {"cross_entropy_full", "cross_entropy_gated", "top1_agreement"} <= set(info["held_out"])
    assert find_gates(tmp_path / CATALOG["gemma3-270m"].file_name) == shipped["gemma3-270m"]


def test_clients_may_name_shipped_gates_but_never_paths() -> None:
    from vllm_kvpress_ext.models.write_gate import shipped_gates
    from vllm_kvpress_ext.policies import PolicyConfigError
    from vllm_kvpress_ext.policies.files import PolicyFiles

    files = PolicyFiles()
    assert files.resolve("wgkv", "gates", "smollm2-135m-lambda0.02") == str(shipped_gates()["smollm2-135m-lambda0.02"])
    for value in (str(shipped_gates()["smollm2-135m"]), "../smollm2-135m", "nope", 3):
        with pytest.raises(PolicyConfigError, match="paths are not accepted"):
            files.resolve("wgkv", "gates", value)
    with pytest.raises(PolicyConfigError):
        files.resolve("xkv", "profile", "smollm2-135m")


def test_train_gate_command_on_text(
    tmp_path: Path, doc_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_kvpress_ext.cli import main

    model_dir = write_suite_model(tmp_path / "model", hidden=64, max_positions=256)
    monkeypatch.setattr("vllm_kvpress_ext.models.tokenizer.load_tokenizer", lambda path: _bounded(WordTokenizer()))
    out = tmp_path / "g.wgkv.safetensors"
    args = ["train-gate", str(model_dir), "--out", str(out), "--data", "text", "--text-sources", "debian"]
    args += ["--steps", "2", "--batch-size", "2", "--context-len", "32", "--eval-samples", "2", "--warmup", "1"]
    args += ["--local-window", "8", "--hidden", "16", "--save-dtype", "float16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "held-out (2 samples, 64 tokens): next-token cross-entropy" in printed
    info = gate_metadata(out)
    assert info["config"]["hidden"] == 16 and info["data"]["sources"] == ["debian"]
    assert load_gates(out).hidden == 16
    assert main([*args[:6], "--text-sources", "debian,web", *args[8:]]) == 2
    assert "unknown text source(s) web" in capsys.readouterr().err
