"""`kvpress bench kvpress-parity` without kvpress: overlap arithmetic, the worker's JSON protocol, errors.

kvpress itself lives in its own venv and never in the test venv; the worker is replaced here by a fake
executable that speaks the same protocol (request file in, result file out).
"""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path

import pytest
import torch

from vllm_kvpress_ext.bench import kvpress_parity as parity
from vllm_kvpress_ext.bench import kvpress_parity_worker as worker
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.policies import load_policy


def mask(rows: list[list[int]], n: int) -> torch.Tensor:
    """`[1, len(rows), n]` bool mask keeping the listed positions of each head."""
    out = torch.zeros(1, len(rows), n, dtype=torch.bool)
    for head, kept in enumerate(rows):
        out[0, head, kept] = True
    return out


def test_overlap_by_hand() -> None:
    ours = mask([[0, 1, 2, 3], [0, 1, 2, 3]], 8)
    ref = mask([[0, 1, 2, 3], [0, 1, 6, 7]], 8)
    stats = parity.overlap_stats(ours, ref)
    assert stats == {"common": 6.0, "ref_kept": 8.0, "ours_kept": 8.0, "same": 1.0, "pairs": 2.0}
    agg = parity.aggregate_overlap([stats, parity.overlap_stats(ref, ref)])
    assert agg == {"overlap": 14 / 16, "same_sets": 3 / 4, "kept_ours": 4.0, "kept_kvpress": 4.0}


def test_overlap_counts_unequal_budgets_and_rejects_shape_mismatch() -> None:
    ours = mask([[0, 1, 2]], 6)
    ref = mask([[1, 2, 3, 4]], 6)
    agg = parity.aggregate_overlap([parity.overlap_stats(ours, ref)])
    assert agg["overlap"] == 2 / 4 and agg["same_sets"] == 0.0
    assert (agg["kept_ours"], agg["kept_kvpress"]) == (3.0, 4.0)
    with pytest.raises(ValueError, match="differ in shape"):
        parity.overlap_stats(ours, mask([[1]], 5))
    assert all(v != v for v in parity.aggregate_overlap([]).values())  # NaN: nothing to compare


def test_overlap_over_chosen_layers_leaves_the_others_out() -> None:
    """A model with sliding-window layers is compared on its global layers: a difference elsewhere is not
    counted."""
    ours = torch.zeros(3, 1, 8, dtype=torch.bool)
    ours[:, :, :4] = True
    ref = ours.clone()
    ref[0] = ~ref[0]  # layer 0 (a ring here) disagrees everywhere
    assert parity.aggregate_overlap([parity.overlap_stats(ours, ref)])["same_sets"] == pytest.approx(2 / 3)
    chosen = parity.aggregate_overlap([parity.overlap_stats(ours, ref, layers=[1, 2])])
    assert chosen == {"overlap": 1.0, "same_sets": 1.0, "kept_ours": 4.0, "kept_kvpress": 4.0}


def test_a_model_with_sliding_window_layers_leaves_out_what_kvpress_cannot_run_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = parity.ParityConfig(model="m", policies=("snapkv", "expected_attention"))
    changed = parity._sliding_window_config(config)
    assert changed.policies == ("snapkv",) and not changed.kvpress_accuracy and changed.accuracy
    out = capsys.readouterr().out
    assert "left out on a model with sliding-window layers (kvpress 0.5.5 fails there): expected_attention" in out
    assert "kvpress's answers are not measured" in out
    with pytest.raises(ValueError, match=r"kvpress 0\.5\.5 runs none of expected_attention"):
        parity._sliding_window_config(parity.ParityConfig(model="m", policies=("expected_attention",)))


def test_worker_and_bench_share_the_mask_encoding() -> None:
    g = torch.Generator().manual_seed(0)
    kept = torch.rand(3, 2, 37, generator=g) > 0.5  # 222 bits: not a multiple of 8
    encoded = worker._pack(kept)
    assert encoded == parity.pack_mask(kept)
    assert torch.equal(parity.unpack_mask(encoded, [3, 2, 37]), kept)
    with pytest.raises(ValueError, match="needs"):
        parity.unpack_mask(encoded, [3, 2, 64])


