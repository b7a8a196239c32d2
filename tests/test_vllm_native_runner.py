"""vLLM's own model runner and model zoo under the plugin (`additional_config={"kv_runner": "vllm"}`) over the
plugin's page pool, with the full cache: exact. Each architecture is a tiny random checkpoint written here
with transformers; vLLM's implementation of it, run by vLLM's `CPUModelRunner` with the plugin's attention
backend, must produce HF transformers' greedy tokens for a batch of prompts of different lengths (prefill
and decode batched together; Gemma 3's sliding window shorter than the prompts)."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from model_utils import write_random_gates
from vllm import LLM
from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_utils import assert_no_page_leaked, in_process_engine, in_process_worker

from vllm_kvpress_ext.models.linear import ONEDNN_ENABLED
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.vllm_plugin.native.adapter import PACKED_WEIGHT
from vllm_kvpress_ext.vllm_plugin.native.support import native_rope

# vLLM's engine core in this process, so the tests can read its scheduler and worker.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures(in_process_engine.__name__)]

COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"eos_token_id": 1, "pad_token_id": 0}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 2.0,  # with the sharpened projections (`write_checkpoint`), the cap matters
            "final_logit_softcapping": 5.0,
        },
    ),
    # Mixtures of experts: vLLM's fused-MoE layer with the plugin's torch experts and routing (native/moe.py).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,  # shorter than both prompts: the first layer attends to a window only
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
# In no list of the project's: its RoPE is not read, its attention is scaled by a multiplier.
GRANITE = ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.2})
# The third prompt is longer than a row's first block-table width (8 pages of 16 tokens): the pool grows it.
PROMPTS = [list(range(5, 17)), list(range(30, 70)), list(range(3, 200))]
NEW_TOKENS = 8
Checkpoints = Callable[[str], tuple[Path, list[list[int]]]]  # architecture -> (checkpoint, HF's greedy tokens)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Each architecture's checkpoint and HF tokens, written once per module. Once, because vLLM serves some
    architectures (OLMo-2) through its Transformers backend, which turns transformers' own model class into
    one that needs a vLLM config: after vLLM has loaded one, transformers cannot build it in this process."""
    root = tmp_path_factory.mktemp("checkpoints")
    written: dict[str, tuple[Path, list[list[int]]]] = {}

    def checkpoint(name: str) -> tuple[Path, list[list[int]]]:
        if name not in written:
            written[name] = write_checkpoint(root, name)
        return written[name]

    return checkpoint


def write_checkpoint(
    root: Path, name: str, spec: tuple[str, str, dict[str, Any]] | None = None
) -> tuple[Path, list[list[int]]]:
    """A random fp32 checkpoint of `name` (from ARCHITECTURES, or `spec`), and HF's greedy continuation of each
    prompt.

    Where the attention caps its logits (Gemma 2), the query and key projections are scaled up tenfold: at this
    size's initial weights the logits stay far below the cap, which would then change nothing. HF's reference
    then runs its eager attention: its SDPA path does not apply the cap."""
    config_name, model_name, extra = spec or ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    if capped:
        config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).eval()
    if capped:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(10.0)
                layer.self_attn.k_proj.weight.mul_(10.0)
    path = root / name
    model.save_pretrained(path)
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(prompt) :].tolist())
    return path, expected


def native_llm(
    path: Path, max_num_batched_tokens: int | None = None, enable_prefix_caching: bool | None = None, **additional: Any
) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_bytes=32 << 20,
        skip_tokenizer_init=True,
        enable_prefix_caching=enable_prefix_caching,
        additional_config={"kv_runner": "vllm", **additional},
    )


