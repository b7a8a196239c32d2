"""The model's projections through oneDNN (`models/linear.py`): same results as `F.linear` to rounding,
`F.linear` wherever a gradient is needed or oneDNN cannot run the dtype on this CPU, and the switch
that turns it off."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, shape: tuple[int, ...], bias: bool) -> None:
    """On any CPU, through oneDNN where it runs the dtype and through F.linear where it does not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    got = linear(x, weight, b)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=rtol, atol=atol)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_says_what_onednn_runs(dtype: torch.dtype) -> None:
    """`onednn_runs` agrees with the op itself on this CPU (bf16 fails on AVX2-only CPUs, runs on AVX-512)."""
    x, weight = torch.randn(3, 32).to(dtype), torch.randn(5, 32).to(dtype)
    try:
        torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        runs = True
    except RuntimeError:
        runs = False
    assert linear_module.onednn_runs(dtype) == runs
    assert (linear_module.path_for(dtype) == "oneDNN") == runs
    if not runs:  # what it does instead is exactly F.linear
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_a_dtype_onednn_cannot_run_takes_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN primitive error (bf16 on an AVX2-only CPU) is never the user's: the probe catches it once,
    and a later failure the probe did not foresee switches the dtype to F.linear with one warning."""
    calls: list[torch.dtype] = []

    def failing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.dtype)
        raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation")

    monkeypatch.setattr(linear_module, "ONEDNN_ENABLED", True)
    monkeypatch.setattr(linear_module, "_RUNS", {})
    monkeypatch.setattr(linear_module, "_onednn", failing)
    x, weight = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert calls == [torch.bfloat16] and not linear_module.onednn_runs(torch.bfloat16)  # probed once, never again

    monkeypatch.setattr(linear_module, "_RUNS", {torch.bfloat16: True})  # the probe passed; this call fails
    with pytest.warns(UserWarning, match="using F.linear from now on"):
        assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert linear_module._RUNS[torch.bfloat16] is False


@needs_onednn
def test_a_half_dtype_without_a_kernel_is_widened_from_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 or fp16 that oneDNN cannot run: F.linear below 16 rows, oneDNN's fp32 product from 16 rows,
    rounded back; the two agree with F.linear to the half dtype's rounding."""
    widened: list[torch.dtype] = []
    onednn = linear_module._onednn

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        widened.append(x.dtype)
        return onednn(x, weight, bias)

    monkeypatch.setattr(linear_module, "_RUNS", {torch.bfloat16: False, torch.float16: False, torch.float32: True})
    monkeypatch.setattr(linear_module, "_onednn", spy)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        weight, bias = torch.randn(48, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
        few = torch.randn(15, 64, generator=g).to(dtype)
        assert torch.equal(linear(few, weight, bias), F.linear(few, weight, bias)) and not widened
        many = torch.randn(4, 4, 64, generator=g).to(dtype)  # 16 rows in two leading dimensions
        got = linear(many, weight, bias)
        assert widened == [torch.float32] and got.dtype == dtype and got.shape == (4, 4, 48)
        exact = F.linear(many.double(), weight.double(), bias.double())
        torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=1e-2, atol=1e-2)
        widened.clear()
    assert "oneDNN in float32" in linear_module.path_for(torch.bfloat16)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (2, 5, 64), (0, 64)])
def test_a_packed_weight_gives_what_the_plain_one_gives(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Packed where oneDNN runs the dtype on this CPU (any row count, with and without a bias); not packed where it
    does not, so that `linear` keeps serving the plain weight."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    packed = linear_module.pack_weight(weight)
    if not linear_module.onednn_runs(dtype):
        assert packed is None
        return
    assert packed is not None and packed.is_mkldnn and packed.shape == weight.shape
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for bias in (None, b):
        got = linear_module.packed_linear(x, packed, bias)
        assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=rtol, atol=atol)


def test_nothing_is_packed_that_onednn_would_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert linear_module.pack_weight(torch.randn(8, 16).half()) is None  # no fp16 inner product to pack for
    assert linear_module.pack_weight(torch.randn(16)) is None
    assert linear_module.pack_weight(torch.empty(8, 16, device="meta")) is None
    monkeypatch.setattr(linear_module, "ONEDNN_ENABLED", False)
    assert linear_module.pack_weight(torch.randn(8, 16)) is None


def test_disabled_is_exactly_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "ONEDNN_ENABLED", False)
    x, weight = torch.randn(5, 16), torch.randn(7, 16)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_environment_switch_is_read_at_import() -> None:
    script = "from vllm_kvpress_ext.models import linear; print(linear.ONEDNN_ENABLED)"
    env = {**os.environ, linear_module.DISABLE_ENV: "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