def test_matched_budgets_follow_kvpress_rules() -> None:
    # kvpress keeps int(n * (1 - c)) with c = 1 - r: 99 of 1000 at r = 0.1 (1 - 0.9 = 0.0999...), not 100.
    assert parity.kvpress_kept(1000, 0.1) == 99 and parity.kvpress_kept(1015, 0.5) == 507
    snap = parity.project_policy("snapkv", 0.1, 1000)
    assert snap["tokens"] == 99 and snap["count_include_pad"] is True and snap["window"] == 64
    pyramid = parity.project_policy("pyramidkv", 0.25, 1000)
    assert pyramid["schedule"] == "window_inside" and pyramid["ratio"] == 1 - (1 - 0.25)
    assert parity.project_policy("streaming_llm", 0.5, 10)["tokens"] == 5
    variant = parity.project_policy("pyramidkv", 0.25, 1000, parity.VARIANTS["pyramidkv"])
    assert variant["schedule"] == "window_outside"
    for name in parity.PARITY_POLICIES:  # every spec is a valid policy of this project
        assert load_policy(parity.project_policy(name, 0.25, 1000)) is not None
        run = parity.kvpress_run(name, 0.25)
        assert run["compression_ratio"] == 0.75 and run["press"] == name and run["id"] == f"{name}-0.25"
    assert parity.item_policy("streaming_llm-0.25") == "streaming_llm"
    expected = parity.project_policy("expected_attention", 0.1, 1000)
    assert expected["tokens"] == 99 and expected["future_positions"] == 512 and expected["sink_tokens"] == 4
    # KVzip: kvpress prunes int(N c) in all, so it keeps N (1 - c) rounded up; 1011 - int(758.25) = 253.
    kvzip = parity.project_policy("kvzip", 0.25, 1011)
    assert kvzip["tokens"] == 253 and kvzip["skip_header"] is True and kvzip["allocation"] == "global"


FAKE_WORKER = """\
import json, sys
sys.path.insert(0, {root!r})
import torch
from vllm_kvpress_ext.bench.kvpress_parity_worker import _pack
_, script, request_path, result_path = sys.argv
request = json.load(open(request_path))
if request.get("fail"):
    print("loading the model", file=sys.stderr)
    print("RuntimeError: the fake worker failed", file=sys.stderr)
    sys.exit(3)
layers, heads = 2, 1
if request["model_dir"] != "unused":  # the bench's HF export: read the shape as kvpress would
    config = json.load(open(request["model_dir"] + "/config.json"))
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
results = []
for prompt in request["prompts"]:
    n = len(prompt["context_ids"])
    for run in request["runs"]:
        kept = torch.zeros(layers, heads, n, dtype=torch.bool)
        kept[..., -max(1, int(n * (1 - run["compression_ratio"]))):] = True
        item = {{"prompt": prompt["id"], "run": run["id"], "answer": "fake " + run["press"], "seconds": 0.0}}
        if run["press"] == "full":
            item |= {{"shape": None, "kept": None}}
        else:
            item |= {{"shape": list(kept.shape), "kept": _pack(kept)}}
        results.append(item)
json.dump({{"versions": {{"kvpress": "fake", "script": script}}, "results": results}}, open(result_path, "w"))
"""