def greedy_tokens(llm: LLM) -> list[list[int]]:
    """`llm`'s greedy continuation of each of PROMPTS, NEW_TOKENS tokens each."""
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_vllms_model_code_equals_transformers_token_for_token(name: str, checkpoints: Checkpoints) -> None:
    path, expected = checkpoints(name)
    llm = native_llm(path)
    try:
        assert greedy_tokens(llm) == expected
        assert type(llm.llm_engine.model_config).__name__ == "ModelConfig"
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3"])
def test_chunked_prefill_reads_earlier_chunks_from_the_pool(name: str, checkpoints: Checkpoints) -> None:
    """Steps of at most 16 tokens: the 40-token prompt runs in three chunks beside the other request's decodes,
    each later chunk attending to the earlier ones through the pool (a window layer's chunk reads its ring first)."""
    path, expected = checkpoints(name)
    llm = native_llm(path, max_num_batched_tokens=16)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_compresses_and_frees_what_it_drops(name: str, checkpoints: Checkpoints) -> None:
    """SnapKV and AdaKV at 25 % (and H2O, whose decode steps read the attention) on vLLM's implementation of
    each architecture: every request keeps about a quarter of its prompt per (layer, KV head), says so in its
    figures, and the pool gets the pages back."""
    path, _ = checkpoints(name)
    llm = native_llm(path)
    try:
        pool = in_process_worker(llm).model_runner.pool
        for policy in ({"name": "snapkv", "ratio": 0.25}, {"name": "adakv", "ratio": 0.25}, "h2o"):
            spec = json.dumps(policy) if isinstance(policy, dict) else policy
            params = VllmSamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": spec}
            )
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            for prompt, output in zip(PROMPTS, outputs, strict=True):
                assert len(output.outputs[0].token_ids) == NEW_TOKENS
                figures = output.kv_transfer_params["kvpress"]
                assert figures["kv_tokens_full"] == 2 * 2 * (len(prompt) + NEW_TOKENS - 1)
                if len(prompt) >= 40:  # long enough that a quarter is less than the window SnapKV always keeps
                    assert figures["kv_tokens_kept"] < figures["kv_tokens_full"] / 2
                    assert figures["kv_bytes"] < figures["kv_bytes_peak"]
            assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_sliding_window_layers_hold_only_their_window(name: str, checkpoints: Checkpoints) -> None:
    """The first layer attends to a window of 8: it is a ring of exactly 8 entries per KV head, holding the last
    8 positions, while the full layer holds every token, and the tokens are still HF's (Gemma 2's soft cap on
    the ring too)."""
    path, expected = checkpoints(name)
    llm = native_llm(path)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)
        assert list(outputs[0].outputs[0].token_ids) == expected[2]
        pool = in_process_worker(llm).model_runner.pool
        ((request_id, seat),) = pool.seats.items()  # the finished request, freed at the next step
        written = len(PROMPTS[2]) + NEW_TOKENS - 1
        window_layer, full_layer = pool.cache.seq_lens[:, seat.row].tolist()
        assert window_layer == [8] * len(window_layer)
        assert full_layer == [written] * len(full_layer)
        positions, _ = pool.cache.entry_positions(request_id)
        for head in positions[0]:
            assert sorted(head[:8].tolist()) == list(range(written - 8, written))
        figures = outputs[0].kv_transfer_params["kvpress"]
        assert figures["kv_tokens_kept"] == sum(window_layer) + sum(full_layer) < figures["kv_tokens_full"]
    finally:
        del llm
        gc.collect()


