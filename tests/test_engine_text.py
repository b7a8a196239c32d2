"""Text in, text out: the engine with the suite's tokenizer (stop strings, chat template)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("text-model"))


def test_text_prompts_and_stop_strings(text_model: Path) -> None:
    llm = LLM(text_model, dtype=torch.float32, num_pages=256, page_size=4)
    prompt = "key trout is 65 . what is key trout ? answer :"
    free_run = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    words = free_run.text.split()
    assert len(free_run.output_token_ids) == 12 and words
    stop = words[2] if len(words) > 2 else words[0]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text.split()
    assert free_run.text.startswith(stopped.text.strip())
    assert llm.engine.cache.pool.num_used == 0


def test_chat_template(text_model: Path) -> None:
    llm = LLM(text_model, dtype=torch.float32, num_pages=256, page_size=4)
    out = llm.chat([{"role": "user", "content": "what is key trout ?"}], SamplingParams(max_tokens=4, temperature=0))
    assert out.finished and len(out.output_token_ids) >= 1
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is key trout ?"}], add_generation_prompt=True, tokenize=False
    )
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.split()[:2] == ["<bos>", "<|user|>"]
