"""GGUF loading: dequantisation against known tensors, metadata -> config, logits parity, tokenizer, errors.

Every file here is written by the test itself (tests/gguf_utils.py), so nothing is downloaded.
Tolerance for logits: 1e-4 absolute (float32), both against the HF model the file was written from
(float tensors) and against transformers' own GGUF loader on a quantised file (same bytes, so the
same dequantised weights: only float32 summation order differs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_utils import (
    MIXED_TYPES,
    dequantize_q4_k,
    dequantize_q6_k,
    random_q4_k,
    random_q6_k,
    tiny_model,
    tokens,
    write_gguf,
)
from model_utils import DenseContext, hf_logits

from vllm_kvpress_ext.models import (
    GGUFFile,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedModelError,
    load_config,
    load_model,
    load_tokenizer,
)
from vllm_kvpress_ext.models.gguf_weights import unpermute_rows
from vllm_kvpress_ext.models.tokenizer import gguf_tokenizer_cache

ATOL = 1e-4


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), DenseContext([len(ids)])))  # type: ignore[operator]


def _ids(n: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, len(tokens()), (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted tokenizers are cached under the model cache: keep them out of the user's."""
    monkeypatch.setenv("KVPRESS_MODEL_CACHE", str(tmp_path / "model-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """Float and mixed-quantisation files of a Llama (permuted q/k) and a Qwen2 (tied, q/k/v bias)."""
    out: dict[str, tuple[object, Path]] = {}
    for arch in ("llama", "qwen2"):
        hf = tiny_model(arch, seed=3)
        base = tmp_path_factory.mktemp(arch)
        out[f"{arch}-f32"] = (hf, write_gguf(base / f"{arch}-f32.gguf", hf, arch))
        out[f"{arch}-mixed"] = (hf, write_gguf(base / f"{arch}-mixed.gguf", hf, arch, MIXED_TYPES))
    return out


# ---------------------------------------------------------------- reading and dequantising


def test_dequantise_every_type_against_known_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    known = rng.normal(0.0, 1.0, (8, 64)).astype(np.float32)
    q4k, q6k = random_q4_k(2, 512, rng), random_q6_k(2, 512, rng)
    from gguf import quants

    extra = {f"t.{t.name}": (quants.quantize(known, t), t) for t in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)}
    extra |= {"t.F32": (known, Q.F32), "t.F16": (known.astype(np.float16), Q.F16)}
    extra |= {"t.Q4_K": (q4k, Q.Q4_K), "t.Q6_K": (q6k, Q.Q6_K)}
    path = write_gguf(tmp_path / "types.gguf", tiny_model("llama"), extra_tensors=extra)
    f = GGUFFile(path)

    for name in extra:
        assert f.tensor_type(name) == name.removeprefix("t.")
    assert f.tensor_shape("t.F32") == (8, 64) and f.tensor_shape("t.Q6_K") == (2, 512)
    np.testing.assert_array_equal(f.tensor("t.F32"), known)
    np.testing.assert_array_equal(f.tensor("t.F16"), known.astype(np.float16).astype(np.float32))
    bf16 = torch.from_numpy(known).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(f.tensor("t.BF16"), bf16)
    # Block quants: within half a quantisation step of the original (step = block absmax / levels).
    blocks = np.abs(known.reshape(8, 2, 32)).max(-1, keepdims=True)
    for name, levels in (("t.Q8_0", 127), ("t.Q4_0", 8)):
        err = np.abs(f.tensor(name) - known).reshape(8, 2, 32)
        assert (err <= blocks / levels * 0.5 + 2e-3 * blocks).all(), name
    spans = np.ptp(known.reshape(8, 2, 32), axis=-1, keepdims=True)
    err = np.abs(f.tensor("t.Q4_1") - known).reshape(8, 2, 32)
    assert (err <= spans / 15 * 0.5 + 2e-3 * spans).all()
    # K-quants: exactly what ggml's block layout says.
    np.testing.assert_allclose(f.tensor("t.Q4_K"), dequantize_q4_k(q4k), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(f.tensor("t.Q6_K"), dequantize_q6_k(q6k), rtol=1e-5, atol=1e-7)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    from gguf_utils import llama_cpp_permute

    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(weight, heads=8))
    assert not torch.equal(permuted, torch.from_numpy(weight))
    torch.testing.assert_close(unpermute_rows(permuted, 8), torch.from_numpy(weight), atol=0, rtol=0)
    with pytest.raises(ModelLoadError, match="cannot un-permute"):
        unpermute_rows(torch.zeros(12, 2), 4)


def test_metadata_maps_to_config(files: dict) -> None:
    _, path = files["llama-mixed"]
    config = load_config(path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (64, 96, 16)
    assert config.vocab_size == len(tokens()) and config.max_position_embeddings == 256
    assert config.rope_theta == 50_000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    assert not config.tie_word_embeddings and config.eos_token_ids == (2,) and config.bos_token_id == 1
    qwen = load_config(files["qwen2-f32"][1])
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.tie_word_embeddings and qwen.attention_bias


# ---------------------------------------------------------------- logits parity


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_file_matches_the_hf_model_it_was_written_from(files: dict, arch: str) -> None:
    hf, path = files[f"{arch}-f32"]
    ids = _ids()
    torch.testing.assert_close(_logits(load_model(path), ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantised_file_matches_transformers_gguf_loader(files: dict, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    _, path = files[f"{arch}-mixed"]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = _ids(seed=2)
    ours = _logits(load_model(path), ids)
    torch.testing.assert_close(ours, hf_logits(reference.eval(), ids), atol=ATOL, rtol=0)


def test_dtype_asked_for_and_auto(files: dict, tmp_path: Path) -> None:
    _, path = files["llama-mixed"]
    assert next(load_model(path).parameters()).dtype == torch.float32
    assert next(load_model(path, dtype="bf16").parameters()).dtype == torch.bfloat16
    assert next(load_model(path, dtype="auto").parameters()).dtype == torch.float32  # quantised -> float32
    f16 = write_gguf(tmp_path / "f16.gguf", tiny_model("llama"), metadata_overrides={"general.file_type": 1})
    assert next(load_model(f16, dtype="auto").parameters()).dtype == torch.float16


# ---------------------------------------------------------------- tokenizer and engine


@pytest.mark.parametrize("from_cache", [False, True])
def test_tokenizer_and_chat_template_from_metadata(files: dict, from_cache: bool) -> None:
    _, path = files["llama-mixed"]
    tok = load_tokenizer(path)
    assert (gguf_tokenizer_cache(path) / "tokenizer.json").is_file()
    if from_cache:
        tok = load_tokenizer(path)
    vocab = tokens()
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids == [vocab.index("hello"), vocab.index("Ġworld")]
    assert tok.decode(tok.encode("héllo, world!", add_special_tokens=False)) == "héllo, world!"
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_engine_serves_a_gguf_file(files: dict) -> None:
    from vllm_kvpress_ext.engine.llm import LLM
    from vllm_kvpress_ext.engine.sampling_params import SamplingParams

    _, path = files["llama-mixed"]
    llm = LLM(path, kv_memory=1 << 20, kv_policy="snapkv")
    out = llm.chat([{"role": "user", "content": "hello world"}], SamplingParams(max_tokens=4, temperature=0))
    assert llm.tokenizer is not None and 1 <= len(out.output_token_ids) <= 4


def test_server_accepts_a_gguf_path(files: dict, tmp_path: Path) -> None:
    from vllm_kvpress_ext.server.config import ModelDirError, ServerConfig, resolve_model_dir

    _, path = files["llama-f32"]
    assert resolve_model_dir(path) == path
    assert ServerConfig(model_dir=path).model_name == "llama-f32"
    with pytest.raises(ModelDirError, match="GGUF file not found"):
        resolve_model_dir(tmp_path / "absent.gguf")


# ---------------------------------------------------------------- errors


def test_errors_name_the_problem(files: dict, tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="GGUF file not found"):
        load_model(tmp_path / "absent.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_config(fake)
    gpt2 = write_gguf(tmp_path / "gpt2.gguf", tiny_model("llama"), metadata_overrides={"general.architecture": "x"})
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'x' is not supported"):
        load_model(gpt2)
    wrong = write_gguf(tmp_path / "wrong.gguf", tiny_model("llama"), metadata_overrides={"llama.block_count": 3})
    with pytest.raises(ModelLoadError, match=r"missing tensors for layers\.2\."):
        load_model(wrong)
    no_tok = write_gguf(tmp_path / "notok.gguf", tiny_model("llama"), with_tokenizer=False)
    assert load_tokenizer(no_tok) is None


def test_a_copy_without_fields_keeps_every_other_field_and_every_tensor(files: dict, tmp_path: Path) -> None:
    """`write_without_fields` (what transformers is handed instead of a file with a large vocabulary): the
    dropped fields are gone, every other field and every tensor's bytes are the original's, and llama.cpp's
    own reader reads the copy."""
    from gguf import GGUFReader

    _, path = files["llama-mixed"]
    original = GGUFFile(path)
    arrays = [
        key for key, value in original.metadata.items() if key.startswith("tokenizer.") and isinstance(value, list)
    ]
    assert "tokenizer.ggml.tokens" in arrays
    copy = GGUFFile(original.write_without_fields(tmp_path / "light.gguf", drop=arrays))
    assert copy.metadata == {k: v for k, v in original.metadata.items() if k not in arrays}
    assert copy.tensor_names() == original.tensor_names()
    for name in original.tensor_names():
        assert copy.tensor_type(name) == original.tensor_type(name)
        np.testing.assert_array_equal(copy.tensor(name), original.tensor(name))
    reader = GGUFReader(tmp_path / "light.gguf")
    assert set(reader.fields) == {*copy.metadata, "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert [t.name for t in reader.tensors] == original.tensor_names()


def test_a_damaged_file_is_named_with_what_is_wrong(files: dict, tmp_path: Path) -> None:
    """The header reader's own checks: a cut header, cut tensor data, an unknown version."""
    _, path = files["llama-mixed"]
    whole = path.read_bytes()
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(whole[:200])
    with pytest.raises(ModelLoadError, match="truncated: its header"):
        GGUFFile(header_cut)
    data_cut = tmp_path / "data-cut.gguf"
    data_cut.write_bytes(whole[:-64])
    damaged = GGUFFile(data_cut)  # the header is whole: the last tensor's bytes are not
    last = damaged.tensor_names()[-1]
    with pytest.raises(ModelLoadError, match=f"truncated: tensor {last}"):
        damaged.tensor(last)
    future = tmp_path / "future.gguf"
    future.write_bytes(whole[:4] + (99).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ModelLoadError, match="GGUF version 99"):
        GGUFFile(future)


def test_a_gemma3_file_as_llama_cpp_writes_it_gives_transformers_logits(tmp_path: Path) -> None:
    """llama.cpp's Gemma 3: norms stored plus one, `ffn_norm` before the MLP, and the layer pattern, the sliding
    layers' RoPE base and the attention scale left to its code (every sixth layer global, 10000, 1/sqrt(d))."""
    from gguf_utils import write_gemma3_gguf
    from model_utils import randomised
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    )
    hf = randomised(Gemma3ForCausalLM(config), seed=4)
    model = load_model(write_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", hf))
    assert model.config.layer_windows == (4, 4, 4, 4, 4, None)
    ids = torch.randint(0, 128, (13,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(13), DenseContext([13], model.config)))
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)
