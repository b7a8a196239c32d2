"""`kvpress train-model` trains a few steps on a tiny configuration, exports, and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import hf_greedy
from transformers import AutoModelForCausalLM

from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLM, SamplingParams
from vllm_kvpress_ext.train.model import TrainConfig, make_batch

TINY = [
    "--batch-size",
    "2",
    "--context-len",
    "96",
    "--curriculum",
    "64",
    "--hidden-size",
    "32",
    "--intermediate-size",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--eval-every",
    "2",
    "--eval-samples",
    "2",
    "--checkpoint-every",
    "2",
    "--warmup",
    "2",
]


def test_train_resume_and_export(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train-model", "--out", str(out), "--steps", "2", *TINY]) == 0
    first = torch.load(out / "checkpoint.pt", weights_only=False)
    assert first["step"] == 2
    assert main(["train-model", "--out", str(out), "--steps", "4", "--resume", *TINY]) == 0
    second = torch.load(out / "checkpoint.pt", weights_only=False)
    assert second["step"] == 4
    assert any(not torch.equal(first["model"][k], second["model"][k]) for k in first["model"])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]
    assert all(set(r["eval"]) == set(TrainConfig().tasks) for r in log)

    # The export loads in the engine and in transformers, with identical greedy output.
    model_dir = out / "model"
    llm = LLM(model_dir, dtype=torch.float32, num_pages=128, page_size=4)
    prompt = llm.tokenizer.encode("key trout is 65 . what is key trout ? answer :")
    ours = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].output_token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    ref = hf_greedy(hf, prompt, 6)
    assert ours == ref


def test_stop_after_cuts_a_run_short_on_the_full_schedule(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train-model", "--out", str(out), "--steps", "4", "--stop-after", "2", *TINY]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 2
    assert log[-1]["step"] == 2 and log[-1]["lr"] == TrainConfig(steps=4, warmup=2).lr_at(1)
    # The rest of the schedule follows on resume.
    assert main(["train-model", "--out", str(out), "--steps", "4", "--resume", *TINY]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 4
    assert main(["train-model", "--out", str(tmp_path / "bad"), "--steps", "4", "--stop-after", "0", *TINY]) == 2


def test_resume_refuses_a_different_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train-model", "--out", str(out), "--steps", "2", *TINY]) == 0
    changed = [*TINY]
    changed[changed.index("--hidden-size") + 1] = "64"
    assert main(["train-model", "--out", str(out), "--steps", "4", "--resume", *changed]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_batches_supervise_only_answers() -> None:
    import random

    config = TrainConfig(batch_size=3, context_len=64, tasks={"niah_multikey": 1.0})
    ids, labels = make_batch(config, 0, 64, 0, 0, random.Random(0))
    assert ids.shape == labels.shape and ids.shape[0] == 3
    targets = labels != -100
    assert 0 < int(targets.sum()) < ids.numel() // 4
    # Each label is the next input token.
    assert torch.equal(labels[:, :-1][targets[:, :-1]], ids[:, 1:][targets[:, :-1]])


def test_config_must_use_gqa() -> None:
    with pytest.raises(ValueError, match="grouped-query"):
        TrainConfig(num_heads=4, num_kv_heads=4).validate()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("final_share", 0.0, "final_share"), ("final_share", 1.5, "final_share"), ("rope_theta", 0.0, "rope_theta")],
)
def test_config_rejects_bad_schedule_and_init(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value}).validate()  # type: ignore[arg-type]


def test_task_mixture_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train-model", "--out", str(out), "--steps", "2", "--tasks", "associative_recall:1", *TINY]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert set(log[-1]["eval"]) == {"associative_recall"}
    assert main(["train-model", "--out", str(tmp_path / "bad"), "--steps", "2", "--tasks", "nope:1", *TINY]) == 2
    assert "unknown task" in capsys.readouterr().err


def test_init_from_starts_from_another_runs_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "phase1"
    assert main(["train-model", "--out", str(first), "--steps", "2", *TINY]) == 0
    second = tmp_path / "phase2"
    init = str(first / "checkpoint.pt")
    # Another seed: a fresh initialisation would then be far from phase 1, so a small drift proves the load.
    args = ["train-model", "--out", str(second), "--steps", "1", "--seed", "7", "--init-from", init, *TINY]
    args += ["--checkpoint-every", "1"]
    assert main(args) == 0
    start = torch.load(first / "checkpoint.pt", weights_only=False)["model"]
    after = torch.load(second / "checkpoint.pt", weights_only=False)
    assert after["step"] == 1  # a fresh schedule
    # One small step away from phase 1's weights, not from a fresh initialisation.
    drift = max(float((after["model"][k] - start[k]).abs().max()) for k in start)
    assert drift < 0.01
    # The Adam moments came along: the optimizer has taken phase 1's two steps plus this one.
    adam_steps = {float(v["step"]) for v in after["optimizer"]["state"].values()}
    assert adam_steps == {3.0}
    changed = [*TINY]
    changed[changed.index("--hidden-size") + 1] = "64"
    assert main(["train-model", "--out", str(tmp_path / "x"), "--steps", "1", "--init-from", init, *changed]) == 2
    assert "another shape" in capsys.readouterr().err


def test_copy_task_supervises_the_repeat_and_task_params_reach_the_generators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import random

    from vllm_kvpress_ext.train.model import COPY_TASK, copy_example

    offsets = set()
    for seed in range(8):
        example = copy_example(seed=seed, length=40, span=6)
        ((start, end),) = example.answer_spans
        repeat = example.token_ids[start - 1 : end]  # the first repeated word is a guess, not a target
        assert end == len(example.token_ids) <= 40 and len(repeat) == 6 and len(set(repeat)) == 6
        first = example.token_ids.index(repeat[0])
        assert example.token_ids[first : first + 6] == repeat and first + 6 <= start - 1
        offsets.add(start - first)
    assert len(offsets) > 1  # the repeat's distance varies: position alone cannot find it
    config = TrainConfig(
        batch_size=4,
        tasks={COPY_TASK: 1.0, "associative_recall": 1.0},
        task_params={"associative_recall": {"num_records": 3, "num_queries": 1}, COPY_TASK: {"length": 21}},
    )
    config.validate()
    ids, labels = make_batch(config, 0, 96, 0, 0, random.Random(0))
    assert ids.shape[0] == 4 and bool((labels != -100).any())
    args = ["train-model", "--out", str(tmp_path / "r"), "--steps", "1", *TINY]
    assert main([*args, "--task-param", "associative_recall.num_records=0"]) == 2
    assert "num_records" in capsys.readouterr().err
    assert main([*args, "--task-param", "oops"]) == 2
    assert "TASK.PARAM=VALUE" in capsys.readouterr().err
