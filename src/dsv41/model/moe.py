"""DeepSeekMoE: a sqrt-softplus gate, SwiGLU experts, one shared expert, and load balancing (SPEC §1a, §5).

Key ideas:
- The gate scores every routed expert (`sqrt(softplus(x·Wᵀ))` in fp32); a per-expert correction bias is
  added *only to choose* the top-k experts, the unbiased scores of the chosen ones weight them
  (renormalized, × route_scale). Text and image tokens have separate biases (`bias`, `bias_vl`).
- Aux-loss-free balancing: after each step `bias += speed · sign(mean load − load)`, per modality, from
  that modality's own load (`update_bias`, `update_moe_biases`).
- A small sequence-level balance loss (DeepSeek-V3) is computed in every training forward and left in
  `MoE.last_balance_loss`; the trainer adds `config.balance_loss_weight` (1e-4) times it to the loss.
- Dispatch sorts the (token, slot) pairs by expert, runs each expert on one contiguous segment — as a
  per-expert loop (the torch twin, any device/dtype) or as one `torch._grouped_mm` per projection
  (bf16 on CUDA) — and un-sorts the results, so the cost is O(tokens · k), never O(tokens · experts).

Numerics follow the reference: the routing weight multiplies the SwiGLU hidden (in fp32) before `w2`,
routed and shared outputs are summed in fp32, the result is cast back to the input dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig

MoEImpl = Literal["auto", "loop", "grouped"]


class Gate(nn.Module):
    """Router: (weights, indices, scores) for each token; official names `weight`, `bias`, `bias_vl`."""

    def __init__(self, layer_id: int, config: ModelConfig) -> None:
        super().__init__()
        self.n_routed, self.topk = config.moe_config(layer_id)
        self.score_func = config.score_func
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.route_scale
        self.weight = nn.Parameter(torch.empty(self.n_routed, config.dim))
        # Selection-only correction biases, changed by `MoE.update_bias`, never by gradient. They stay
        # fp32 whatever the model is cast to (see `_apply`): 1e-3 steps vanish in bf16.
        self.bias = nn.Parameter(torch.zeros(self.n_routed, dtype=torch.float32), requires_grad=False)
        if config.vision_enabled:
            self.bias_vl = nn.Parameter(torch.zeros(self.n_routed, dtype=torch.float32), requires_grad=False)
        else:
            self.bias_vl = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default
        with torch.no_grad():
            self.bias.zero_()
            if self.bias_vl is not None:
                self.bias_vl.zero_()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        for p in (self.bias, self.bias_vl):
            if p is not None and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: Tensor, image_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, dim), image_mask (N,) bool → weights (N, k) fp32, indices (N, k), scores (N, E) fp32."""
        scores = F.linear(x.float(), self.weight.float()) / self.gate_temp  # (N, E)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask[:, None], self.bias_vl, self.bias)  # (N, E)
        indices = (scores + bias).topk(self.topk, dim=-1).indices  # (N, k)
        weights = scores.gather(1, indices)  # (N, k): the bias steers the choice, not the weight
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices, scores


def _swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None) -> Tensor:
    """The reference's clamped SwiGLU in fp32; the routing weight scales the hidden, before w2."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(min=-limit, max=limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    return h if weight is None else weight * h


class Expert(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) · w3 x), with the reference's clamp."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x (n, dim), weight (n, 1) fp32 or None → (n, dim) in x.dtype."""
        h = _swiglu(self.w1(x), self.w3(x), self.swiglu_limit, weight)
        return self.w2(h.to(x.dtype))


# ---------------------------------------------------------------------- routed-expert kernels
def _experts_loop(experts: nn.ModuleList, xs: Tensor, ws: Tensor, counts: Tensor) -> Tensor:
    """Torch twin: each expert on its contiguous segment of the expert-sorted rows."""
    outs = []
    start = 0
    for i, n in enumerate(counts.tolist()):
        if n:
            outs.append(experts[i](xs[start:start + n], ws[start:start + n]))
            start += n
    return torch.cat(outs) if outs else xs.new_zeros(xs.shape)