def test_vllms_sampling_features_work_under_compression(checkpoints: Checkpoints) -> None:
    """What the plugin's own runner refuses, vLLM's sampler serves here, with SnapKV compressing: a token
    allow-list, a logit bias, and several samples of one prompt."""
    path, _ = checkpoints("llama")
    llm = native_llm(path, kv_policy={"name": "snapkv", "ratio": 0.25})
    try:
        prompt = [{"prompt_token_ids": PROMPTS[1]}]
        allowed = [7, 11, 13]
        only = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0, allowed_token_ids=allowed)
        (out,) = llm.generate(prompt, only, use_tqdm=False)
        assert set(out.outputs[0].token_ids) <= set(allowed) and len(out.outputs[0].token_ids) == NEW_TOKENS
        biased = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0})
        (out,) = llm.generate(prompt, biased, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == [42] * NEW_TOKENS
        samples = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=1, n=3, ignore_eos=True)
        (out,) = llm.generate(prompt, samples, use_tqdm=False)
        assert len(out.outputs) == 3 and all(len(o.token_ids) == NEW_TOKENS for o in out.outputs)
        assert out.kv_transfer_params["kvpress"]["policy"] == "snapkv"
        assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize(
    ("policy", "missing"),
    [
        ("expected_attention", "the queries before RoPE"),
        ("gvote", "the hidden states' statistics"),
        ("wgkv", "write-time admission gates"),
    ],
)
def test_a_policy_needing_the_projects_rope_is_refused_elsewhere(tmp_path: Path, policy: str, missing: str) -> None:
    """Expected Attention and GVote use the project's RoPE (and GVote the query rows of vLLM's QKV projection),
    WG-KV the keys before RoPE off that projection's output, all known where the project parses the config (the
    Llama family, Gemma 3) or reads the RoPE from it (`ROPE_ARCHITECTURES`). On Granite, in neither, they are
    refused by name, at start and per request."""
    path, _ = write_checkpoint(tmp_path, "granite", GRANITE)
    with pytest.raises(ValueError, match=f"kv_policy '{policy}' needs {missing}"):
        native_llm(path, kv_policy=policy)
    llm = native_llm(path)
    try:
        params = VllmSamplingParams(max_tokens=2, extra_args={"kv_policy": policy})
        with pytest.raises(VLLMValidationError, match=f"needs {missing}"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()


def test_kvzip_runs_under_gemma2s_soft_cap(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVzip's pass applies each layer's logit soft cap, as Gemma 2's attention does (the capped attention and
    scores are checked against a dense reference in test_kvzip.py): the global layer's scores are taken under
    the cap, the layer is compressed, the sliding one stays a ring, and every page comes back."""
    from vllm_kvpress_ext.engine import reconstruction

    caps: list[float | None] = []
    scores = reconstruction.reconstruction_chunk_scores

    def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
        caps.append(kwargs.get("soft_cap"))
        return scores(*args, **kwargs)

    monkeypatch.setattr(reconstruction, "reconstruction_chunk_scores", spied)
    path = with_suite_vocabulary(checkpoints("gemma2")[0], tmp_path / "gemma2")  # its pass writes its prompt with it
    llm = native_llm(path)
    try:
        pool = in_process_worker(llm).model_runner.pool
        assert pool.soft_caps == [2.0, 2.0]
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, extra_args={"kv_policy": "kvzip"})
        long = llm.generate([{"prompt_token_ids": PROMPTS[-1]}], params, use_tqdm=False)[0]
        figures = long.kv_transfer_params["kvpress"]
        assert len(long.outputs[0].token_ids) == NEW_TOKENS and figures["policy"] == "kvzip"
        assert figures["kv_tokens_kept"] < figures["kv_tokens_full"] / 2
        assert caps and set(caps) == {2.0}
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_a_default_write_gate_that_cannot_run_stops_the_engine_at_start(checkpoints: Checkpoints) -> None:
    """WG-KV as the server's policy, on a model with no gates beside it: every request would fail, so the engine
    does not start, and says why."""
    path, _ = checkpoints("llama")
    with pytest.raises(Exception, match="no write gates for this model"):
        native_llm(path, kv_policy="wgkv")


# GVote's votes keep all of these near-uniform models' prompts (it is run below, not held to keep less); the Phi-3
# twin of a sharper one keeps what the embedded engine keeps, GVote included (test_vllm_native_policies.py).
@pytest.mark.parametrize("name", ["phi3", "olmo2", "gemma2", "mixtral", "qwen3_moe"])
def test_policies_needing_the_rope_run_where_the_config_gives_it(
    checkpoints: Checkpoints, name: str, tmp_path: Path
) -> None:
    """Architectures the project's model code does not implement, which rotate with the RoPE their config
    describes (`ROPE_ARCHITECTURES`): Expected Attention, KVzip, WG-KV (whose gates read the keys before RoPE off
    the hooked QKV projection) and GVote run on each. Phi-3 runs on vLLM's Llama implementation, OLMo-2 on vLLM's
    Transformers backend, whose query and key norms span all heads (what the hook reads is checked against HF's
    modules in test_the_hooked_projection_reads_olmo2s_normed_queries_and_keys), Gemma 2 under its logit soft cap,
    Mixtral and Qwen3-MoE (a key norm per head) with their experts. Where vLLM rotates with its own rotary
    embedding, its table is the project's RoPE."""
    path = with_suite_vocabulary(checkpoints(name)[0], tmp_path / name)  # KVzip's pass writes its prompt with it
    write_random_gates(path)
    llm = native_llm(path)
    try:
        pool = in_process_worker(llm).model_runner.pool
        if name != "olmo2":  # HF's own rotary module on vLLM's Transformers backend
            assert_rope_is_vllms(llm, path)
        for policy in ("expected_attention", "kvzip", "wgkv"):
            params = VllmSamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": policy}
            )
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            long = outputs[-1]  # 197 tokens: every policy's default keeps less than all of it
            assert len(long.outputs[0].token_ids) == NEW_TOKENS, policy
            figures = long.kv_transfer_params["kvpress"]
            assert figures["policy"] == policy and figures["kv_tokens_kept"] < figures["kv_tokens_full"], policy
            assert_no_page_leaked(pool)
        # GVote votes to keep all of this near-uniform model's prompt: it runs, its queries off the hooked projection.
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, extra_args={"kv_policy": "gvote"})
        gvote = llm.generate([{"prompt_token_ids": PROMPTS[-1]}], params, use_tqdm=False)[0]
        assert (
            len(gvote.outputs[0].token_ids) == NEW_TOKENS and gvote.kv_transfer_params["kvpress"]["policy"] == "gvote"
        )
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_the_hooked_projection_reads_olmo2s_normed_queries_and_keys(checkpoints: Checkpoints) -> None:
    """OLMo-2 normalises its queries and keys over all heads at once, before RoPE. What the runner reads off vLLM's
    fused projection (GVote's queries, WG-KV's keys) equals that, computed here from the checkpoint's tensors."""
    from safetensors.torch import load_file

    from vllm_kvpress_ext.vllm_plugin.native.adapter import projection
    from vllm_kvpress_ext.vllm_plugin.native.support import layer_projections

    path, _ = checkpoints("olmo2")
    tensors = load_file(str(path / "model.safetensors"))
    eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
    hidden = torch.randn(5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))

    def normed(name: str, layer: int, heads: int) -> torch.Tensor:
        prefix = f"model.layers.{layer}.self_attn."
        x = hidden @ tensors[prefix + f"{name}_proj.weight"].T
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * tensors[prefix + f"{name}_norm.weight"]
        return x.view(5, heads, -1)

    llm = native_llm(path)
    try:
        model = in_process_worker(llm).model_runner.model
        found = layer_projections(model, list(range(COMMON["num_hidden_layers"])))
        assert found is not None
        for layer, hooked in enumerate(found):
            fused = projection(hooked.module, hidden, hooked.module.weight, None)
            torch.testing.assert_close(hooked.queries(hidden), normed("q", layer, COMMON["num_attention_heads"]))
            torch.testing.assert_close(hooked.keys(fused), normed("k", layer, COMMON["num_key_value_heads"]))
    finally:
        del llm
        gc.collect()


