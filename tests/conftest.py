"""Shared test settings: tolerances (written once, STYLE.md) and markers.

Markers: `gpu` (needs CUDA; deselected by default via pyproject addopts), `slow`.
"""

from __future__ import annotations

import pytest
import torch

# relative tolerances by arithmetic
FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
BF16_RTOL = 1e-2


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = FP32_RTOL, atol: float = FP32_ATOL,
                 what: str = "") -> None:
    """allclose with max/mean error in the failure message, and identical NaN/inf positions."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what} shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{what} NaN positions differ"
    assert torch.equal(torch.isinf(a), torch.isinf(e)), f"{what} inf positions differ"
    finite = torch.isfinite(e)
    err = (a - e).abs()[finite]
    bound = (atol + rtol * e.abs())[finite]
    if not bool((err <= bound).all()):
        raise AssertionError(f"{what} max err {err.max().item():.3e}, mean err {err.mean().item():.3e}, "
                             f"worst ratio {(err / bound).max().item():.2f}")


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # a fixed, small thread count keeps CPU timings and results stable on the 2-core CI box
    torch.set_num_threads(2)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
