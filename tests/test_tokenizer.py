"""The suite's word-level tokenizer: fixed vocabulary, exact round trip, and HF AutoTokenizer loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vllm_kvpress_ext.tasks import tokenizer as vocab
from vllm_kvpress_ext.tasks.synthetic import TASKS, generate
from vllm_kvpress_ext.tasks.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    USER,
    VOCABULARY,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)

ROLE_SETS = {
    "markers": vocab.MARKER_WORDS,
    "keys": vocab.KEY_WORDS,
    "values": vocab.VALUE_WORDS,
    "variables": vocab.VARIABLE_WORDS,
    "filler": vocab.FILLER_WORDS,
    "items": vocab.ITEM_WORDS,
}


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(saved_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(saved_dir)


def test_vocabulary_is_fixed_small_and_role_disjoint() -> None:
    assert len(VOCABULARY) == len(set(VOCABULARY)) <= 1024
    assert VOCABULARY[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert VOCABULARY.index(PAD) == 0  # zero padding is padding
    names = list(ROLE_SETS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not set(ROLE_SETS[a]) & set(ROLE_SETS[b]), (a, b)
    assert sum(len(s) for s in ROLE_SETS.values()) + len(SPECIAL_TOKENS) == len(VOCABULARY)
    # Pinned: ids of a trained model depend on this exact order.
    assert VOCABULARY.index("key") == 7 and VOCABULARY.index("0") == 171 and len(VOCABULARY) == 527


def test_encode_adds_bos_one_token_per_word_and_decodes_exactly() -> None:
    tok = build_tokenizer()
    text = "key fox is 53 . var x12 = x3 . what is key fox ? answer :"
    enc = tok.encode(text)
    assert enc.tokens[0] == BOS
    assert enc.tokens[1:] == text.split()
    assert tok.decode(enc.ids) == text
    assert tok.encode("unknownword").tokens == [BOS, UNK]
    assert tok.encode(f"{USER} key fox {ASSISTANT}", add_special_tokens=False).tokens == [USER, "key", "fox", ASSISTANT]


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [None, 96, 700])
def test_round_trip_and_no_unk_for_every_family(task: str, length: int | None) -> None:
    tok = build_tokenizer()
    unk = tok.token_to_id(UNK)
    for seed in range(3):
        params = {"context_length": length} if length else {"context_length": None}
        for filler in ("random", "noise"):
            sample = generate(task, seed, filler=filler, **params)
            for text in (sample.prompt, sample.answer, *(q for q, _ in sample.turns)):
                ids = tok.encode(text).ids
                assert unk not in ids
                assert tok.decode(ids) == text


def test_saved_files_load_with_auto_tokenizer(saved_dir: Path, hf: PreTrainedTokenizerBase) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (saved_dir / name).is_file()
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert len(hf) == len(VOCABULARY)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == (BOS, EOS, PAD, UNK)
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in config

    raw = build_tokenizer()
    sample = generate("niah_multikey", 0, context_length=128)
    ids = hf(sample.prompt)["input_ids"]
    assert ids == raw.encode(sample.prompt).ids
    assert ids[0] == hf.bos_token_id
    assert hf.decode(ids, skip_special_tokens=True) == sample.prompt


def test_chat_template_renders_single_spaced_turns(hf: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "here we go ."},
        {"role": "user", "content": "key fox is 53 . what is key fox ? answer :"},
        {"role": "assistant", "content": "53"},
        {"role": "user", "content": "what is key fox ? answer :"},
    ]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos> <|system|> here we go . <|user|> key fox is 53 . what is key fox ? answer : "
        "<|assistant|> 53 <eos> <|user|> what is key fox ? answer : <|assistant|>"
    )
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ids.count(hf.bos_token_id) == 1  # the template's <bos> is not doubled by the post-processor
    assert hf.decode(ids) == text
    with pytest.raises(Exception, match="unsupported role"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