def with_suite_vocabulary(checkpoint: Path, path: Path) -> Path:
    """`checkpoint` with the synthetic suite's tokenizer, its embeddings (and output rows) grown to that vocabulary
    with rows of the same scale. Done on the saved tensors: transformers cannot build some architectures (OLMo-2)
    again in a process where vLLM has loaded one."""
    from safetensors.torch import load_file, save_file

    from vllm_kvpress_ext.tasks.tokenizer import VOCABULARY, save_tokenizer

    path.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = len(VOCABULARY)
    weights = load_file(checkpoint / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if tensor.shape[0] == config["vocab_size"] and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            extra = torch.randn(vocab - tensor.shape[0], *tensor.shape[1:], generator=generator) * tensor.std()
            weights[name] = torch.cat([tensor, extra.to(tensor.dtype)])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    save_tokenizer(path)
    return path


def test_kvzip_runs_on_an_architecture_whose_rope_the_project_does_not_know(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """KVzip needs no RoPE: its reconstruction pass runs vLLM's model over the repeat prompt and attends with the
    project's softmax over the row. Granite (outside `ROPE_ARCHITECTURES`, its attention scaled by a multiplier)
    compresses under it, while Expected Attention, which needs the RoPE, is refused there by name."""
    path, _ = write_checkpoint(tmp_path, "granite", GRANITE)
    path = with_suite_vocabulary(path, tmp_path / "granite-suite")
    llm = native_llm(path)
    try:
        params = VllmSamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": "kvzip"}
        )
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)
        figures = out.kv_transfer_params["kvpress"]
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert figures["policy"] == "kvzip" and figures["kv_tokens_kept"] < figures["kv_tokens_full"] / 2
        assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
        refused = VllmSamplingParams(max_tokens=2, extra_args={"kv_policy": "expected_attention"})
        with pytest.raises(VLLMValidationError, match="needs the queries before RoPE"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], refused, use_tqdm=False)
    finally:
        del llm
        gc.collect()


