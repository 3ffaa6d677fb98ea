"""The dispatch of `kernels.ops`: which implementation runs for which tensors and settings."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dsv41.kernels import ops
from dsv41.kernels.ref import mhc as ref_mhc
from dsv41.kernels.triton import mhc as triton_mhc


def fake(cuda: bool, grad: bool = False):
    """What `_use_triton` reads of a tensor: its device and whether it needs a gradient."""
    return SimpleNamespace(is_cuda=cuda, requires_grad=grad)


def test_auto_picks_triton_only_for_cuda_tensors_without_gradients():
    with ops.use_backend("auto"):
        assert ops._use_triton(fake(True), None, fake(True)) is True
        assert ops._use_triton(fake(True), fake(False)) is False  # one CPU tensor: the twin
        assert ops._use_triton(fake(True, grad=True)) is False  # training: autograd needs the twin
        with torch.no_grad():
            assert ops._use_triton(fake(True, grad=True)) is True  # no graph is recorded
        assert ops._use_triton(None) is False


def test_forcing_a_backend_and_unsupported_dtypes():
    with ops.use_backend("torch"):
        assert ops._impl("mhc", "mhc_split", fake(True)) is ref_mhc.mhc_split
    with ops.use_backend("triton"):
        assert ops._impl("mhc", "mhc_split", fake(False)) is triton_mhc.mhc_split
        assert ops._impl("mhc", "mhc_split", fake(False), supported=False) is triton_mhc.mhc_split
    with ops.use_backend("auto"):
        assert ops._impl("mhc", "mhc_split", fake(True)) is triton_mhc.mhc_split
        assert ops._impl("mhc", "mhc_split", fake(True), supported=False) is ref_mhc.mhc_split


def test_fp16_streams_run_the_twin_under_auto(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "_use_triton", lambda *t: True)  # as if on CUDA
    monkeypatch.setattr(ref_mhc, "mhc_mixes", lambda h, fn, eps: calls.append(h.dtype) or h.new_zeros(()))
    ops.mhc_mixes(torch.zeros(1, 2, 4, 8, dtype=torch.float16), torch.zeros(24, 32), 1e-6)
    assert calls == [torch.float16]


def test_backend_is_scoped_to_the_thread_and_restored():
    seen = {}
    with ops.use_backend("torch"):
        worker = threading.Thread(target=lambda: seen.setdefault("other", ops.backend()))
        worker.start()
        worker.join()
        assert ops.backend() == "torch"
    assert seen["other"] == ops._DEFAULT_BACKEND
    assert ops.backend() == ops._DEFAULT_BACKEND


def test_bad_backend_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        with ops.use_backend("cuda"):
            pass
    monkeypatch.setenv("DSV41_KERNELS", "fast")
    with pytest.raises(ValueError, match="DSV41_KERNELS"):
        ops._initial_backend()
    with pytest.raises(ValueError, match="fmt"):
        ops.rope_quantize(torch.zeros(1, 1, 32), torch.ones(1, 1, 8), torch.zeros(1, 1, 8), "fp2",
                          torch.zeros(1, 18, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.long))


def test_twin_and_triton_agree_through_ops_on_the_cpu():
    g = torch.Generator().manual_seed(3)
    mixes = torch.randn(2, 5, 24, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
    with ops.use_backend("torch"):
        want = ops.mhc_split(mixes, scale, base, 4, 20, 1e-6)
    with ops.use_backend("triton"):  # the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET)
        got = ops.mhc_split(mixes, scale, base, 4, 20, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
