"""Parity of `vllm_kvpress_ext.models` with HF transformers, and the loader's error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_utils import FAMILIES, DenseContext, hf_logits, tiny_hf_model
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from vllm_kvpress_ext.models import (
    LlamaFamilyForCausalLM,
    ModelConfig,
    ModelConfigError,
    ModelLoadError,
    RopeScaling,
    UnsupportedModelError,
    apply_rope,
    inverse_frequencies,
    load_config,
    load_model,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Every family saved once as a single-file safetensors checkpoint, with its HF model."""
    out = {}
    for i, family in enumerate(FAMILIES):
        hf = tiny_hf_model(family, seed=i)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path, safe_serialization=True)
        out[family] = (hf, path)
    return out


def _run(model: LlamaFamilyForCausalLM, ids: torch.Tensor, positions: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, ctx))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(saved: dict, family: str) -> None:
    hf, path = saved[family]
    model = load_model(path)
    ids = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(1))
    logits = _run(model, ids, torch.arange(11), DenseContext([11], model.config))
    assert logits.dtype == torch.float32 and logits.shape == (11, 128)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_varlen_batch_matches_per_sequence_transformers(saved: dict, family: str) -> None:
    """Two sequences in one flat batch; positions restart at 0 for the second."""
    hf, path = saved[family]
    model = load_model(path)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 128, (7,), generator=gen), torch.randint(0, 128, (5,), generator=gen)
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    logits = _run(model, torch.cat([a, b]), positions, DenseContext([7, 5], model.config))
    expected = torch.cat([hf_logits(hf, a), hf_logits(hf, b)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "llama2_linear_tied"])
def test_far_positions_match_transformers(saved: dict, family: str) -> None:
    """Positions beyond original_max_position_embeddings, where llama3/linear scaling changes the angles."""
    hf, path = saved[family]
    model = load_model(path)
    ids = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(180, 186)
    torch.testing.assert_close(
        _run(model, ids, positions, DenseContext([6])), hf_logits(hf, ids, positions), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("family", ["llama3", "llama2_linear_tied"])
def test_inverse_frequencies_match_transformers(saved: dict, family: str) -> None:
    hf, path = saved[family]
    config = load_config(path)
    rope_type = hf.config.rope_parameters["rope_type"]
    expected, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf.config)
    assert scaling == 1.0
    ours = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_project_queries_equals_forward_queries(saved: dict, family: str) -> None:
    _, path = saved[family]
    model = load_model(path)
    ctx = DenseContext([5, 4], model.config)
    positions = torch.cat([torch.arange(5), torch.arange(4)])
    _run(model, torch.arange(9), positions, ctx)
    for layer_idx, layer in enumerate(model.layers):
        got = ctx.captured[layer_idx]
        with torch.inference_mode():
            q = layer.self_attn.project_queries(got.hidden, positions)
        torch.testing.assert_close(q, got.q, atol=0, rtol=0)


def test_context_receives_documented_shapes_and_pre_rope_keys(saved: dict) -> None:
    """Qwen3: k_pre_rope is after k_norm and rotates exactly into k; shapes use config head_dim (24)."""
    _, path = saved["qwen3"]
    model = load_model(path)
    ctx = DenseContext([6])
    positions = torch.arange(6)
    _run(model, torch.arange(6), positions, ctx)
    got = ctx.captured[1]
    assert got.hidden.shape == (6, 64)
    assert got.q.shape == (6, 4, 24) and got.k.shape == (6, 2, 24) and got.v.shape == (6, 2, 24)
    cos, sin = model.rotary.cos_sin(positions)
    assert cos.shape == (6, 24)
    torch.testing.assert_close(apply_rope(got.k_pre_rope, cos, sin), got.k, atol=0, rtol=0)
    # k_pre_rope is the k_norm output, not the raw projection
    raw = model.layers[1].self_attn.k_proj(got.hidden).view(6, 2, 24)
    assert not torch.allclose(raw, got.k_pre_rope)