def fake_python(tmp_path: Path) -> Path:
    """An executable that runs the fake worker whatever script it is handed (like the venv's python would)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(root=str(Path(__file__).resolve().parents[1])))
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_worker_protocol_round_trip(tmp_path: Path) -> None:
    request = {
        "model_dir": "unused",
        "stop_ids": [2],
        "accuracy": True,
        "prompts": [{"id": "p0", "context_ids": list(range(10)), "question_ids": [1, 2], "max_new_tokens": 4}],
        "runs": [parity.kvpress_run("full", None), parity.kvpress_run("snapkv", 0.5)],
    }
    result = parity.run_worker(str(fake_python(tmp_path)), request, tmp_path)
    assert result["versions"]["script"].endswith("kvpress_parity_worker.py")  # the real worker's path is passed
    items = {(r["prompt"], r["run"]): r for r in result["results"]}
    assert items[("p0", "full")]["kept"] is None and items[("p0", "full")]["answer"] == "fake full"
    snap = items[("p0", "snapkv-0.5")]
    kept = parity.unpack_mask(snap["kept"], snap["shape"])
    assert kept.shape == (2, 1, 10) and kept[..., 5:].all() and not kept[..., :5].any()
    sent = json.loads((tmp_path / "request.json").read_text())
    assert sent["runs"][1] == {
        "id": "snapkv-0.5",
        "press": "snapkv",
        "compression_ratio": 0.5,
        "window_size": 64,
        "kernel_size": 5,
    }


def test_worker_failure_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(parity.ParityError, match=r"worker failed .*: RuntimeError: the fake worker failed$"):
        parity.run_worker(str(fake_python(tmp_path)), {"fail": True}, tmp_path)


def test_missing_kvpress_venv_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    code = main(["bench", "kvpress-parity", "--model", str(tmp_path / "m.gguf"), "--kvpress-python", str(missing)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvpress bench kvpress-parity: no kvpress venv:") and "make kvpress-venv" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "h2o"], "unknown parity policy h2o"),
        (["--ratios", "1.0"], r"kept ratios must lie in \(0, 1\)"),
        (["--tasks", "nl_nope"], "unknown natural task"),
        (["--samples", "0"], "samples must be >= 1"),
        (["--context-lens", "64"], "context lengths must be >= 128"),
    ],
)
def test_bad_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(["bench", "kvpress-parity", "--model", str(tmp_path / "m.gguf"), *argv])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvpress bench kvpress-parity: ")
    assert re.search(message, err)


def test_bench_end_to_end_with_a_fake_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole bench on a tiny GGUF model: HF export, forks, kept sets read back, the table."""
    from gguf_utils import tiny_model, write_gguf

    model = tiny_model("llama")
    model.config.max_position_embeddings = 4096
    gguf = write_gguf(tmp_path / "tiny.gguf", model)
    monkeypatch.setenv("KVPRESS_MODEL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["bench", "kvpress-parity", "--model", str(gguf), "--kvpress-python", str(fake_python(tmp_path))]
    argv += ["--tasks", "nl_passkey", "--samples", "1", "--context-lens", "300", "--ratios", "0.5"]
    argv += ["--policies", "streaming_llm,snapkv", "--variants", "--out", str(out)]
    assert main(argv) == 0
    assert (gguf.parent / next(p.name for p in gguf.parent.iterdir() if p.name.startswith("tiny-hf-fp32"))).is_dir()
    result = json.loads((out / "results.json").read_text())
    rows = {(r["policy"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {
        ("full", "matched"),
        ("streaming_llm", "matched"),
        ("snapkv", "matched"),
        ("snapkv", "count_include_pad=False"),
    }
    # The fake worker keeps the most recent int(n r) positions; StreamingLLM keeps the same count, 4 of
    # them sinks: every position but the 4 oldest recent ones is shared, the same count is kept.
    streaming = rows[("streaming_llm", "matched")]
    kept = streaming["kept_kvpress"]
    assert streaming["kept_ours"] == kept and streaming["overlap"] == pytest.approx((kept - 4) / kept)
    assert streaming["same_sets"] == 0.0 and streaming["prompts"] == 1
    assert rows[("full", "matched")]["accuracy_kvpress"] == 0.0  # "fake full" holds no pass key
    answers = result["answers"]
    assert {a.get("kvpress") for a in answers if "kvpress" in a} == {"fake full", "fake streaming_llm", "fake snapkv"}