def assert_rope_is_vllms(llm: LLM, path: Path) -> None:
    """The RoPE the project builds from the model's config (`native_rope`) equals the cos/sin table of every
    layer's rotary embedding in vLLM's implementation, which rotates full-width in the "rotate_half" layout."""
    rope = native_rope(path)
    assert rope is not None
    model = in_process_worker(llm).model_runner.model
    rotaries = [m.rotary_emb for n, m in model.named_modules() if n.endswith("self_attn")]
    assert len(rotaries) == COMMON["num_hidden_layers"]
    for rotary in rotaries:
        assert rotary.is_neox_style and rotary.rotary_dim == rotary.head_size
        table = rotary.cos_sin_cache.float()  # [positions, rotary_dim]: cos of each pair, then sin
        cos, sin = rope.cos_sin(torch.arange(table.shape[0]))
        half = rotary.rotary_dim // 2
        torch.testing.assert_close(cos[:, :half].float(), table[:, :half], rtol=0, atol=1e-5)
        torch.testing.assert_close(sin[:, :half].float(), table[:, half:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16])
def test_write_gates_under_gemma2s_soft_cap_attend_as_transformers(
    checkpoints: Checkpoints, tmp_path: Path, max_num_batched_tokens: int | None
) -> None:
    """WG-KV on Gemma 2, whose attention caps its logits: gates that admit every key (tau 0) leave the full cache,
    so the tokens are HF's; gates that admit none leave the full layer a window of `local_window` (the slash of
    the vertical-slash mask, then the local ring at decode), so the tokens are those of HF's Gemma 2 with that
    layer sliding too. In one prefill and in chunks of 16 (later chunks read the row, rebuilt by position)."""
    from vllm_kvpress_ext.models.write_gate import WriteGates, default_gate_path

    # The ring is whole pages (16 tokens), so the sliding layer's window is 16 too: HF has one window for both.
    config_name, model_name, extra = ARCHITECTURES["gemma2"]
    path, expected = write_checkpoint(tmp_path, "gemma2", (config_name, model_name, {**extra, "sliding_window": 16}))
    config = json.loads((path / "config.json").read_text())
    gates = WriteGates(config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"], init_bias=-30.0)
    with torch.no_grad():
        gates.w2.zero_()  # every gate value is sigmoid(-30): at least tau 0, below tau 0.1
    gates.save(default_gate_path(path), {"local_window": 16})
    torch.manual_seed(0)
    both_sliding = transformers.Gemma2Config(**{**config, "layer_types": ["sliding_attention"] * 2})
    both_sliding._attn_implementation = "eager"  # the one that applies the cap
    sliding = transformers.Gemma2ForCausalLM.from_pretrained(path, config=both_sliding).eval()
    windowed = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = sliding.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            windowed.append(out[0, len(prompt) :].tolist())
    assert windowed[2] != expected[2]  # the window changes what the long prompt says
    llm = native_llm(path, max_num_batched_tokens=max_num_batched_tokens)
    try:
        pool = in_process_worker(llm).model_runner.pool
        for tau, tokens in ((0.0, expected), (0.1, windowed)):
            spec = json.dumps({"name": "wgkv", "tau": tau})
            params = VllmSamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_policy": spec}
            )
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == tokens, tau
            assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