def _experts_grouped(experts: nn.ModuleList, xs: Tensor, ws: Tensor, counts: Tensor) -> Tensor:
    """All experts in one `torch._grouped_mm` per projection; weights stacked per call (differentiable)."""
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's segment
    limit = experts[0].swiglu_limit
    # Linear weights are (out, in); grouped_mm wants (E, in, out): a transposed (column-major) view.
    # grouped_mm is not autocast-aware: cast the stacked weights to the activations' dtype
    w1 = torch.stack([e.w1.weight for e in experts]).transpose(1, 2).to(xs.dtype)  # (E, dim, inter)
    w3 = torch.stack([e.w3.weight for e in experts]).transpose(1, 2).to(xs.dtype)  # (E, dim, inter)
    w2 = torch.stack([e.w2.weight for e in experts]).transpose(1, 2).to(xs.dtype)  # (E, inter, dim)
    h = _swiglu(torch._grouped_mm(xs, w1, offs=offs), torch._grouped_mm(xs, w3, offs=offs), limit, ws)
    return torch._grouped_mm(h.to(xs.dtype), w2, offs=offs)


@functools.cache
def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per (device, dtype): does `torch._grouped_mm` run and agree with a plain matmul?"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(24, 32, device=device, generator=g).to(dtype)
        b = torch.randn(3, 16, 32, device=device, generator=g).to(dtype)  # (E, out, in)
        offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)  # one empty group
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs).float()
        ref = torch.cat([a[:8] @ b[0].T, a[8:] @ b[2].T]).float()
        return bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _use_grouped(impl: MoEImpl, x: Tensor) -> bool:
    if impl == "loop":
        return False
    if impl == "grouped":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and _grouped_mm_works(x.device, x.dtype)


