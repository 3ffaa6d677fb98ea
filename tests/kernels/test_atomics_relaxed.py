"""The training backward kernels add their gradients with relaxed atomics (compiled for sm_90a on the CPU, no GPU).

Triton's `tl.atomic_add` defaults to acq_rel: on Hopper every such add became `MEMBAR.ALL.GPU` + `ATOMG` + `CCTL.IVALL`
(a GPU-wide fence and an L1 invalidation per add, in the loops that also read the gathered rows through L1) where a
sum needs neither; relaxed makes it a fire-and-forget `REDG`. The kernels' equality tests cannot see the difference
(the sums are equal), so this test compiles the entry-attention and selected-scores backward kernels with Triton's
own specialization (`benchmarks/sass.py`'s compile-instead-of-run) and reads their PTX: every atomic relaxed, no fence.
The interpreter the other tests use cannot compile, so the compile runs in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import pytest
from tests.conftest import compiled_result

SCRIPT = r"""
import json, re, sys
sys.path.insert(0, "benchmarks")
import torch
import sass
from triton.runtime import jit
from dsv41.kernels.triton import common, selected_scores, sparse_train

jit.JITFunction.run = sass._compile_instead_of_run
common.runnable = lambda t: True
B, T, H, D, N, K = 1, 64, 6, 128, 64, 32
bf = torch.bfloat16
q, o = torch.randn(B, T, H, D, dtype=bf), torch.randn(B, T, H, D, dtype=bf)
kv, pool = torch.randn(B, T, D, dtype=bf), torch.randn(B, N, D, dtype=bf)
idx = torch.randint(0, N, (B, T, K))
cfg = sparse_train._config(H, T, 128, K, None, None, None)
sparse_train._backward(q, kv, torch.zeros(B, T, dtype=torch.long), None, torch.randn(H), pool, idx, o,
                       torch.randn(B, T, H), o, 0.1, 128, cfg, 4)


class Ctx:
    saved_tensors = (torch.randn(B, T, 4, 64, dtype=bf), torch.randn(B, T, 4), torch.randn(B, N, 64, dtype=bf), idx)
    cfg = selected_scores._config(4, K)
    needs_input_grad = (True, True, True, False)


selected_scores._SelectedScoresKernel.backward(Ctx(), torch.randn(B, T, K))
out = {}
for name, _, compiled in sass.KERNELS:
    ptx = compiled.asm["ptx"]
    out[name] = dict(atomics=re.findall(r"\b(?:atom|red)\.[\w.]+", ptx),
                     fences=len(re.findall(r"\b(?:fence|membar)\.", ptx)))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_backward_kernels_add_gradients_with_relaxed_atomics_and_no_fence():
    pytest.importorskip("triton")
    kernels = compiled_result(SCRIPT)
    for name in ("_entry_bwd_kernel", "_scores_bwd_kernel"):
        atomics = kernels[name]["atomics"]
        assert atomics, f"{name}: no atomic add compiled"
        assert all(".relaxed." in a for a in atomics), f"{name}: {atomics}"
        assert kernels[name]["fences"] == 0, f"{name}: {kernels[name]['fences']} fences"