@pytest.mark.skipif(not ONEDNN_ENABLED, reason="torch without oneDNN")
@pytest.mark.parametrize("name", ["qwen2", "gemma3"])  # a bias on the QKV projection; a head tied to the embedding
def test_projections_run_from_packed_weights_and_free_the_plain_ones(name: str, checkpoints: Checkpoints) -> None:
    """Once loaded, every projection's weight is packed for oneDNN and its plain copy freed; the vocabulary head is
    packed and keeps its weight (Gemma 3's is the embedding). The tokens stay HF's, and the query rows that GVote
    projects synthetic hidden states through equal the checkpoint's `q_proj` (Qwen2's, with its bias)."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    path, expected = checkpoints(name)
    llm = native_llm(path)
    try:
        assert greedy_tokens(llm) == expected
        runner = in_process_worker(llm).model_runner
        modules = list(runner.model.modules())
        projections = [m for m in modules if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)]
        assert len(projections) == 4 * COMMON["num_hidden_layers"]  # QKV, output, gate-up and down of each layer
        assert all(PACKED_WEIGHT in m.__dict__ and m.weight.numel() == 0 for m in projections)
        (head,) = [m for m in modules if isinstance(m, ParallelLMHead)]
        assert PACKED_WEIGHT in head.__dict__ and head.weight.shape[1] == COMMON["hidden_size"]
        if name != "qwen2":
            return
        checkpoint = load_file(path / "model.safetensors")
        hidden = torch.randn(5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
        heads, head_dim = COMMON["num_attention_heads"], COMMON["hidden_size"] // COMMON["num_attention_heads"]
        assert runner.pool.query_projections is not None
        for layer, project in enumerate(runner.pool.query_projections):
            prefix = f"model.layers.{layer}.self_attn.q_proj"
            want = torch.nn.functional.linear(hidden, checkpoint[f"{prefix}.weight"], checkpoint[f"{prefix}.bias"])
            torch.testing.assert_close(project(hidden), want.view(5, heads, head_dim), rtol=1e-5, atol=1e-5)
    finally:
        del llm
        gc.collect()


def test_a_bad_runner_name_is_refused(checkpoints: Checkpoints) -> None:
    path, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="kv_runner must be one of"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, additional_config={"kv_runner": "mine"})


def test_a_mixture_of_experts_model_with_shared_experts_is_refused_at_start(tmp_path: Path) -> None:
    """Qwen2-MoE's shared expert is not among what the plugin's torch experts run (Qwen3-MoE and Mixtral are,
    above): refused up front, by name."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    )
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match="mixture-of-experts layers of Qwen3MoeForCausalLM"):
        native_llm(tmp_path / "moe")