def test_sharded_checkpoint_loads(saved: dict, tmp_path: Path) -> None:
    hf, _ = saved["llama3"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    model = load_model(tmp_path)
    ids = torch.arange(8)
    torch.testing.assert_close(
        _run(model, ids, torch.arange(8), DenseContext([8])), hf_logits(hf, ids), atol=ATOL, rtol=0
    )


def test_pre_v5_config_spelling_parses_identically(saved: dict, tmp_path: Path) -> None:
    """`rope_theta` + `rope_scaling` (with the old "type" key) at top level mean the same as `rope_parameters`."""
    hf, path = saved["llama3"]
    old = _copy(path, tmp_path / "old")
    raw = json.loads((old / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    raw["rope_scaling"] = rope
    (old / "config.json").write_text(json.dumps(raw))
    assert load_config(old) == load_config(path)
    ids = torch.arange(9)
    torch.testing.assert_close(
        _run(load_model(old), ids, torch.arange(9), DenseContext([9])), hf_logits(hf, ids), atol=ATOL, rtol=0
    )


def test_gemma3_pre_v5_config_spelling_parses_identically(saved: dict) -> None:
    """Gemma 3's older config.json: `rope_theta` / `rope_scaling` for the global layers, `rope_local_base_freq`
    for the sliding ones, and the layer pattern as `sliding_window_pattern` rather than `layer_types`."""
    _, path = saved["gemma3"]
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["full_attention"]["rope_theta"]
    raw["rope_scaling"] = {"type": "linear", "factor": rope["full_attention"]["factor"]}
    raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    raw["sliding_window_pattern"] = 2  # layers 0, 2, ... slide; every second is global, as `layer_types` says
    del raw["layer_types"]
    assert ModelConfig.from_dict(raw) == load_config(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
        ({"layer_types": ["local", "full_attention"]}, "unknown layer type"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be positive"),
    ],
)
def test_gemma3_switches_the_model_code_lacks_are_refused(saved: dict, change: dict, message: str) -> None:
    _, path = saved["gemma3"]
    raw = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_bf16_load(saved: dict) -> None:
    hf, path = saved["qwen3"]
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_model(path, dtype="fp16").embed_tokens.weight.dtype == torch.float16
    assert load_model(path, dtype="auto").embed_tokens.weight.dtype == torch.float32  # config.json says float32
    ids = torch.arange(10)
    logits = _run(model, ids, torch.arange(10), DenseContext([10]))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=0.15, rtol=0.05)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_load_matches_cpu(saved: dict, dtype: torch.dtype) -> None:
    _, path = saved["qwen3"]
    ids, positions = torch.arange(12), torch.cat([torch.arange(8), torch.arange(4)])
    cpu = _run(load_model(path, dtype=dtype), ids, positions, DenseContext([8, 4]))
    model = load_model(path, dtype=dtype, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    gpu = _run(model, ids.cuda(), positions.cuda(), DenseContext([8, 4]))
    tol = 1e-3 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(gpu.cpu(), cpu, atol=tol, rtol=0.05)


# ---------------------------------------------------------------- config parsing


def test_config_resolves_family_quirks(saved: dict) -> None:
    llama3 = load_config(saved["llama3"][1])
    assert llama3.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert (llama3.num_attention_heads, llama3.num_key_value_heads, llama3.num_kv_groups) == (4, 2, 2)
    assert llama3.eos_token_ids == (2, 3) and not llama3.tie_word_embeddings
    llama2 = load_config(saved["llama2_linear_tied"][1])
    assert llama2.tie_word_embeddings and llama2.attention_bias and llama2.o_proj_bias and llama2.mlp_bias
    assert llama2.rope_scaling == RopeScaling("linear", 2.0) and llama2.rope_theta == 500.0
    assert load_model(saved["llama2_linear_tied"][1]).lm_head is None
    mistral = load_config(saved["mistral"][1])
    assert mistral.rope_theta == 1e6 and mistral.sliding_window == 4096 and not mistral.attention_bias
    assert mistral.layer_sliding_window(0) == 4096
    qwen2 = load_config(saved["qwen2"][1])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    assert qwen2.sliding_window is None and qwen2.layer_sliding_window(1) is None  # use_sliding_window is false
    qwen3 = load_config(saved["qwen3"][1])
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.hidden_size // qwen3.num_attention_heads == 16


def test_generation_config_eos_is_merged(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert load_config(path).eos_token_ids == (2, 3, 7)


def _raw(**overrides: object) -> dict:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("rope", [{"type": "dynamic", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}])
def test_unknown_rope_type_is_rejected(rope: dict) -> None:
    kind = rope.get("type") or rope.get("rope_type")
    with pytest.raises(ModelConfigError, match=rf"unsupported RoPE type '{kind}'.*default, linear, llama3"):
        ModelConfig.from_dict(_raw(rope_scaling=rope))


def test_config_defaults_and_missing_keys() -> None:
    config = ModelConfig.from_dict(_raw(rope_scaling=None, rope_theta=5e5))
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (8, 2, 5e5)
    assert config.rope_scaling.rope_type == "default" and config.eos_token_ids == (2,)
    assert ModelConfig.from_dict(_raw(architectures=["Qwen3ForCausalLM"])).head_dim == 128  # HF's Qwen3 default
    with pytest.raises(ModelConfigError, match="missing required key 'vocab_size'"):
        ModelConfig.from_dict({k: v for k, v in _raw().items() if k != "vocab_size"})
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict(_raw(num_key_value_heads=3))
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))


# ---------------------------------------------------------------- loader errors


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model directory not found: .*nope"):
        load_model(tmp_path / "nope")


def test_missing_config_json(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_model(path)


def test_unsupported_architecture(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path)


def test_no_safetensors(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights.*found: pytorch_model\.bin"):
        load_model(path)


def test_missing_shard(saved: dict, tmp_path: Path) -> None:
    saved["llama3"][0].save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: {victim.name}"):
        load_model(tmp_path)


def _rewrite_weights(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(path / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["qwen2"][1], tmp_path / "m")
    _rewrite_weights(path, {"model.layers.1.self_attn.k_proj.bias": None})
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(path)


def test_missing_lm_head_when_untied(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["mistral"][1], tmp_path / "m")
    _rewrite_weights(path, {"lm_head.weight": None})
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\).*lm_head\.weight"):
        load_model(path)


def test_unexpected_tensor(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    _rewrite_weights(path, {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ModelLoadError, match=r"1 unexpected tensor\(s\).*model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(path)


def test_ignorable_tensors_are_skipped(saved: dict, tmp_path: Path) -> None:
    """Old checkpoints carry RoPE inv_freq buffers; tied ones may carry a copy of the embedding as lm_head."""
    path = _copy(saved["qwen2"][1], tmp_path / "m")
    emb = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    _rewrite_weights(path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "lm_head.weight": emb})
    assert load_model(path).lm_head is None


def test_shape_mismatch(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved["llama3"][1], tmp_path / "m")
    _rewrite_weights(path, {"model.layers.0.mlp.up_proj.weight": torch.zeros(97, 64)})
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \[97, 64\], expected \[96, 64\]"
    ):
        load_model(path)


def test_bad_dtype(saved: dict) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(saved["llama3"][1], dtype=torch.int8)
