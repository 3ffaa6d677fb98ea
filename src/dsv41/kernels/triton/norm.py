"""RMSNorm in one pass: fp32 mean of squares, rsqrt, × weight, cast to x's dtype (`ops.rms_norm`).

One program normalizes ROWS rows of D channels held in registers (D ≤ 8192 after padding to a power
of two). The twin (`kernels.ref.norm`) computes the same function with torch's reduction order;
the two agree to fp32 rounding (the sum of squares is reduced in a different order), not bit for bit.
Memory-bound: one read of x and one write; at decode sizes it is one launch instead of eight.

Training (`rms_norm_train`, an autograd Function with the twin's `_RMSNorm` semantics) takes two kernels. The
forward is the pass above that also writes r = rsqrt(mean(x²) + eps) per row (fp32), saved with x as it came and
the weight. The backward reads x, ∂y and r once and, in fp32, writes ∂x = r·(g − n·mean(g·n)) (g = w·∂y,
n = x·r) in x's dtype; ∂w = Σ_rows ∂y·n is summed deterministically, without atomics: each program walks its
own block of rows, keeps the column sums in registers and writes them as one row of an fp32 (programs, D)
buffer, which one torch `sum(0)` reduces. Per bf16 row of D channels the kernels move 4·D + 4 bytes forward and
6·D + 4 backward (plus the partial sums, 8·D·programs / rows per row: ~0.3·D at 16K rows on 132 SMs); the twin's
torch ops, each an fp32 temporary read and written once, move about 40·D forward and 90·D backward, in 7 and
~12 launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@jit_sizes("n_rows")
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, stride_x, stride_o, eps,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    ok = (r < n_rows)[:, None] & (d < D)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # (ROWS,)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (x * inv[:, None]) * w[None, :]
    tl.store(out_ptr + r64[:, None] * stride_o + d[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, rows: int | None = None, num_warps: int | None = None
             ) -> Tensor:
    """See `dsv41.kernels.ops.rms_norm`; knobs: rows per program, warps."""
    if not x.is_floating_point() or weight.dim() != 1 or x.size(-1) != weight.numel():
        raise ValueError(f"rms_norm: x (..., D) float and weight (D,), got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)}")
    if not runnable(x):
        raise ValueError(f"rms_norm: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    D = x.size(-1)
    if D > 8192:
        raise ValueError(f"rms_norm: at most 8192 channels, got {D}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.size(0)
    if n == 0:
        return out.view(x.shape)
    block_d = triton.next_power_of_2(D)
    rows = rows or (min(16, triton.next_power_of_2(n)) if interpreting() else max(1, min(8, 2048 // block_d)))
    num_warps = num_warps or max(1, min(8, rows * block_d // 512))
    _rms_norm_kernel[(triton.cdiv(n, rows),)](x2, weight, out, n, D, x2.stride(0), out.stride(0), float(eps),
                                              BLOCK_D=block_d, ROWS=rows, num_warps=num_warps)
    return out.view(x.shape)


# ---------------------------------------------------------------------------------------------
# Training: forward that keeps r, fused backward, deterministic ∂w


@jit_sizes("n_rows")
def _rms_norm_train_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, n_rows, D, stride_x, stride_y, eps,
                               BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    row_ok = row < n_rows
    ok = row_ok[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # (ROWS,)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = w[None, :] * (x * r[:, None])  # the twin's order: weight · (h · rsqrt)
    tl.store(y_ptr + row[:, None] * stride_y + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(r_ptr + row, r, mask=row_ok)


@triton.jit
def _rms_norm_bwd_tile(x_ptr, w, r_ptr, dy_ptr, dx_ptr, row, n_rows, d, d_ok, D, stride_x, stride_dy, stride_dx,
                       NEED_DX: tl.constexpr):
    """ROWS rows starting at `row` (int64): stores ∂x (when NEED_DX) and returns the tile's ∂y·n (ROWS, BLOCK_D)."""
    row_ok = row < n_rows
    ok = row_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row[:, None] * stride_dy + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row, mask=row_ok, other=0.0)
    n = x * r[:, None]  # the normalized x; 0 in masked lanes and rows
    if NEED_DX:
        g = dy * w[None, :]
        mean = tl.sum(g * n, axis=1) / D  # (ROWS,)
        dx = r[:, None] * (g - n * mean[:, None])
        tl.store(dx_ptr + row[:, None] * stride_dx + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
    return dy * n


@jit_sizes("n_rows", "rows_per_program")
def _rms_norm_train_bwd_kernel(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, n_rows, rows_per_program, D,
                               stride_x, stride_dy, stride_dx,
                               BLOCK_D: tl.constexpr, ROWS: tl.constexpr, NEED_DX: tl.constexpr,
                               NEED_DW: tl.constexpr, STATIC_TILES: tl.constexpr):
    """Rows [pid·rows_per_program, +rows_per_program) in tiles of ROWS: ∂x per row, and this program's column sums
    of ∂y·n as row pid of the (programs, D) buffer. Under the interpreter the loop runs a compile-time trip count,
    STATIC_TILES (it cannot take runtime bounds); on the GPU STATIC_TILES is 0 and the bound is a runtime size."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)  # per-lane column sums, reduced over rows once at the end
    first = pid.to(tl.int64) * rows_per_program + tl.arange(0, ROWS)
    if STATIC_TILES:
        for i in range(STATIC_TILES):
            dw += _rms_norm_bwd_tile(x_ptr, w, r_ptr, dy_ptr, dx_ptr, first + i * ROWS, n_rows, d, d_ok, D,
                                     stride_x, stride_dy, stride_dx, NEED_DX)
    else:
        for start in range(0, rows_per_program, ROWS):
            dw += _rms_norm_bwd_tile(x_ptr, w, r_ptr, dy_ptr, dx_ptr, first + start, n_rows, d, d_ok, D,
                                     stride_x, stride_dy, stride_dx, NEED_DX)
    if NEED_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * D + d, tl.sum(dw, axis=0), mask=d_ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Outputs and buffers (a function so that tests can poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tile(n: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_D, rows per tile, warps): 2048-element tiles on the GPU (4 rows at D = 384), up to 16 rows in the
    interpreter, where a program costs Python time and a bigger tile does not."""
    block_d = triton.next_power_of_2(D)
    rows = min(16, triton.next_power_of_2(n)) if interpreting() else max(1, min(8, 2048 // block_d))
    return block_d, rows, max(1, min(8, rows * block_d // 512))


def _programs(n_tiles: int, device: torch.device) -> int:
    """Backward programs: 4 per SM (each walks n_tiles / programs tiles, so the ∂w buffer stays ~programs × D,
    0.8 MB at D = 384 on 132 SMs); 4 in the interpreter, enough to exercise the partial sums."""
    target = 4 if interpreting() or device.type != "cuda" else 4 * torch.cuda.get_device_properties(
        device).multi_processor_count
    return max(1, min(n_tiles, target))


def supported(x: Tensor, weight: Tensor) -> bool:
    """Tensors the training kernels take: x (..., D) and weight (D,) fp32 / bf16 / fp16, 1 ≤ D ≤ 8192."""
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and x.dim() >= 1 and weight.dim() == 1
            and 1 <= x.size(-1) <= 8192 and weight.numel() == x.size(-1))


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        D = x.size(-1)
        x2 = x.reshape(-1, D)  # (N, D)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight.contiguous()
        n = x2.size(0)
        y = _empty(tuple(x.shape), x.dtype, x.device)
        r = _empty((n,), torch.float32, x.device)
        if n:
            block_d, rows, warps = _tile(n, D)
            _rms_norm_train_fwd_kernel[(triton.cdiv(n, rows),)](
                x2, w, y, r, n, D, x2.stride(0), D, float(eps), BLOCK_D=block_d, ROWS=rows, num_warps=warps)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, r = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        D = x.size(-1)
        x2 = x.reshape(-1, D)  # (N, D)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        dy = grad.reshape(-1, D)  # (N, D); a row stride of 0 (an expanded gradient) is read as it is
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        n = x2.size(0)
        if n == 0:
            return (torch.zeros_like(x) if need_dx else None, torch.zeros_like(weight) if need_dw else None, None)
        block_d, rows, warps = _tile(n, D)
        n_tiles = triton.cdiv(n, rows)
        tiles_per_program = triton.cdiv(n_tiles, _programs(n_tiles, x.device))
        programs = triton.cdiv(n_tiles, tiles_per_program)  # no program left without rows
        dx = _empty(tuple(x.shape), x.dtype, x.device) if need_dx else None  # written as (N, D) rows
        partial = _empty((programs, D), torch.float32, x.device) if need_dw else None  # (P, D)
        _rms_norm_train_bwd_kernel[(programs,)](
            x2, weight.contiguous(), r, dy, dx if need_dx else x2, partial if need_dw else r, n,
            tiles_per_program * rows, D, x2.stride(0), dy.stride(0), D,
            BLOCK_D=block_d, ROWS=rows, NEED_DX=need_dx, NEED_DW=need_dw,
            STATIC_TILES=tiles_per_program if interpreting() else 0, num_warps=warps)
        grad_w = partial.sum(0).to(weight.dtype) if need_dw else None
        return dx, grad_w, None


def rms_norm_train(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm` with autograd through the two training kernels: the twin's `_RMSNorm` (fp32 math, y and ∂x in
    x's dtype, ∂w in weight's), agreeing with it to fp32 rounding (reduction order)."""
    if not supported(x, weight):
        raise ValueError(f"rms_norm_train: x (..., D) and weight (D,) fp32 / bf16 / fp16 with 1 ≤ D ≤ 8192, got "
                         f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    if not runnable(x):
        raise ValueError(f"rms_norm_train: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    return _RMSNormTrain.apply(x, weight, eps)
