"""The model's projections through oneDNN (`models/linear.py`): same results as `F.linear` to rounding,
`F.linear` wherever a gradient is needed, and the switch that turns it off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vllm_kvpress_ext.models import linear as linear_module
from vllm_kvpress_ext.models.linear import Linear, linear

needs_onednn = pytest.mark.skipif(not linear_module.ONEDNN_ENABLED, reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_equals_f_linear(dtype: torch.dtype, shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    got = linear(x, weight, b)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=rtol, atol=atol)


def test_gradients_take_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection that needs a gradient (gate training backpropagates through the frozen model) must
    never reach the oneDNN op, which has no backward."""
    calls: list[str] = []

    class Spy:
        def _linear_pointwise(self, *args: object) -> torch.Tensor:
            calls.append("onednn")
            raise AssertionError("no oneDNN call with a gradient")

    monkeypatch.setattr(linear_module, "ONEDNN_ENABLED", True)
    layer = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops, "mkldnn", Spy())
        layer(x).sum().backward()  # weight and input both require grad here
    assert x.grad is not None and layer.weight.grad is not None and not calls


def test_disabled_is_exactly_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "ONEDNN_ENABLED", False)
    x, weight = torch.randn(5, 16), torch.randn(7, 16)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_environment_switch_is_read_at_import() -> None:
    script = "from vllm_kvpress_ext.models import linear; print(linear.ONEDNN_ENABLED)"
    env = {**os.environ, linear_module.DISABLE_ENV: "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
