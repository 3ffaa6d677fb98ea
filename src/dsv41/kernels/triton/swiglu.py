"""Clamped SwiGLU in one pass (`ops.swiglu`): fp32 math, the routing weight, one rounding to the output.

The model's expert hidden is silu(min(g, limit)) · clamp(u, ±limit), scaled by the routing weight and
cast to the GEMM dtype before w2 — seven elementwise kernels in torch, one here. Memory-bound: reads g
and u, writes h once. Agrees with the twin (`kernels.ref.swiglu`) to fp32 rounding (silu's exp), and
so to at most one unit in the last place of a bf16 output.

Training (`swiglu_train`, an autograd Function like the twin's `_SwiGLU`): the forward is the same kernel and saves
gate, up and the weight as they came; the backward is one kernel (`_swiglu_bwd_kernel`) that recomputes the clamp,
sigmoid and silu in fp32 from the saved inputs and writes grad_gate and grad_up in their inputs' dtypes in one
pass: in bf16 it reads g, u and grad (6 bytes an element) and writes 4, where the twin's backward is ~30 torch
launches (casts, clamps, compares, sigmoid, eleven products) moving ~200 bytes an element through fp32
temporaries. The routing weight's gradient, grad_w[m, k] = Σ_{j in group k} grad·silu·u, is summed in the same
pass: each program owns a block of columns inside one group (a group's columns are cut into `n_blocks` blocks,
never straddling two groups), writes its per-row partial once into an fp32 (M, G, n_blocks) buffer, and torch sums
the last axis in a fixed order — deterministic, no atomics, and at the model's widths (C / G = 256) one block a
group, so the buffer is grad_w itself. Masks as the twin's (torch.clamp's gradient): the gate's where
g ≤ limit, the up's where −limit ≤ u ≤ limit, bounds included; none when limit ≤ 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable


@jit_sizes("M")
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, out_ptr, M, C, s_g, s_u, s_w, s_o, limit, group,
                   CLAMP: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < M)[:, None] & (c < C)[None, :]
    r64 = r.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * s_g + c[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * s_u + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if HAS_W:
        w = tl.load(w_ptr + r64 * s_w + (c // group)[None, :], mask=ok, other=0.0).to(tl.float32)
        h = w * h
    tl.store(out_ptr + r64 * s_o + c[None, :], h.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """See `dsv41.kernels.ops.swiglu`."""
    if gate.shape != up.shape or gate.dim() != 2 or not gate.is_floating_point():
        raise ValueError(f"swiglu: gate and up must be (M, C) float of one shape, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}")
    if not runnable(gate):
        raise ValueError(f"swiglu: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {gate.device}")
    M, C = gate.shape
    if weight is not None and (weight.dim() != 2 or weight.size(0) != M or C % weight.size(1)):
        raise ValueError(f"swiglu: weight must be (M, G) with C % G == 0, got {tuple(weight.shape)} for {(M, C)}")
    g = gate if gate.stride(-1) == 1 else gate.contiguous()
    u = up if up.stride(-1) == 1 else up.contiguous()
    out = torch.empty(M, C, dtype=out_dtype or gate.dtype, device=gate.device)
    if M * C == 0:
        return out
    w = weight if weight is not None else g
    if weight is not None and w.stride(-1) != 1:
        w = w.contiguous()
    block_c = min(1024, triton.next_power_of_2(C))
    block_m = max(1, min(16 if interpreting() else 8, 4096 // block_c))
    _swiglu_kernel[(triton.cdiv(M, block_m), triton.cdiv(C, block_c))](
        g, u, w, out, M, C, g.stride(0), u.stride(0), w.stride(0), out.stride(0), float(limit),
        C // (weight.size(1) if weight is not None else 1),
        CLAMP=limit > 0, HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_C=block_c,
        num_warps=4)
    return out


# --------------------------------------------------------------------------------------------- training
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def supported(gate: Tensor, up: Tensor, weight: Tensor | None = None) -> bool:
    """Do the training kernels take these? gate, up (M, C) float of one shape; weight None or (M, G) float with
    C % G == 0. (The caller checks the device.)"""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype not in _FLOATS or up.dtype not in _FLOATS:
        return False
    if weight is None:
        return True
    return (weight.dim() == 2 and weight.dtype in _FLOATS and weight.size(0) == gate.size(0) and weight.size(1) > 0
            and gate.size(1) % weight.size(1) == 0)


@triton.jit
def _cast_to(x, ptr, EXACT_CAST: tl.constexpr):
    """fp32 x → ptr's element type, to nearest (ties to even). The interpreter's fp32 → bf16 cast truncates, so there
    (EXACT_CAST) a bf16 output is rounded by integer bit arithmetic first, as the GPU's cast rounds."""
    if EXACT_CAST:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@jit_sizes("M")
