"""The elementwise training kernels compile for the GPU they run on by default (sm_90a), on the CPU, without spills.

`auto` trains RoPE, RMSNorm and SwiGLU on their Triton kernels on CUDA; their other tests run them in Triton's
interpreter, which accepts programs the compiler rejects (in 2026-12 a kernel whose name took two shapes in two
branches passed every interpreter test and failed its first compile on the H200). This test compiles each of them
with Triton's own specialization at `small`'s training shapes (`benchmarks/sass.py`'s compile-instead-of-run) and
runs `ptxas -v` on the PTX: every kernel compiles, none spills registers. In a subprocess without TRITON_INTERPRET
(the interpreter cannot compile)."""

from __future__ import annotations

import pytest
from tests.conftest import compiled_result

SCRIPT = r"""
import json, pathlib, sys, tempfile
sys.path.insert(0, "benchmarks")
import torch
import sass
from triton.runtime import jit
from dsv41.kernels.triton import cache_write, common, norm, swiglu

jit.JITFunction.run = sass._compile_instead_of_run
for module in (common, norm, swiglu, cache_write):
    module.runnable = lambda t: True
bf = torch.bfloat16
x, w, r = torch.randn(256, 384, dtype=bf), torch.randn(384), torch.rand(256)


class Ctx:
    saved_tensors = (x, w, r)
    needs_input_grad = (True, True, False)

    def save_for_backward(self, *tensors):
        pass


norm._RMSNormTrain.forward(Ctx(), x, w, 1e-20)
norm._RMSNormTrain.backward(Ctx(), x)
g, rw = torch.randn(256, 256, dtype=bf), torch.rand(256, 1)
swiglu.swiglu(g, g, 10.0, rw, bf)
swiglu.swiglu_backward(g, g, rw, g, 10.0)
q, cos = torch.randn(2, 16, 6, 128, dtype=bf), torch.rand(2, 16, 32)
cache_write.rope(q, cos, cos, True)
out = []
with tempfile.TemporaryDirectory() as d:
    for i, (name, _, compiled) in enumerate(sass.KERNELS):
        out.append(dict(name=name, **sass._ptxas(compiled.asm["ptx"], pathlib.Path(d), f"k{i}")))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_training_elementwise_kernels_compile_for_sm90a_without_spills():
    pytest.importorskip("triton")
    kernels = compiled_result(SCRIPT)
    names = {k["name"] for k in kernels}
    want = {"_rms_norm_train_fwd_kernel", "_rms_norm_train_bwd_kernel", "_swiglu_kernel", "_swiglu_bwd_kernel",
            "_rope_quantize_kernel"}
    assert want <= names, f"not compiled: {sorted(want - names)}"
    for k in kernels:
        print(f"{k['name']}: {k['registers']} registers, spills {k['spill_stores']} / {k['spill_loads']} bytes")
        assert k["registers"] is not None, f"{k['name']}: ptxas gave no report"
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, k
