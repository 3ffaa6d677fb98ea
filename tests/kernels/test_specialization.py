"""The serving kernels compile once whatever a batch's counts are (`kernels/triton/common.jit_sizes`).

Triton compiles a kernel again for every new combination of its integer arguments being 1, a multiple of 16 or
neither. On the engine's paths the token, row and entry counts change with every batch, and each new combination
was a compile of seconds in the middle of live traffic (decode_load, 2026-12-06: steps of 6.2 s and 4.9 s). The CPU
test reads the compiled kernels' parameters (outside the interpreter); the GPU tests count the compiled variants.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

SERVING = {  # module → the kernels the engine's prefill and decode launch
    "attention": ["_sparse_attention_kernel", "_combine_kernel"],
    "cache_write": ["_rope_quantize_kernel", "_ring_write_kernel"],
    "engram": ["_engram_hash_kernel", "_engram_gate_kernel"],
    "indexer": ["_scores_kernel", "_blocks_kernel", "_keys_kernel", "_pick_kernel"],
    "markov": ["_markov_step_kernel", "_markov_last_kernel"],
    "mhc": ["_mhc_pass_kernel", "_mhc_fused_kernel", "_mhc_finish_kernel", "_mhc_split_kernel"],
    "norm": ["_rms_norm_kernel"],
    "router": ["_route_kernel"],
    "swiglu": ["_swiglu_kernel"],
}
# a count by its name: tokens (T), rows (M, n_rows, n_tokens), entries or columns (N, K, n_max, n_cols, ...), tiles
COUNT = re.compile(r"^(T|M|N|K|n_\w+|\w+_tiles|tiles_per_split)$")


def test_every_count_argument_of_a_serving_kernel_is_unspecialized():
    code = ("import json, importlib\n"
            f"spec = {SERVING!r}\n"
            "out = {}\n"
            "for mod, names in spec.items():\n"
            "    m = importlib.import_module('dsv41.kernels.triton.' + mod)\n"
            "    for n in names:\n"
            "        out[n] = [(p.name, p.is_constexpr, p.do_not_specialize) for p in getattr(m, n).params]\n"
            "print(json.dumps(out))\n")
    env = dict(os.environ, TRITON_INTERPRET="0")  # the JIT functions themselves, as on a GPU
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    params = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(params) == {n for names in SERVING.values() for n in names}
    for kernel, rows in params.items():
        counts = [(name, unspecialized) for name, constexpr, unspecialized in rows
                  if not constexpr and COUNT.match(name)]
        assert counts, f"{kernel}: no count argument found (renamed?)"
        assert all(u for _, u in counts), f"{kernel}: specialized on {[n for n, u in counts if not u]}"


def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel on the current CUDA device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
def test_gpu_sparse_attention_compiles_once_for_any_token_count():
    """Prefill chunks of 300, 301, 303, 304 and 290 tokens (multiples of 16 or not, odd or even) with a window
    ring, chunk keys, a replay start and entries: one compiled variant after the first call."""
    from tests.kernels.test_attention import make_case

    from dsv41.kernels import ops
    from dsv41.kernels.ops import use_backend
    from dsv41.kernels.triton import attention

    counts = []
    for T in (300, 301, 303, 304, 290):
        case = make_case(2, T, 6, 128, W=128, K=128, window=128, chunk=True, replay=True, page_rows=256,
                         pages_per_seq=4, dtype=torch.bfloat16, device="cuda", seed=T)
        with use_backend("triton"):
            ops.sparse_attention(**case)
        counts.append(_variants(attention._sparse_attention_kernel))
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.gpu
def test_gpu_rope_quantize_compiles_once_for_any_token_count():
    """Cache writes of 8000, 8001, 8016 and 8017 tokens (one tokens-per-program size): one compiled variant."""
    from tests.kernels.test_cache_write import _angles, _random_x, _row_index, _write

    from dsv41.kernels.triton import cache_write

    counts = []
    for n in (8000, 8001, 8016, 8017):
        g = torch.Generator().manual_seed(n)
        x = _random_x(1, n, 128, torch.bfloat16, g, device="cuda")
        cos, sin = _angles(1, n, 64, g, device="cuda")
        _write("triton", x, cos, sin, "window_fp8", n + 5, _row_index(1, n, n + 5, g, device="cuda"))
        counts.append(_variants(cache_write._rope_quantize_kernel))
    assert counts == [counts[0]] * len(counts), counts