def _swiglu_bwd_kernel(g_ptr, u_ptr, w_ptr, dy_ptr, dg_ptr, du_ptr, dw_ptr, M, group, n_blocks,
                       s_g, s_gc, s_u, s_uc, s_w, s_wc, s_dy, s_dyc, s_o, s_dw, limit,
                       CLAMP: tl.constexpr, HAS_W: tl.constexpr, NEED_G: tl.constexpr, NEED_U: tl.constexpr,
                       NEED_W: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # program (row block, tile): tile = k · n_blocks + b is column block b of group k (columns k·group + …)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = tl.program_id(1)
    k = tile // n_blocks
    j = (tile % n_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)  # column within the group
    c = k * group + j
    r_ok = r < M
    ok = r_ok[:, None] & (j < group)[None, :]
    r64 = r.to(tl.int64)
    g_raw = tl.load(g_ptr + r64[:, None] * s_g + c[None, :] * s_gc, mask=ok, other=0.0).to(tl.float32)
    u_raw = tl.load(u_ptr + r64[:, None] * s_u + c[None, :] * s_uc, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64[:, None] * s_dy + c[None, :] * s_dyc, mask=ok, other=0.0).to(tl.float32)
    g, u = g_raw, u_raw
    if CLAMP:
        g = tl.minimum(g_raw, limit)
        u = tl.minimum(tl.maximum(u_raw, -limit), limit)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    if NEED_W:  # the unweighted grad: ∂(w·h)/∂w = h
        part = tl.sum(tl.where(ok, dy * silu * u, 0.0), axis=1)
        tl.store(dw_ptr + r64 * s_dw + tile, part, mask=r_ok)
    if HAS_W:
        w = tl.load(w_ptr + r64 * s_w + k * s_wc, mask=r_ok, other=0.0).to(tl.float32)
        dy = w[:, None] * dy
    out = r64[:, None] * s_o + c[None, :]
    if NEED_G:
        dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))  # d silu / d g
        if CLAMP:  # multiplied, not selected: a NaN stays NaN, as in the twin
            dg = dg * (g_raw <= limit).to(tl.float32)
        tl.store(dg_ptr + out, _cast_to(dg, dg_ptr, EXACT_CAST), mask=ok)
    if NEED_U:
        du = dy * silu
        if CLAMP:
            du = du * ((u_raw >= -limit) & (u_raw <= limit)).to(tl.float32)
        tl.store(du_ptr + out, _cast_to(du, du_ptr, EXACT_CAST), mask=ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and workspace of the backward comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _bwd_blocks(group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C): a block of columns inside one group, ~2K elements a program on the GPU (8 rows of
    256 at the model's widths); small in the interpreter so the tests reach several blocks of rows and columns."""
    if interpreting():
        block_c = min(32, triton.next_power_of_2(group))
        return max(1, min(8, 256 // block_c)), block_c
    block_c = min(512, triton.next_power_of_2(group))
    return max(1, min(16, 2048 // block_c)), block_c


def swiglu_backward(gate: Tensor, up: Tensor, weight: Tensor | None, grad: Tensor, limit: float,
                    need_gate: bool = True, need_up: bool = True, need_weight: bool = True
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad_gate in gate's dtype, grad_up in up's, grad_w in weight's) of `swiglu(gate, up, limit, weight)` from
    grad (M, C), any strides; None for those not needed (grad_w also without a weight). One kernel, and a sum
    over the column blocks of a group when a group spans more than one."""
    M, C = gate.shape
    need_weight = need_weight and weight is not None
    dev = gate.device
    grad_gate = _empty((M, C), gate.dtype, dev) if need_gate else None
    grad_up = _empty((M, C), up.dtype, dev) if need_up else None
    if not (need_gate or need_up or need_weight):
        return None, None, None
    G = weight.size(1) if weight is not None else 1
    group = C // G
    if M * C == 0:
        grad_w = torch.zeros(M, G, dtype=weight.dtype, device=dev) if need_weight else None
        return grad_gate, grad_up, grad_w
    block_m, block_c = _bwd_blocks(group)
    n_blocks = triton.cdiv(group, block_c)
    part = _empty((M, G, n_blocks), torch.float32, dev) if need_weight else None
    w = weight if weight is not None else gate  # gate stands in for the tensors a launch neither reads nor writes
    _swiglu_bwd_kernel[(triton.cdiv(M, block_m), G * n_blocks)](
        gate, up, w, grad, grad_gate if need_gate else gate, grad_up if need_up else gate,
        part if need_weight else gate, M, group, n_blocks, *gate.stride(), *up.stride(), *w.stride(),
        *grad.stride(), C, G * n_blocks, float(limit),
        CLAMP=limit > 0, HAS_W=weight is not None, NEED_G=need_gate, NEED_U=need_up, NEED_W=need_weight,
        EXACT_CAST=interpreting(), BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    grad_w = None
    if need_weight:
        grad_w = (part[..., 0] if n_blocks == 1 else part.sum(-1)).to(weight.dtype)  # (M, G)
    return grad_gate, grad_up, grad_w


class _SwiGLUTrain(torch.autograd.Function):
    """The twin's `_SwiGLU` on the kernels: saves gate, up, weight as they came, recomputes in the backward."""

    @staticmethod
    def forward(ctx, gate, up, limit, weight, out_dtype):
        ctx.limit = limit
        ctx.save_for_backward(gate, up, weight)
        return swiglu(gate, up, limit, weight, out_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, _, need_weight, _ = ctx.needs_input_grad
        grad_gate, grad_up, grad_w = swiglu_backward(gate, up, weight, grad, ctx.limit, need_gate, need_up,
                                                     need_weight)
        return grad_gate, grad_up, None, grad_w, None


def swiglu_train(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> Tensor:
    """`swiglu` with a gradient (`ops.swiglu` in training): the same forward kernel, one backward kernel."""
    if not supported(gate, up, weight):
        raise ValueError(f"swiglu_train: gate, up must be (M, C) float32/bfloat16/float16 of one shape and weight "
                         f"None or (M, G) float with C % G == 0, got {tuple(gate.shape)} {gate.dtype}, "
                         f"{tuple(up.shape)} {up.dtype}, "
                         f"{None if weight is None else (tuple(weight.shape), weight.dtype)}")
    return _SwiGLUTrain.apply(gate, up, limit, weight, out_dtype)
