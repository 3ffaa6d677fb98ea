"""Shared test settings: tolerances (written once, STYLE.md) and markers.

Markers: `gpu` (needs CUDA; deselected by default via pyproject addopts), `slow`.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; this must be set before any module
# that defines @triton.jit functions is imported (conftest is imported before the test modules).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# relative tolerances by arithmetic
FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
BF16_RTOL = 1e-2


def load_script(path: str):
    """A repository script (`benchmarks/x.py`, `scripts/y.py`) imported as a module, to call its `main(argv)`."""
    import importlib.util
    from pathlib import Path

    file = Path(__file__).parents[1] / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_result(script: str):
    """Run `script` (Python source) in a subprocess with Triton's compiler, not its interpreter (which cannot
    compile for a GPU: the sm_90a tests compile through `benchmarks/sass.py`); the JSON it printed after "RESULT "."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


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


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float) -> None:
    """Every parameter's gradient of `got` within `rel` of `want` in norm, relative to the larger of its own norm and
    1 % of the largest (a near-zero gradient is judged against the model's scale); prints the worst."""
    assert got.keys() == want.keys()
    biggest = max(v.norm().item() for v in want.values())
    errs = {n: (got[n] - v).norm().item() / max(v.norm().item(), 1e-2 * biggest) for n, v in want.items()}
    worst = max(errs, key=errs.get)
    print(f"{len(errs)} gradients, worst rel err {errs[worst]:.1e} ({worst})")
    assert errs[worst] <= rel, f"gradient of {worst}: rel err {errs[worst]:.1e}"


def randomize_mixing(model, seed: int) -> None:
    """Init makes mHC mixing near-identity and sinks zero; tests want every coefficient to matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for which in ("attn", "ffn"):
                getattr(layer, f"hc_{which}_fn").normal_(0, 0.05, generator=g)
                getattr(layer, f"hc_{which}_base").normal_(0, 0.5, generator=g)
            layer.attn.attn_sink.normal_(0, 1.0, generator=g)


def engine_test_model(seed: int, **changes):
    """`tiny` with the cache formats on (qat) and randomized mixing: what engine tests compare."""
    from dsv41 import load_config
    from dsv41.model.transformer import Transformer

    model = Transformer(load_config("tiny").replace(qat=True, **changes)).init_weights(seed=seed).eval()
    randomize_mixing(model, seed)
    return model


# intra-op threads per test process: 2 for a lone pytest on the 2-core CI box, 1 in each pytest-xdist
# worker (scripts/test.sh runs two) and in each of scripts/mutants.py's parallel workers
TEST_THREADS = int(os.environ.get("DSV41_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # a fixed, small thread count keeps CPU timings and results stable on the 2-core CI box
    torch.set_num_threads(TEST_THREADS)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
