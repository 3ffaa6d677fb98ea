"""Muon: momentum SGD whose update matrix is replaced by its nearest semi-orthogonal matrix (SPEC §7).

Key idea: for an update G = U Σ Vᵀ, Muon applies U Vᵀ (all singular values set to 1), computed without
an SVD by a Newton–Schulz iteration — an odd matrix polynomial X ← aX + b(XXᵀ)X + c(XXᵀ)²X that pushes
every singular value of the Frobenius-normalized G towards 1. The DeepSeek-V4 recipe runs 8 fast
quintic steps (3.4445, −4.7750, 2.0315), which land the singular values in a band around 1, then 2
steps of (2, −1.5, 0.5), whose polynomial has p(1) = 1 and p'(1) = 0 and so contracts that band
quadratically onto 1.

The orthogonalized update of an m × n matrix has RMS 1/√max(m, n); multiplying by 0.18·√max(m, n)
gives update RMS 0.18, close to AdamW's, so one learning rate serves both optimizers.

Head-wise Muon (group option `heads`): a (heads·d, in) projection is viewed as `heads` matrices of
(d, in), each orthogonalized and scaled on its own — used for the query and key projections.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor

# (number of steps, (a, b, c)) for the two phases of the hybrid iteration.
QUINTIC = (3.4445, -4.7750, 2.0315)
POLISH = (2.0, -1.5, 0.5)


def newton_schulz(
    G: Tensor, steps: tuple[int, int] = (8, 2), *, dtype: torch.dtype = torch.float32, eps: float = 1e-7
) -> Tensor:
    """Approximate U Vᵀ of each matrix in G (..., m, n); leading dims are a batch.

    With the default steps, singular values σ of G with σ / ‖G‖_F ≥ 1.2e-4 come out in
    [0.9999, 1.0006]. Smaller ones (near-singular G) do not: the quintic phase multiplies a small σ
    by at most a = 3.4445 per step (≈ 2e4 over 8 steps), so below σ / ‖G‖_F ≈ 2.6e-5 it is still far
    from 1 when the polish phase starts, and just above that it lands up to 0.2% past 1. `dtype` is
    the compute dtype: float32 everywhere; bfloat16 is fine on CUDA, where it is faster.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # iterate on the wide orientation: XXᵀ is then the smaller Gram matrix
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)  # Frobenius ⇒ every σ ≤ 1
    for n_steps, (a, b, c) in zip(steps, (QUINTIC, POLISH)):
        for _ in range(n_steps):
            A = X @ X.mT  # (..., m, m), m ≤ n
            X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def ns_dtype_for(device: torch.device | str, dtype: str) -> torch.dtype:
    """The Newton–Schulz compute dtype of a run: bfloat16 on CUDA when the run trains in bf16 (tensor-core
    matmuls; singular values within about 1 % of 1, as the public Muon implementations run it — fp32 runs the
    ten iterations on CUDA cores, tens of ms a step for `small`), float32 otherwise (the CPU, fp32 runs)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" and dtype == "bf16" else torch.float32


def muon_scale(rows: int, cols: int, rms: float) -> float:
    """Factor that turns an orthogonalized (rows, cols) update into one with RMS `rms`."""
    return rms * max(rows, cols) ** 0.5


def orthogonalize(updates: list[Tensor], heads: int | None, rms: float, batch_numel: int | None = None,
                  **ns_kwargs) -> list[Tensor]:
    """Orthogonalize same-shape updates in batched Newton–Schulz calls, per head if `heads` is set.

    A param of shape (..., rows, cols) is a batch of matrices over its leading dims (stacked MoE
    experts: each expert's (rows, cols) matrix on its own, scaled as one); with `heads = h` each matrix
    is further split into h row blocks of rows/h. `batch_numel` bounds the elements per call, splitting
    even one param (384 stacked experts) into chunks of whole matrices; when it splits, the result is
    written over the (temporary) updates instead of a new buffer.
    """
    shape = updates[0].shape
    rows, cols = shape[-2], shape[-1]
    h = heads or 1
    if rows % h:
        raise ValueError(f"head-wise Muon: {rows} rows do not split into {h} heads")
    d = rows // h
    # one update (a big stacked param) is viewed, not copied
    stacked = updates[0].reshape(-1, d, cols) if len(updates) == 1 else torch.stack(updates).reshape(-1, d, cols)
    # stacked: (len·batch·h, d, cols)
    per_call = stacked.shape[0] if batch_numel is None else max(1, batch_numel // (d * cols))
    scale = muon_scale(d, cols, rms)
    if per_call >= stacked.shape[0]:
        ortho = newton_schulz(stacked, **ns_kwargs) * scale
    else:  # chunk by chunk, written over the input: the extra memory is one chunk's iteration
        ortho = stacked
        for start in range(0, stacked.shape[0], per_call):
            ortho[start:start + per_call] = newton_schulz(stacked[start:start + per_call], **ns_kwargs) * scale
    return list(ortho.reshape(len(updates), *shape).unbind(0))  # (len, *shape) → one tensor per update


class Muon(torch.optim.Optimizer):
    """Nesterov momentum → (head-wise) Newton–Schulz orthogonalization → RMS-0.18 update.

    p ← p·(1 − lr·wd) − lr · 0.18·√max(rows, cols) · NS(g + μ·buf),  buf ← μ·buf + g.
    Param groups may set `heads` (int | None). Within a group, params of one shape are
    orthogonalized together in batched calls of up to `batch_numel` elements (the experts of all
    layers stack into one), instead of one small call per matrix; a 3-D param (stacked experts, E
    matrices) is a batch of its own, chunked the same way.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 2.6e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        nesterov: bool = True,
        rms: float = 0.18,
        heads: int | None = None,
        ns_steps: tuple[int, int] = (8, 2),
        ns_dtype: torch.dtype = torch.float32,
        batch_numel: int = 2**28,
    ):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"bad Muon hyper-parameters lr={lr} momentum={momentum} wd={weight_decay}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            rms=rms,
            heads=heads,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            batch_numel=batch_numel,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon handles matrices only; got a param of shape {tuple(p.shape)}")

    def load_state_dict(self, state_dict: dict) -> None:
        """The checkpoint's state and hyper-parameters, but this run's `ns_dtype` (a property of the device and
        precision a run trains on, not of the checkpoint: a run saved on the CPU resumes on CUDA in bf16)."""
        keep = [group["ns_dtype"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, dtype in zip(self.param_groups, keep):
            group["ns_dtype"] = dtype

    def _nesterov(self, p: Tensor, mu: float, nesterov: bool) -> Tensor:
        """buf ← μ·buf + g; the update is g + μ·buf (Nesterov) or buf."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(p.grad)
        return p.grad.add(buf, alpha=mu) if nesterov else buf.clone()

    def _nesterov_all(self, params: list[Tensor], mu: float, nesterov: bool) -> list[Tensor]:
        """`_nesterov` of every param as three `torch._foreach_*` ops (one fused launch each on CUDA)."""
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        grads = [p.grad for p in params]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        return torch._foreach_add(grads, bufs, alpha=mu) if nesterov else [b.clone() for b in bufs]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            by_shape: dict[tuple, list[Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[(tuple(p.shape), p.device, p.dtype)].append(p)
            for same_shape in by_shape.values():
                # one Newton–Schulz call per chunk of ≤ batch_numel elements, to bound the extra memory
                per_call = max(1, group["batch_numel"] // same_shape[0].numel())
                for start in range(0, len(same_shape), per_call):
                    params = same_shape[start : start + per_call]
                    updates = self._nesterov_all(params, group["momentum"], group["nesterov"])
                    ortho = orthogonalize(
                        updates,
                        group["heads"],
                        group["rms"],
                        batch_numel=group["batch_numel"],
                        steps=tuple(group["ns_steps"]),
                        dtype=group["ns_dtype"],
                    )
                    torch._foreach_mul_(params, 1 - lr * wd)  # decoupled weight decay with the unscaled lr
                    if isinstance(lr, Tensor):  # a device scalar (a CUDA-graphed step: train/graphs.py)
                        torch._foreach_mul_(ortho, lr)
                        torch._foreach_sub_(params, ortho)
                    else:
                        torch._foreach_add_(params, ortho, alpha=-lr)
        return loss
