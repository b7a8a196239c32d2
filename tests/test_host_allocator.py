"""The engine's glibc allocator tuning: the values glibc is asked for, once, and the ways to skip it."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from vllm_kvpress_ext.engine import host_allocator

INT_MAX = 2**31 - 1


def test_thresholds_fit_mallopts_int_argument() -> None:
    """mallopt takes a C int: a larger value would wrap (4 GB became 0 here once: trim everything)."""
    assert 128 * 1024 < host_allocator.MMAP_THRESHOLD <= 32 * 2**20  # glibc's maximum on 64-bit
    assert host_allocator.MMAP_THRESHOLD < host_allocator.TRIM_THRESHOLD <= INT_MAX


def test_mallopt_gets_both_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(parameter: int, value: int) -> int:
        calls.append((parameter, value))
        return 1

    fake_libc = type("FakeLibc", (), {"mallopt": staticmethod(mallopt)})()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake_libc)
    monkeypatch.delenv(host_allocator.DISABLE_ENV, raising=False)
    assert host_allocator.tune_host_allocator.__wrapped__() is True
    assert calls == [
        (host_allocator.M_MMAP_THRESHOLD, host_allocator.MMAP_THRESHOLD),
        (host_allocator.M_TRIM_THRESHOLD, host_allocator.TRIM_THRESHOLD),
    ]
    monkeypatch.setenv(host_allocator.DISABLE_ENV, "1")
    calls.clear()
    assert host_allocator.tune_host_allocator.__wrapped__() is False and not calls


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_the_thresholds() -> None:
    script = "from vllm_kvpress_ext.engine.host_allocator import tune_host_allocator as t; print(t(), t())"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "True"]  # taken, and the second call is the cached answer
