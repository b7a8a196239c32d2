"""Write gates belong to the runner that loaded them: engines never share gates, rewritten files are reloaded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_utils import write_suite_model

from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models import load_config
from vllm_kvpress_ext.models.write_gate import GateStore, WriteGates
from vllm_kvpress_ext.policies import WGKVPolicy

WINDOW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_suite_model(tmp_path_factory.mktemp("gate-store") / "model", hidden=32)


def constant_gates(path: Path, model_dir: Path, value_logit: float) -> Path:
    """Gates whose output is sigmoid(value_logit) for every key: +20 admits all, -20 none."""
    config = load_config(model_dir)
    gates = WriteGates(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    with torch.no_grad():
        gates.w2.zero_()
        gates.b2.fill_(value_logit)
    return gates.save(path, {"local_window": WINDOW})


def kept_and_full(engine: LLMEngine, gates: Path) -> tuple[int, int]:
    rng = random.Random(0)
    prompt = [rng.randrange(10, 400) for _ in range(40)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, params, policy={"name": "wgkv", "gates": str(gates)})
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out.kv.tokens_kept, out.kv.tokens_full
    raise AssertionError("the request did not finish")


def test_two_engines_with_different_gate_files_do_not_share_gates(model_dir: Path, tmp_path: Path) -> None:
    admit_all = constant_gates(tmp_path / "all.wgkv.safetensors", model_dir, 20.0)
    admit_none = constant_gates(tmp_path / "none.wgkv.safetensors", model_dir, -20.0)
    first = LLMEngine(model_dir, num_pages=256, page_size=WINDOW)
    second = LLMEngine(model_dir, num_pages=256, page_size=WINDOW)
    kept, full = kept_and_full(first, admit_all)
    assert kept == full  # every key admitted
    kept, full = kept_and_full(second, admit_none)
    assert kept < full  # only the ring's last WINDOW tokens per head
    kept, full = kept_and_full(first, admit_all)
    assert kept == full  # the second engine's gates did not leak into the first
    assert len(first.runner.gate_store) == len(second.runner.gate_store) == 1
    assert first.runner.gate_store is not second.runner.gate_store
    mine = first.runner.gate_store.get(admit_all)
    assert mine is first.runner.gate_store.get(admit_all)  # loaded once per runner
    assert mine is not second.runner.gate_store.get(admit_all)


def test_a_store_reloads_a_rewritten_file(model_dir: Path, tmp_path: Path) -> None:
    path = constant_gates(tmp_path / "g.wgkv.safetensors", model_dir, 20.0)
    store = GateStore()
    before = store.get(path)
    constant_gates(path, model_dir, -20.0)  # retrained in place
    after = store.get(path)
    assert after is not before
    assert float(after.b2.detach().flatten()[0]) == -20.0 and float(before.b2.detach().flatten()[0]) == 20.0
    assert len(store) == 1  # the stale version is dropped, not kept beside the new one


def test_a_policy_without_a_store_loads_its_gates_afresh(model_dir: Path, tmp_path: Path) -> None:
    path = constant_gates(tmp_path / "g.wgkv.safetensors", model_dir, 20.0)
    policy = WGKVPolicy(gates=str(path))
    cpu = torch.device("cpu")
    assert policy.admission(model_dir, cpu).gates is not policy.admission(model_dir, cpu).gates
    store = GateStore()
    assert policy.admission(model_dir, cpu, store).gates is policy.admission(model_dir, cpu, store).gates


def test_a_store_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no write gates at"):
        GateStore().get(tmp_path / "missing.wgkv.safetensors")


def test_a_workers_heads_of_the_gates_gate_as_all_of_them_do() -> None:
    """Under tensor parallelism a worker holds some KV heads, under pipeline parallelism a stage some layers: their
    gates (`WriteGates.part`) give exactly what the whole model's gates give those heads and layers; asked twice,
    the same object."""
    import torch

    from vllm_kvpress_ext.models.write_gate import WriteGates

    torch.manual_seed(0)
    gates = WriteGates(num_layers=2, num_kv_heads=4, head_dim=8)
    k_pre, k = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    part = gates.part(0, 2, 2, 2)
    assert part is gates.part(0, 2, 2, 2) and part.num_kv_heads == 2
    assert torch.equal(part(1, k_pre[:, 2:], k[:, 2:]), gates(1, k_pre, k)[:, 2:])
    stage = gates.part(1, 1, 0, 4)  # the second of two stages: layer 1 is its layer 0
    assert stage.num_layers == 1 and torch.equal(stage(0, k_pre, k), gates(1, k_pre, k))
    assert gates.part(0, 2, 0, 4) is gates
    with pytest.raises(ValueError, match="not among these gates' 4"):
        gates.part(0, 2, 3, 2)
    with pytest.raises(ValueError, match="layers \\[1, 3\\) are not among these gates' 2"):
        gates.part(1, 2, 0, 4)
