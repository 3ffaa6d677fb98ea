"""Engram's serving path in two kernels: the n-gram hash ids (`ops.engram_hash`) and the gated memory read
after the `wkv` GEMM (`ops.engram_gate`).

In torch the hasher is ~25 small kernels per step (history pad, concat, masks, the token-map gathers, and per
order a where, multiply, xor and modulo) and the gate ~15 (casts, two RMS factors, the dot, signed square
root, sigmoid, mask, residual add). Here:

* `_engram_hash_kernel`: BLOCK_N tokens × every (layer, order, head) column per program. Each look-back
  slot s reads its raw id from the tokens or, before the chunk, from the history; a dead or negative id
  blocks it and every farther slot (pad token). Products and xor are int64 and wrap like torch's; the
  modulo is floored (Python's, as torch's `%`), so even wrapped negative hashes agree. Bit-identical.
* `_engram_gate_kernel`: one program per token, all hc streams: pass one accumulates Σh², Σkey² and
  Σh·w·key over dim in BLOCK_D chunks, pass two writes h + gate · value. fp32 math like the twin; the
  reductions' order (and rsqrt) differ, so it agrees to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv41.kernels.triton.common import interpreting, jit_sizes, runnable
from dsv41.kernels.triton.mhc import _round_bf16

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@jit_sizes("N", "T", "s_tb", "s_tt", "s_db", "s_dt", "s_hb")
def _engram_hash_kernel(tok_ptr, hist_ptr, dead_ptr, map_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, N, T,
                        s_tb, s_tt, s_db, s_dt, s_hb, s_hw, hist_w, pad_id,
                        S: tl.constexpr, COLS: tl.constexpr, HEADS: tl.constexpr, N_COLS_ALL: tl.constexpr,
                        HAS_DEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # flat token b * T + t
    c = tl.arange(0, BLOCK_C)  # flat column: layer-major, then order, then head
    n_ok = n < N
    c_ok = c < N_COLS_ALL
    b = (n // T).to(tl.int64)
    t = n % T
    layer = c // COLS
    order = (c % COLS) // HEADS  # n-gram order + 2: its hash has seen slots 0..order + 1
    pad = tl.load(map_ptr + pad_id)
    blocked = n < 0  # all False
    rolling = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.int64)
    for s in tl.static_range(S):
        p = t - s
        in_chunk = p >= 0
        raw = tl.load(tok_ptr + b * s_tb + p.to(tl.int64) * s_tt, mask=n_ok & in_chunk, other=-1).to(tl.int64)
        if HAS_DEAD:
            dead = tl.load(dead_ptr + b * s_db + p.to(tl.int64) * s_dt, mask=n_ok & in_chunk, other=0)
            raw = tl.where(dead != 0, -1, raw)
        hi = hist_w + p  # before the chunk: the history's column (newest last)
        from_hist = tl.load(hist_ptr + b * s_hb + hi.to(tl.int64) * s_hw, mask=n_ok & (p < 0) & (hi >= 0),
                            other=-1).to(tl.int64)
        raw = tl.where(in_chunk, raw, from_hist)
        blocked = blocked | (raw < 0)
        tok = tl.load(map_ptr + tl.maximum(raw, 0), mask=n_ok & ~blocked, other=0)
        tok = tl.where(blocked, pad, tok)
        mult = tl.load(mult_ptr + layer * S + s, mask=c_ok, other=0)
        product = tok[:, None] * mult[None, :]  # int64, wraps like torch's
        if s == 0:
            rolling = product
        else:
            rolling = tl.where((s <= order + 1)[None, :], rolling ^ product, rolling)
    prime = tl.load(prime_ptr + c, mask=c_ok, other=1)
    rem = rolling % prime[None, :]
    rem = tl.where(rem < 0, rem + prime[None, :], rem)  # floored, as torch's % (the sign of the divisor)
    ids = rem + tl.load(off_ptr + c, mask=c_ok, other=0)[None, :]
    ok = n_ok[:, None] & c_ok[None, :]
    tl.store(out_ptr + n.to(tl.int64)[:, None] * N_COLS_ALL + c[None, :], ids, mask=ok)


def engram_hash(tokens: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
                pad_id: int, *, history: Tensor | None = None, dead_mask: Tensor | None = None,
                doc_ids: Tensor | None = None) -> Tensor:
    """See `dsv41.kernels.ops.engram_hash` (no document ids: the inference case)."""
    if doc_ids is not None:
        raise ValueError("engram_hash: the Triton kernel takes no doc_ids (training runs the twin)")
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"engram_hash: tokens must be (B, T) integers, got {tuple(tokens.shape)} {tokens.dtype}")
    if not runnable(tokens):
        raise ValueError(f"engram_hash: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {tokens.device}")
    B, T = tokens.shape
    L, S = multipliers.shape
    heads = primes.size(-1)
    if primes.shape != (L, S - 1, heads) or offsets.shape != (L, (S - 1) * heads):
        raise ValueError(f"engram_hash: primes {tuple(primes.shape)} / offsets {tuple(offsets.shape)} do not "
                         f"match multipliers {tuple(multipliers.shape)}")
    device = tokens.device
    out = torch.empty(B, T, L, (S - 1) * heads, dtype=torch.int64, device=device)
    if out.numel() == 0:
        return out
    if dead_mask is not None:
        if dead_mask.shape != (B, T):
            raise ValueError(f"engram_hash: dead_mask must be (B, T) = {(B, T)}, got {tuple(dead_mask.shape)}")
        dead = dead_mask.to(device=device, dtype=torch.bool).view(torch.uint8)
    else:
        dead = tokens
    if history is not None:
        if history.dim() != 2 or history.size(0) != B:
            raise ValueError(f"engram_hash: history must be (B, k) with B = {B}, got {tuple(history.shape)}")
        hist = history.to(device=device)
        hist_w = min(hist.size(1), S - 1)
        hist = hist[:, hist.size(1) - hist_w:]  # the newest S − 1
    else:
        hist, hist_w = tokens, 0
    all_cols = L * (S - 1) * heads
    block_c = triton.next_power_of_2(all_cols)
    block_n = max(1, min(16 if interpreting() else 64, 2048 // block_c))
    N = B * T
    _engram_hash_kernel[(triton.cdiv(N, block_n),)](
        tokens, hist, dead, token_map, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out,
        N, T, tokens.stride(0), tokens.stride(1), dead.stride(0), dead.stride(1), hist.stride(0),
        hist.stride(1), hist_w, pad_id,
        S=S, COLS=(S - 1) * heads, HEADS=heads, N_COLS_ALL=all_cols, HAS_DEAD=dead_mask is not None,
        BLOCK_N=block_n, BLOCK_C=block_c, num_warps=4)
    return out


@jit_sizes("N")
def _engram_gate_kernel(x_ptr, kv_ptr, q_ptr, k_ptr, mask_ptr, out_ptr, N, s_xn, s_xh, s_kv, s_on, s_oh,
                        s_q, s_k, s_m, eps, scale, HC: tl.constexpr, D: tl.constexpr, W_BF16: tl.constexpr,
                        W_FP16: tl.constexpr, OUT_BF16: tl.constexpr, HAS_MASK: tl.constexpr,
                        EXACT_CAST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    j_ok = j < HC
    ss_h = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    ss_k = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = j_ok[:, None] & (d < D)[None, :]
        h = tl.load(x_ptr + n * s_xn + j[:, None] * s_xh + d[None, :], mask=ok, other=0.0).to(tl.float32)
        key = tl.load(kv_ptr + n * s_kv + j[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + j[:, None] * s_q + d[None, :], mask=ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + j[:, None] * s_k + d[None, :], mask=ok, other=0.0).to(tl.float32)
        w = q * k  # rounded in the weights' dtype, as torch's product
        if W_BF16:
            w = _round_bf16(w, EXACT_CAST)
        elif W_FP16:
            w = w.to(tl.float16).to(tl.float32)
        ss_h += h * h
        ss_k += key * key
        acc += h * w * key
    rstd = tl.math.rsqrt(tl.sum(ss_h, axis=1) / D + eps) * tl.math.rsqrt(tl.sum(ss_k, axis=1) / D + eps)
    dot = tl.sum(acc, axis=1) * rstd * scale  # (BLOCK_H,)
    sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    z = sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-z))
    if HAS_MASK:
        gate = tl.where(tl.load(mask_ptr + n * s_m) != 0, gate, 0.0)
    for d0 in tl.range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = j_ok[:, None] & (d < D)[None, :]
        h = tl.load(x_ptr + n * s_xn + j[:, None] * s_xh + d[None, :], mask=ok, other=0.0).to(tl.float32)
        value = tl.load(kv_ptr + n * s_kv + HC * D + d, mask=d < D, other=0.0).to(tl.float32)
        out = h + gate[:, None] * value[None, :]
        if OUT_BF16:  # round to nearest even here: the interpreter's cast truncates
            out = _round_bf16(out, EXACT_CAST)
        tl.store(out_ptr + n * s_on + j[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def engram_gate(x: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                token_mask: Tensor | None = None) -> Tensor:
    """See `dsv41.kernels.ops.engram_gate`."""
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"engram_gate: x must be (B, T, hc, dim) float, got {tuple(x.shape)} {x.dtype}")
    B, T, hc, D = x.shape
    if kv.shape != (B, T, (hc + 1) * D) or q_weight.shape != (hc, D) or k_weight.shape != (hc, D):
        raise ValueError(f"engram_gate: kv {tuple(kv.shape)}, q_weight {tuple(q_weight.shape)}, k_weight "
                         f"{tuple(k_weight.shape)} do not match x {tuple(x.shape)}")
    if token_mask is not None and token_mask.shape != (B, T):
        raise ValueError(f"engram_gate: token_mask must be (B, T) = {(B, T)}, got {tuple(token_mask.shape)}")
    if not runnable(x):
        raise ValueError(f"engram_gate: Triton needs CUDA tensors or TRITON_INTERPRET=1, got {x.device}")
    w_dtype = torch.promote_types(q_weight.dtype, k_weight.dtype)
    if w_dtype not in _FLOATS or kv.dtype not in _FLOATS:
        raise ValueError(f"engram_gate: kv and weights must be fp32 / bf16 / fp16, got {kv.dtype}, {w_dtype}")
    N = B * T
    x3 = x.reshape(N, hc, D)  # (N, hc, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    kv2 = kv.reshape(N, (hc + 1) * D)  # (N, (hc + 1) * D): hc keys, then the value
    if kv2.stride(-1) != 1:
        kv2 = kv2.contiguous()
    q = q_weight if q_weight.stride(-1) == 1 else q_weight.contiguous()
    k = k_weight if k_weight.stride(-1) == 1 else k_weight.contiguous()
    out = torch.empty(B, T, hc, D, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    mask = token_mask.to(torch.bool).reshape(N).view(torch.uint8) if token_mask is not None else x3  # (N,)
    block_h = triton.next_power_of_2(hc)
    block_d = min(triton.next_power_of_2(D), max(16, 2048 // block_h))
    _engram_gate_kernel[(N,)](
        x3, kv2, q, k, mask, out, N, x3.stride(0), x3.stride(1), kv2.stride(0), hc * D, D, q.stride(0), k.stride(0),
        mask.stride(0), float(eps), D**-0.5, HC=hc, D=D, W_BF16=w_dtype == torch.bfloat16,
        W_FP16=w_dtype == torch.float16, OUT_BF16=x.dtype == torch.bfloat16, HAS_MASK=token_mask is not None,
        EXACT_CAST=interpreting(), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out