# ---------------------------------------------------------------------- MoE
class MoE(nn.Module):
    """Shared expert + top-k routed experts; records per-modality loads and the balance loss in training.

    After a training forward: `last_load = {"text": (E,), "image": (E,)}` int64 token counts per expert
    (padding excluded) and `last_balance_loss`, a differentiable scalar the caller scales by
    `config.balance_loss_weight`. Both are None after an eval forward. `moe_impl` picks the dispatch:
    "auto" (grouped_mm for bf16 on CUDA when it works, else the loop), "loop" or "grouped".
    """

    def __init__(self, layer_id: int, config: ModelConfig, moe_impl: MoEImpl = "auto") -> None:
        super().__init__()
        self.n_routed, self.topk = config.moe_config(layer_id)
        self.vision_enabled = config.vision_enabled
        self.bias_update_speed = config.bias_update_speed
        self.moe_impl: MoEImpl = moe_impl
        self.gate = Gate(layer_id, config)
        self.experts = nn.ModuleList(
            Expert(config.dim, config.moe_inter_dim, config.swiglu_limit) for _ in range(self.n_routed)
        )
        self.shared_experts = Expert(config.dim, config.moe_inter_dim, config.swiglu_limit)
        self.last_load: dict[str, Tensor] | None = None
        self.last_balance_loss: Tensor | None = None

    def forward(
        self, x: Tensor, image_mask: Tensor | None = None, token_mask: Tensor | None = None
    ) -> Tensor:
        """x (B, T, dim); image_mask (B, T) True = image token; token_mask (B, T) False = padding."""
        B, T, dim = x.shape
        k = self.topk
        flat = x.reshape(B * T, dim)  # (N, dim)
        if not self.vision_enabled:
            image_mask = None  # a text-only model routes every token with `bias`
        img = image_mask.reshape(B * T) if image_mask is not None else None  # (N,)
        weights, indices, scores = self.gate(flat, img)  # (N, k), (N, k), (N, E)

        # Sort the N·k (token, slot) pairs by expert: each expert's rows become one contiguous segment.
        order = indices.reshape(-1).argsort(stable=True)  # (N·k,)
        counts = torch.bincount(indices.reshape(-1), minlength=self.n_routed)  # (E,)
        xs = flat[order // k]  # (N·k, dim)
        ws = weights.reshape(-1, 1)[order]  # (N·k, 1) fp32
        run = _experts_grouped if _use_grouped(self.moe_impl, x) else _experts_loop
        out = run(self.experts, xs, ws, counts)  # (N·k, dim), x.dtype, expert-sorted
        out = out.new_empty(out.shape).index_copy(0, order, out)  # back to (token, slot) order
        y = out.float().view(B * T, k, dim).sum(dim=1)  # (N, dim) fp32
        y = y + self.shared_experts(flat).float()

        if self.training:
            valid = token_mask.reshape(B * T) if token_mask is not None else None
            self.last_load = self._loads(indices, img, valid)
            self.last_balance_loss = self._balance_loss(
                scores.view(B, T, -1), indices.view(B, T, k), token_mask
            )
        else:
            self.last_load = self.last_balance_loss = None
        return y.to(x.dtype).view(B, T, dim)

    @torch.no_grad()
    def _loads(self, indices: Tensor, img: Tensor | None, valid: Tensor | None) -> dict[str, Tensor]:
        """Per-expert token counts of text and image tokens, padding excluded."""
        keep = torch.ones(indices.shape[0], dtype=torch.bool, device=indices.device) if valid is None \
            else valid.bool()
        is_img = torch.zeros_like(keep) if img is None else img.bool()
        k = indices.shape[1]
        load = {}
        for name, sel in (("text", keep & ~is_img), ("image", keep & is_img)):
            ones = sel.long().repeat_interleave(k)  # (N·k,) 1 for counted slots; no boolean indexing/sync
            load[name] = torch.zeros(self.n_routed, dtype=torch.long, device=indices.device).scatter_add_(
                0, indices.reshape(-1), ones
            )
        return load

    def _balance_loss(self, scores: Tensor, indices: Tensor, token_mask: Tensor | None) -> Tensor:
        """Sequence-level balance loss: mean over sequences of Σ_i f_i P_i (1 when perfectly balanced).

        f_i = E/(k·T_b) · #{t: i ∈ topk_t},  P_i = mean_t s_{t,i} / Σ_j s_{t,j}; padding excluded,
        sequences with no tokens left out. Differentiable through P (the scores) only.
        """
        B, T, E = scores.shape
        k = indices.shape[-1]
        m = torch.ones(B, T, device=scores.device) if token_mask is None else token_mask.float()  # (B, T)
        n_tok = m.sum(dim=1)  # (B,)
        chosen = torch.zeros(B, E, device=scores.device).scatter_add_(
            1, indices.reshape(B, T * k), m.repeat_interleave(k, dim=1)
        )  # (B, E) selections per expert
        denom = n_tok.clamp(min=1)
        f = chosen * (E / k) / denom[:, None]  # (B, E)
        probs = scores / scores.sum(dim=-1, keepdim=True)  # (B, T, E)
        p = (probs * m[..., None]).sum(dim=1) / denom[:, None]  # (B, E)
        per_seq = (f * p).sum(dim=-1)  # (B,)
        has = (n_tok > 0).float()
        return (per_seq * has).sum() / has.sum().clamp(min=1)

    @torch.no_grad()
    def update_bias(self, load: Mapping[str, Tensor] | None = None, speed: float | None = None) -> None:
        """Aux-loss-free step: bias += speed · sign(mean − load), text → `bias`, image → `bias_vl`.

        `load` defaults to `last_load` (pass a sum over micro-batches / ranks instead); a modality with
        no tokens, or image tokens without `bias_vl`, leaves its bias unchanged.
        """
        load = self.last_load if load is None else load
        if load is None:
            return
        speed = self.bias_update_speed if speed is None else speed
        for name, bias in (("text", self.gate.bias), ("image", self.gate.bias_vl)):
            if bias is None or name not in load:
                continue
            n = load[name].to(device=bias.device, dtype=torch.float32)  # (E,)
            seen = (n.sum() > 0).float()  # no host sync: a zero step when the modality is absent
            bias.add_(speed * seen * torch.sign(n.mean() - n))


def moe_modules(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """Every MoE in `model`, with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            yield name, module


@torch.no_grad()
def update_moe_biases(
    model: nn.Module, loads: Mapping[str, Mapping[str, Tensor]] | None = None, speed: float | None = None
) -> None:
    """Bias step for every MoE in `model`; `loads` maps module name → summed load (default: last_load)."""
    for name, moe in moe_modules(model):
        if loads is None:
            moe.update_bias(None, speed)
        elif name in loads:
            moe.update_bias(loads[name], speed)
