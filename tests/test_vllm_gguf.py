"""`vllm serve model.gguf --kv-policy snapkv`: a GGUF file through vLLM's server and the plugin's worker.

vLLM 0.32 reads no GGUF file itself; the plugin hands its front end a prepared directory (config,
generation config, tokenizer from the file's metadata) and its worker loads the file with this
project's GGUF loader. The served answers (completions and chat, through the `openai` SDK) are the
embedded engine's on the same file, token for token, with the same KV bytes. The preparation and its
refusals are checked directly (fast); one server serves the slow tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from gguf_utils import tiny_model, write_gguf
from model_utils import DenseContext, hf_logits
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from vllm_utils import in_process_worker, vllm_server

from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models import load_config, load_model
from vllm_kvpress_ext.models.tokenizer import load_tokenizer
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.vllm_plugin.gguf_model import (
    MARKER,
    WEIGHTS_MARKER,
    GGUFServeError,
    adapt_engine_args,
    export_model_directory,
    gguf_source,
    is_gguf_spec,
    prepare_gguf_model,
    prepare_gguf_weights,
    refuse_without_plugin,
)

PAGE_SIZE = 16
NUM_PAGES = 400
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", tiny_model("llama", seed=5), "llama")


@pytest.fixture
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPRESS_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------------- preparation (fast)


def test_prepared_directory_is_what_vllm_reads(gguf_file: Path, model_cache: Path) -> None:
    directory = prepare_gguf_model(str(gguf_file))
    assert directory.parent == model_cache / "vllm"
    assert gguf_source(directory) == gguf_file.resolve()
    config = AutoConfig.from_pretrained(str(directory))
    ours = load_config(gguf_file)
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        ours.num_hidden_layers,
        ours.num_attention_heads,
        ours.num_key_value_heads,
    )
    assert config.max_position_embeddings == ours.max_position_embeddings
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(ours.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    reference = load_tokenizer(gguf_file)
    assert tokenizer("hello world").input_ids == reference("hello world").input_ids
    assert tokenizer.chat_template == reference.chat_template
    stamp = (directory / MARKER).stat().st_mtime_ns
    assert prepare_gguf_model(str(gguf_file)) == directory  # prepared once per file
    assert (directory / MARKER).stat().st_mtime_ns == stamp


def test_engine_args_point_at_the_prepared_directory(gguf_file: Path, model_cache: Path) -> None:
    args = SimpleNamespace(model=str(gguf_file), tokenizer=None, served_model_name=None)
    adapt_engine_args(args)
    assert gguf_source(args.model) == gguf_file.resolve()
    assert args.tokenizer == args.model
    assert args.served_model_name == str(gguf_file)  # clients name the model as the user typed it
    mine = SimpleNamespace(model=str(gguf_file), tokenizer="/my/tokenizer", served_model_name=["tiny"])
    adapt_engine_args(mine)
    assert (mine.tokenizer, mine.served_model_name) == ("/my/tokenizer", ["tiny"])
    directory = SimpleNamespace(model="/some/model/dir", tokenizer=None, served_model_name=None)
    adapt_engine_args(directory)
    assert directory.model == "/some/model/dir"  # not a GGUF file: untouched


def test_gguf_specs() -> None:
    assert is_gguf_spec("/x/model.gguf") and is_gguf_spec("model.GGUF")
    assert is_gguf_spec("smollm2-135m")  # a catalog name resolves to its GGUF file
    assert not is_gguf_spec("/x/model-dir") and not is_gguf_spec("org/some-model")


def test_missing_file_is_a_clear_error(tmp_path: Path, model_cache: Path) -> None:
    with pytest.raises(GGUFServeError, match="GGUF file not found"):
        prepare_gguf_model(str(tmp_path / "absent.gguf"))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path, model_cache: Path) -> None:
    path = write_gguf(
        tmp_path / "other.gguf", tiny_model("llama"), "llama", metadata_overrides={"general.architecture": "rwkv9"}
    )
    with pytest.raises(GGUFServeError, match="neither this project nor transformers reads GGUF 'rwkv9' files"):
        prepare_gguf_model(str(path))
    assert not (model_cache / "vllm").exists() or not any((model_cache / "vllm").iterdir())


def test_a_file_without_tokenizer_needs_one_given(tmp_path: Path, model_cache: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf", tiny_model("llama"), "llama", with_tokenizer=False)
    with pytest.raises(GGUFServeError, match="--tokenizer"):
        prepare_gguf_model(str(path))
    directory = prepare_gguf_model(str(path), tokenizer="/some/tokenizer")
    assert gguf_source(directory) == path.resolve() and not (directory / "tokenizer.json").exists()
    with pytest.raises(GGUFServeError, match="--tokenizer"):  # prepared, but still no tokenizer to serve with
        prepare_gguf_model(str(path))


def test_a_prepared_directory_whose_file_is_gone(tmp_path: Path, gguf_file: Path, model_cache: Path) -> None:
    copy = tmp_path / "moved.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    directory = prepare_gguf_model(str(copy))
    copy.unlink()
    with pytest.raises(GGUFServeError, match="no longer exists"):
        gguf_source(directory)


def test_without_the_plugin_a_gguf_file_is_refused_with_the_way_out(gguf_file: Path) -> None:
    with pytest.raises(GGUFServeError, match="--kv-policy"):
        refuse_without_plugin(SimpleNamespace(model=str(gguf_file)))
    refuse_without_plugin(SimpleNamespace(model="/some/model/dir"))  # anything else is vLLM's business


def test_an_exported_directory_is_an_ordinary_model_with_the_files_logits(
    gguf_file: Path, model_cache: Path, tmp_path: Path
) -> None:
    """`kvpress models export`: what transformers (or vLLM without this project) loads from a plain directory, no
    marker tying it to the file, the same logits as this project's loader gives from the file."""
    out = export_model_directory(str(gguf_file), tmp_path / "exported")
    names = {item.name for item in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert MARKER not in names and WEIGHTS_MARKER not in names and gguf_source(out) is None
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(3, load_config(gguf_file).vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    ours = load_model(gguf_file)
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), DenseContext([len(ids)])))
    torch.testing.assert_close(hf_logits(reference, ids), logits, atol=1e-4, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("hello world").input_ids == load_tokenizer(gguf_file)("hello world").input_ids
    with pytest.raises(GGUFServeError, match="not an empty directory"):  # never written over
        export_model_directory(str(gguf_file), out)


def test_models_export_on_the_command_line(
    gguf_file: Path, model_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert main(["models", "export", str(gguf_file), str(out), "--dtype", "bfloat16"]) == 0
    assert str(out) in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"  # what `--dtype auto` reads
    assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
    assert main(["models", "export", str(gguf_file), str(out)]) == 2  # exists: refused
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["models", "export", str(tmp_path / "absent.gguf"), str(tmp_path / "x")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err


def test_pool_sizing_counts_a_gguf_files_weights_dequantised(gguf_file: Path) -> None:
    from vllm_kvpress_ext.vllm_plugin.worker import _weight_bytes

    model = load_model(gguf_file, dtype=torch.float32)
    assert _weight_bytes(gguf_file, "float32") == 4 * sum(p.numel() for p in model.parameters())
    assert _weight_bytes(gguf_file, torch.float16) == 2 * sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- served (slow)


@pytest.fixture(scope="module")
def served_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served-cache")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, gguf_file: Path, served_cache: Path) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("vllm-gguf") / "serve.log"
    args = [
        str(gguf_file),
        "--kv-policy",
        "snapkv",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--additional-config",
        json.dumps({"kv_num_pages": NUM_PAGES}),
    ]
    with vllm_server(args, log_path, {"KVPRESS_MODEL_CACHE": str(served_cache)}) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _embedded(gguf_file: Path, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and KV bytes of the embedded engine on the same file, policy and pool."""
    engine = LLMEngine(gguf_file, dtype=torch.float32, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, params, policy=load_policy("snapkv"))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return list(out.output_token_ids), out.kv.kv_bytes
    raise AssertionError("the request never finished")


@pytest.mark.slow
def test_completion_equals_the_embedded_engine(client: openai.OpenAI, gguf_file: Path) -> None:
    vocab = load_config(gguf_file).vocab_size
    prompt = torch.randint(3, vocab, (150,), generator=torch.Generator().manual_seed(11)).tolist()
    out = client.completions.create(
        model=str(gguf_file),
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens, kv_bytes = _embedded(gguf_file, prompt)
    assert out.choices[0].model_extra["token_ids"] == tokens
    usage = out.usage.model_extra if out.usage else {}
    assert usage["kv_policy"] == "snapkv"
    assert usage["kv_bytes"] == kv_bytes
    assert usage["kv_retention"] < 1.0  # the prompt was compressed
    assert [m.id for m in client.models.list()] == [str(gguf_file)]


@pytest.mark.slow
def test_chat_uses_the_files_template_and_equals_the_embedded_engine(client: openai.OpenAI, gguf_file: Path) -> None:
    messages = [{"role": "user", "content": "hello world " * 20}]
    out = client.chat.completions.create(
        model=str(gguf_file),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    prompt = load_tokenizer(gguf_file).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    assert out.model_extra["prompt_token_ids"] == prompt
    tokens, kv_bytes = _embedded(gguf_file, prompt)
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage is not None and out.usage.model_extra["kv_bytes"] == kv_bytes


@pytest.mark.slow
def test_vllms_runner_serves_a_gguf_file_from_weights_written_once(
    gguf_file: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own runner loads weights with vLLM's loader, which reads no GGUF: the prepared directory gets the
    file's weights as safetensors (once per dtype), and SnapKV there answers as the embedded engine does."""
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams

    # The engine core in this process: forking it from a test process that already ran threads can hang.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vocab = load_config(gguf_file).vocab_size
    prompt = torch.randint(3, vocab, (150,), generator=torch.Generator().manual_seed(12)).tolist()
    additional = {"kv_runner": "vllm", "kv_num_pages": NUM_PAGES, "kv_policy": "snapkv"}
    llm = VllmLLM(
        str(gguf_file), dtype="float32", max_model_len=256, block_size=PAGE_SIZE, additional_config=additional
    )
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        del llm
    tokens, kv_bytes = _embedded(gguf_file, prompt)
    assert list(out.outputs[0].token_ids) == tokens
    assert out.kv_transfer_params["kvpress"]["kv_bytes"] == kv_bytes
    weights = prepare_gguf_model(str(gguf_file)) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert prepare_gguf_weights(weights.parent, "float32") == weights and weights.stat().st_mtime_ns == stamp
    prepare_gguf_weights(weights.parent, "bfloat16")  # another dtype: written again
    assert weights.stat().st_mtime_ns != stamp


@pytest.mark.slow
def test_a_gemma3_file_is_read_by_transformers_and_served_on_vllms_runner(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture this project's loader does not read (Gemma 3, as llama.cpp writes it): transformers reads
    the config and the weights, vLLM's runner is chosen without being asked, and the greedy tokens are those
    of the model the file was written from, with the sliding-window layer holding its window only."""
    import transformers
    from gguf_utils import write_gemma3_gguf
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams

    from vllm_kvpress_ext.assets import default_model_dir

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,  # the default pattern: five sliding-window layers, then a global one
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=512,
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0, 0.5)  # not the initial zeros, which a skipped norm would also pass
    path = write_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", model)
    prompt = list(range(3, 60))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    expected = out[0, len(prompt) :].tolist()

    llm = VllmLLM(
        str(path),
        tokenizer=str(default_model_dir()),  # the file carries none
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        block_size=PAGE_SIZE,
        additional_config={"kv_num_pages": NUM_PAGES, "kv_policy": "full"},
    )
    try:
        params = VllmSamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        pool = in_process_worker(llm).model_runner.pool
        held = pool.cache.seq_lens[:, next(iter(pool.seats.values())).row].tolist()
    finally:
        del llm
    assert list(result.outputs[0].token_ids) == expected
    assert pool.cache.layer_windows.tolist() == [8, 8, 8, 8, 8, 0]
    assert held[:5] == [[8, 8]] * 5  # each sliding-window layer a ring of exactly its window
    assert held[5] == [len(prompt) + NEW_TOKENS - 1] * 2
    directory = prepare_gguf_model(str(path), tokenizer=str(default_model_dir()))
    written = json.loads((directory / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in written
    assert [entry.name for entry in directory.parent.iterdir()] == [directory.name]  # transformers' copies are gone