def test_the_cache_is_the_projects_pool_and_every_page_comes_back(checkpoints: Checkpoints) -> None:
    """vLLM's layers get no cache of vLLM's; the pool holds each request's tokens in every (layer, KV head),
    the finished requests' figures say so, and every page is free again afterwards. (Without vLLM's prefix
    caching: with it, a request's full blocks are also kept for later requests, and its bytes count half of
    each such page, as for any page two holders share.)"""
    path, expected = checkpoints("llama")
    llm = native_llm(path, enable_prefix_caching=False)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        worker = in_process_worker(llm)
        pool = worker.model_runner.pool
        cache = pool.cache
        assert (cache.num_layers, cache.num_kv_heads, cache.head_dim) == (2, 2, 16)
        assert all(kv.numel() == 0 for kv in worker.model_runner.kv_caches)  # vLLM allocated nothing
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            figures = output.kv_transfer_params["kvpress"]
            # The last sampled token is never written: the request finishes before it would be attended.
            written = len(prompt) + NEW_TOKENS - 1
            assert figures["policy"] == "full"
            assert figures["kv_tokens_full"] == figures["kv_tokens_kept"] == 2 * 2 * written
            assert figures["kv_bytes"] == 2 * 2 * -(-written // cache.page_size) * cache.pool.bytes_per_page
        assert_no_page_leaked(pool)
        # Finished requests leave the pool at the next step (vLLM names them in its next schedule).
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert list(again[0].outputs[0].token_ids) == expected[0]
        assert len(pool.seats) == 1 and next(iter(pool.seats)).startswith(again[0].request_id)
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_a_pool_with_room_for_one_request_serves_every_request_exactly(checkpoints: Checkpoints) -> None:
    """vLLM's scheduler starts requests by the pool's pages (`KVPressScheduler`): with room for one request at
    a time the batch still runs, one request after the other, token for token."""
    path, expected = checkpoints("llama")
    # 2 layers x 2 KV heads x ceil(47 / 16) pages = 12 for the longer request; not enough for both at once.
    llm = native_llm(path, kv_num_pages=14)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected[:2]
        assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
    finally:
        del llm
        gc.collect()


def test_a_request_preempted_for_pages_resumes_and_ends_exactly(checkpoints: Checkpoints) -> None:
    """16 pages hold both prompts (4 + 12) but not the shorter one's growth past 16 tokens: vLLM's scheduler
    preempts the other request for it (by the pool's report), the pool frees that row at once, and the
    request recomputes from its first token into a fresh row, ending with HF's tokens."""
    path, expected = checkpoints("llama")
    llm = native_llm(path, kv_num_pages=16)
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected[:2]
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.metrics.preemptions >= 1
        assert sum(o.kv_transfer_params["kvpress"]["preemptions"] for o in outputs) == scheduler.metrics.preemptions
        assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("long_first", [False, True])
def test_a_prompt_the_pool_cannot_hold_fails_alone(checkpoints: Checkpoints, long_first: bool) -> None:
    """Refused by the scheduler once the pool's size is known (`long_first=False`), or, as the very first
    request, failed by the pool when its pages do not fit; the other request runs either way."""
    path, expected = checkpoints("llama")
    llm = native_llm(path, kv_num_pages=8)  # 4 pages per 16 tokens: the 12-token prompt fits, the 40-token one not
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = PROMPTS[1::-1] if long_first else PROMPTS[:2]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        short, long = outputs[::-1] if long_first else outputs
        assert list(short.outputs[0].token_ids) == expected[0]
        assert long.outputs[0].finish_reason == "error" and not long.outputs[0].token_ids
        assert_no_page_leaked(in_process_worker(llm).model_runner.pool)
    finally:
        del llm
        gc.collect()


def test_vllms_prefix_caching_reads_kept_blocks_and_answers_as_without_it(checkpoints: Checkpoints) -> None:
    """vLLM's prefix caching, on by default: a later request reads the whole blocks of an earlier one's prompt
    from the pool (vLLM reports them cached) and answers token for token as with caching off. A compressing
    request keeps its prompt's full blocks just before its policy compresses, and reads those before its
    policy's observation window (`KVPolicy.reusable_prefix`); a request without a policy reads them all."""
    path, _ = checkpoints("llama")
    shared = list(range(5, 85))  # five blocks of 16
    prompts = [shared + [100 + i] * 7 for i in range(3)]
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(llm: LLM, **extra: Any) -> list[tuple[list[int], int]]:
        sampling = params.clone()
        sampling.extra_args = extra or None
        outputs = [llm.generate([{"prompt_token_ids": p}], sampling, use_tqdm=False)[0] for p in prompts]
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]

    uncached = native_llm(path, enable_prefix_caching=False)
    try:
        assert in_process_worker(uncached).model_runner.pool.prefix_blocks is None
        expected = run(uncached)
        expected_snapkv = run(uncached, kv_policy="snapkv")
    finally:
        del uncached
        gc.collect()
    llm = native_llm(path)
    try:
        pool = in_process_worker(llm).model_runner.pool
        snapkv = load_policy("snapkv")
        assert snapkv is not None
        readable = snapkv.reusable_prefix(len(prompts[0])) // 16 * 16  # whole blocks before the window
        assert 16 <= readable < 80
        got = run(llm, kv_policy="snapkv")
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected_snapkv]
        assert [cached for _, cached in got] == [0, readable, readable]
        assert pool.prefix_blocks is not None and len(pool.prefix_blocks.kept) >= 5  # kept before compressing
        assert run(llm) == [(expected[i][0], 80) for i in range(3)]
        # A policy whose statistics span every prompt token (Expected Attention) reads nothing.
        assert [cached for _, cached in run(llm, kv_policy="expected_attention")] == [0, 0, 0]
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16])
def test_prefix_caching_rebuilds_the_rings_of_sliding_window_layers(
    tmp_path: Path, max_num_batched_tokens: int | None
) -> None:
    """Gemma 3 with a window of two blocks: the sliding-window layer is a ring, yet every block of a request
    without a policy is kept whole (its ring tokens also go to the block's own pages), and a request that hits
    five blocks starts with its ring rebuilt from the last two. Tokens equal caching off, whole prompts or
    chunks of 16, and no page leaks."""
    config_name, model_name, extra = ARCHITECTURES["gemma3"]
    path, _ = write_checkpoint(tmp_path, "gemma3", (config_name, model_name, {**extra, "sliding_window": 32}))
    shared = list(range(5, 85))  # five blocks of 16
    prompts = [shared + [100 + i] * 7 for i in range(3)]
    params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(llm: LLM) -> list[tuple[list[int], int]]:
        outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]

    uncached = native_llm(path, max_num_batched_tokens, enable_prefix_caching=False)
    try:
        expected = run(uncached)
    finally:
        del uncached
        gc.collect()
    llm = native_llm(path, max_num_batched_tokens)
    try:
        pool = in_process_worker(llm).model_runner.pool
        assert pool.cache.layer_windows.tolist() == [32, 0]
        assert run(llm) == [(expected[0][0], 0), (expected[1][0], 80), (expected[2][0], 80)]
        assert pool.prefix_blocks is not None and len(pool.prefix_blocks.kept) >= 5
        assert_no_page_leaked(pool)
    finally:
        del llm
        gc.collect()


def test_kept_blocks_give_their_pages_up_before_any_request_fails(checkpoints: Checkpoints) -> None:
    """A pool with room for about two prompts serves twelve different ones in turn: each finished request's
    blocks stay cached until the pool needs their pages, and no request fails for lack of them."""
    path, _ = checkpoints("llama")
    llm = native_llm(path, kv_num_pages=64)  # 2 layers x 2 KV heads: 16 pages a head, 256 tokens of one request
    try:
        pool = in_process_worker(llm).model_runner.pool
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for seed in range(12):
            prompt = [10 + (seed * 7 + i) % 200 for i in range(100)]
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            assert len(out.outputs[0].token_ids) == NEW_TOKENS and out.outputs[0].finish_reason == "length"
            assert_no_page_leaked(pool)
        assert pool.prefix_blocks is not None and 0 < len(pool.prefix_blocks.kept) * 4 <= pool.cache.pool.num_pages
    finally:
        del llm
        gc.collect()
