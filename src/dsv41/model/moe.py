"""DeepSeekMoE: a sqrt-softplus gate, SwiGLU experts, one shared expert, and load balancing (SPEC §1a, §5).

Key ideas:
- The gate scores every routed expert (`sqrt(softplus(x·Wᵀ))` in fp32); a per-expert correction bias is
  added *only to choose* the top-k experts, the unbiased scores of the chosen ones weight them
  (renormalized, × route_scale). Text and image tokens have separate biases (`bias`, `bias_vl`).
- Aux-loss-free balancing: after each step `bias += speed · sign(mean load − load)`, per modality, from
  that modality's own load (`update_bias`, `update_moe_biases`).
- A small sequence-level balance loss (DeepSeek-V3) is computed in every training forward and left in
  `MoE.last_balance_loss`; the trainer adds `config.balance_loss_weight` (1e-4) times it to the loss.
- Routed experts live stacked in one `GroupedExperts`: `w1`, `w3` (E, inter, dim), `w2` (E, dim, inter), the
  (out, in) layout of nn.Linear per expert. State-dict hooks keep the release's names
  (`experts.{i}.w{1,2,3}.weight`, views on save, one stack on load), so checkpoints, the FP8/MXFP4
  formats and `load_state_dict(strict=True)` see the official per-expert tensors.
- Dispatch sorts the (token, slot) pairs by expert (stable argsort), counts rows per expert with
  `scatter_add_` and turns the counts into offsets with a cumsum — all on the device — then runs one
  `torch._grouped_mm` per projection over transposed *views* of the stacked weights (cast only when
  autocast computes in another dtype) and un-sorts with `index_copy_`. No host sync and no
  data-dependent shape (every shape follows from N, k, E), so an eval forward can be captured in a CUDA
  graph or compiled with `fullgraph=True`. The per-expert loop (reads the counts on the host) is the twin,
  used where grouped_mm does not run. Cost O(tokens · k), never O(tokens · experts).

Speed note (aten ops of one eval forward, tiny widths, 256 tokens, CPU, counted with
`dsv41.testing.sync.OpCounter`; "kernels" = ops that are not views or bare allocations):
before (the loop, then the default off CUDA) 142 ops / 91 kernels at E = 8, k = 2 and 4,900 / 3,019 at
E = 384, k = 6 (the v41 routing); the old grouped path had 53 / 39 but re-stacked every expert's weights
per call (3 `stack` copies, 3·E·inter·dim elements in all: ~27 GB bf16 per layer at v41 widths). Now grouped:
50 ops / 37 kernels whatever E (3 of them `_grouped_mm`, none copying weights); the loop twin 167 / 93
and 6,023 / 3,021.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.kernels import ops
from dsv41.kernels.ref.swiglu import swiglu as ref_swiglu

MoEImpl = Literal["auto", "loop", "grouped", "dense"]


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
        # route_hook(indices (N, k)) → indices to use: records routing (rollouts) or forces recorded ids
        # (RL's routing replay, `posttrain/rollout.py`); the weights follow the ids it returns. None = off.
        self.route_hook: Callable[[Tensor], Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default
        with torch.no_grad():
            self.bias.zero_()
            if self.bias_vl is not None:
                self.bias_vl.zero_()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """The biases keep their fp32 values through a cast (a cast to bf16 and back would round them: routing
        near ties would change); they follow the device only."""
        kept = [(p, p.data) for p in (self.bias, self.bias_vl) if p is not None and p.dtype == torch.float32]
        super()._apply(fn, recurse)
        for p, data in kept:
            if p.dtype != torch.float32:
                p.data = data.to(p.device) if not data.is_meta or p.is_meta else p.data.float()
        for p in (self.bias, self.bias_vl):
            if p is not None and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: Tensor, image_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, dim), image_mask (N,) bool → weights (N, k) fp32, indices (N, k), scores (N, E) fp32."""
        return self.route(x, image_mask)[:3]

    def route(self, x: Tensor, image_mask: Tensor | None = None, dense: bool = False, dense_ones: int = 0
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """`forward`, and with `dense` the (N, E) routing matrix (each chosen expert's weight, else 0) and
        `dense_ones` more columns of 1. The steps after the matmul are `ops.moe_route` (one kernel on CUDA at
        inference without a route hook)."""
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask[:, None], self.bias_vl, self.bias)  # (N, E)
        return ops.moe_route(logits, bias, self.gate_temp, self.score_func, self.topk, self.norm_topk_prob,
                             self.route_scale, dense, hook=self.route_hook, dense_ones=dense_ones)


def _swiglu(gate: Tensor, up: Tensor, limit: float, weight: Tensor | None) -> Tensor:
    """The reference's clamped SwiGLU in fp32; the routing weight scales the hidden, before w2 (the
    formula is `kernels.ref.swiglu`; the experts call `ops.swiglu`, which also casts for w2 in one pass)."""
    return ref_swiglu(gate, up, limit, weight, torch.float32)


class Expert(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) · w3 x), with the reference's clamp (the shared expert)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x (n, dim), weight (n, 1) fp32 or None → (n, dim) in x.dtype."""
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), self.swiglu_limit, weight, x.dtype))


# ---------------------------------------------------------------------- routed experts, stacked
_WEIGHTS = ("w1", "w2", "w3")


def _expert_name(prefix: str, i: int, w: str) -> str:
    return f"{prefix}{i}.{w}.weight"  # the release's name of expert i's matrix w


def _split_experts(module: GroupedExperts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: stacked `w1` (E, out, in) → `0.w1.weight`, `0.w2.weight`, ... (views, no copy)."""
    stacked = {w: state_dict.pop(prefix + w) for w in _WEIGHTS}
    for i in range(module.n_experts):  # expert-major, as the release's ModuleList of experts orders them
        for w in _WEIGHTS:
            state_dict[_expert_name(prefix, i, w)] = stacked[w][i]


def _stack_experts(module: GroupedExperts, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """load_state_dict pre-hook: the per-expert official tensors → one stacked tensor per projection.

    All E present with the right shape: stacked (one copy). Otherwise each absent expert is reported
    missing and each mis-shaped one as a size mismatch, by its official name; the others are copied into
    their slices (what a non-strict load keeps). A stacked `w1` given directly is loaded as is.
    """
    for w in _WEIGHTS:
        if prefix + w in state_dict:
            continue
        param = getattr(module, w)
        names = [_expert_name(prefix, i, w) for i in range(module.n_experts)]
        if all(n in state_dict and state_dict[n].shape == param.shape[1:] for n in names):
            state_dict[prefix + w] = torch.stack([state_dict.pop(n) for n in names])  # (E, out, in)
            continue
        module._reported_missing.add(prefix + w)  # the post-hook drops the stacked name from `missing`
        with torch.no_grad():
            for i, n in enumerate(names):
                if n not in state_dict:
                    missing_keys.append(n)
                    continue
                t = state_dict.pop(n)
                if t.shape != param.shape[1:]:
                    error_msgs.append(f"size mismatch for {n}: copying a param with shape {tuple(t.shape)}, "
                                      f"the model expects {tuple(param.shape[1:])}.")
                elif param.device.type != "meta":
                    param[i].copy_(t)


def _drop_stacked_missing(module: GroupedExperts, incompatible_keys) -> None:
    """load_state_dict post-hook: the stacked name is not reported missing when its experts were."""
    for name in module._reported_missing:
        while name in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(name)
    module._reported_missing.clear()


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked as three parameters, one slice per expert.

    `w1`, `w3` (E, inter, dim) and `w2` (E, dim, inter) keep nn.Linear's (out, in) layout, so `w1[i]`
    is the release's `experts.{i}.w1.weight`; state-dict hooks write and read exactly those names
    (`model.state_dict()` has no stacked tensor; `load_state_dict(strict=True)` takes the official
    keys). The forward is one `torch._grouped_mm` per projection over transposed *views* — nothing
    is restacked or copied per call.
    """

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 0.0) -> None:
        super().__init__()
        self.n_experts, self.dim, self.inter_dim = n_experts, dim, inter_dim
        self.swiglu_limit = swiglu_limit
        self.w1 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))  # (E, inter, dim)
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))  # (E, dim, inter)
        self.w3 = nn.Parameter(torch.empty(n_experts, inter_dim, dim))  # (E, inter, dim)
        self._reported_missing: set[str] = set()  # load bookkeeping between the two load hooks
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)
        self.register_load_state_dict_post_hook(_drop_stacked_missing)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert, U(±1/√in), drawn in the order separate Linears drew it."""
        with torch.no_grad():
            for i in range(self.n_experts):
                for w in (self.w1, self.w2, self.w3):
                    bound = w.shape[-1] ** -0.5
                    w[i].uniform_(-bound, bound)

    def expert(self, i: int, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """Expert i alone on x (n, dim): the per-expert twin of the grouped forward."""
        h = ops.swiglu(F.linear(x, self.w1[i]), F.linear(x, self.w3[i]), self.swiglu_limit, weight, x.dtype)
        return F.linear(h, self.w2[i])

    def forward(self, xs: Tensor, ws: Tensor, counts: Tensor, grouped: bool = True) -> Tensor:
        """xs (M, dim) rows sorted by expert, ws (M, 1) fp32 routing weights, counts (E,) rows per expert
        (M = Σ counts) → (M, dim) in the dtype a Linear gives (xs.dtype, or autocast's). `grouped`: one
        grouped_mm per projection (no host sync), else the per-expert loop (reads counts on the host)."""
        return self._grouped(xs, ws, counts) if grouped else self._loop(xs, ws, counts)

    def dense(self, x: Tensor, route: Tensor) -> Tensor:
        """Every expert on every row, weighted by `route` (N, E) fp32 (0 where not chosen): x (N, dim) →
        Σ_e route_e · expert_e(x) (N, dim) fp32. Same rounding steps as the grouped path (fp32 SwiGLU ×
        weight, rounded, w2 in the compute dtype, fp32 sum); no sort and no grouped GEMM, so it is static
        and CUDA-graph capturable (torch 2.11's grouped_mm copies from pageable host memory). Costs E/k
        times the routed FLOPs: for few experts (the engine uses it for E ≤ 4k)."""
        N, E, inter = x.size(0), self.n_experts, self.inter_dim
        dtype = _compute_dtype(x)
        a = x.to(dtype)
        g = F.linear(a, self.w1.to(dtype).view(E * inter, -1))  # (N, E·inter): every expert's w1 in one GEMM
        u = F.linear(a, self.w3.to(dtype).view(E * inter, -1))
        h = ops.swiglu(g, u, self.swiglu_limit, route, dtype).view(N, E, inter)  # each expert's block × its weight
        out = torch.bmm(h.transpose(0, 1), self.w2.to(dtype).transpose(1, 2))  # (E, N, dim)
        return out.sum(0, dtype=torch.float32)  # the fp32 sum reads the compute dtype: no fp32 copy first

    def _loop(self, xs: Tensor, ws: Tensor, counts: Tensor) -> Tensor:
        outs = []
        start = 0
        for i, n in enumerate(counts.tolist()):  # the twin may sync: it is the spec, not the fast path
            if n:
                outs.append(self.expert(i, xs[start:start + n], ws[start:start + n]))
                start += n
        return torch.cat(outs) if outs else xs.new_zeros(xs.shape)

    def _grouped(self, xs: Tensor, ws: Tensor, counts: Tensor) -> Tensor:
        offs = counts.cumsum(0, dtype=torch.int32)  # (E,) end row of each expert's segment, on the device
        dtype = _compute_dtype(xs)
        a = xs.to(dtype)  # grouped_mm is not autocast-aware: cast only when autocast asks for another dtype
        # (E, out, in) → (E, in, out): a transposed view; `.to` returns the parameter itself when dtypes agree
        w1, w2, w3 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        h = ops.swiglu(torch._grouped_mm(a, w1, offs=offs), torch._grouped_mm(a, w3, offs=offs), self.swiglu_limit,
                       ws, dtype)
        return torch._grouped_mm(h, w2, offs=offs)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a Linear would compute x in: the autocast dtype when autocast is on for x's device."""
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


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


@functools.cache
def _grouped_mm_traces(dtype: torch.dtype) -> bool:
    """Does grouped_mm's meta kernel (what torch.compile traces with) accept `dtype`? Only bf16 in torch 2.13."""
    try:
        a = torch.empty(8, 32, device="meta", dtype=dtype)
        b = torch.empty(2, 32, 16, device="meta", dtype=dtype)  # (E, in, out)
        torch._grouped_mm(a, b, offs=torch.empty(2, device="meta", dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@torch.compiler.assume_constant_result
def _grouped_ok(device_type: str, dtype: torch.dtype, compiling: bool) -> bool:
    """The probes' answer as a trace-time constant: torch.compile neither traces the probe nor breaks on it."""
    works = hasattr(torch, "_grouped_mm") and _grouped_mm_works(torch.device(device_type), dtype)
    return works and (not compiling or _grouped_mm_traces(dtype))


def _use_grouped(impl: MoEImpl, x: Tensor) -> bool:
    """"auto" probes once per (device, compute dtype), on the first forward, and that probe reads its result
    on the host: run one forward before capturing a CUDA graph (every capture warms up anyway)."""
    if impl == "loop":
        return False
    if impl == "grouped":
        return True
    return _grouped_ok(x.device.type, _compute_dtype(x), torch.compiler.is_compiling())


def _capturing(x: Tensor) -> bool:
    """x's forward is being captured into a CUDA graph (never under torch.compile's tracing)."""
    return x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def _dense_while_capturing(impl: MoEImpl, x: Tensor) -> bool:
    """A forward being captured takes the dense dispatch unless the grouped one is capturable: torch's CUDA
    grouped_mm reads its offsets on the device for bf16 only (torch 2.11: other dtypes copy them from pageable
    host memory, which a capture refuses), and the loop reads the counts on the host. The dense dispatch
    computes the same function (`GroupedExperts.dense`), at E/k times the routed FLOPs."""
    return _capturing(x) and not (_use_grouped(impl, x) and _compute_dtype(x) == torch.bfloat16)


# ---------------------------------------------------------------------- MoE
class MoE(nn.Module):
    """Shared expert + top-k routed experts; records per-modality loads and the balance loss in training.

    After a training forward: `last_load = {"text": (E,), "image": (E,)}` int64 token counts per expert
    (padding excluded) and `last_balance_loss`, a differentiable scalar the caller scales by
    `config.balance_loss_weight`. Both are None after an eval forward. `moe_impl` picks the dispatch:
    "auto" (grouped_mm wherever the probe finds it working for the device and compute dtype — CPU fp32 /
    bf16 in torch 2.13, CUDA bf16 — and, under torch.compile, only where its meta kernel traces: bf16; else
    the loop), "loop", "grouped" or "dense" (every expert on every token, `GroupedExperts.dense`). A forward
    captured into a CUDA graph takes "dense" where the grouped dispatch cannot be captured (`_dense_while_capturing`),
    and a forward of at most `dense_tokens` tokens takes it whatever `moe_impl` says (the engine's decode steps and
    small prefill pieces: fewer kernels than a sort and three grouped products at a few rows, `fuse_dense` folds
    the shared expert in; big prefill chunks keep the routed FLOPs).
    """

    def __init__(self, layer_id: int, config: ModelConfig, moe_impl: MoEImpl = "auto") -> None:
        super().__init__()
        self.n_routed, self.topk = config.moe_config(layer_id)
        self.vision_enabled = config.vision_enabled
        self.bias_update_speed = config.bias_update_speed
        self.moe_impl: MoEImpl = moe_impl
        self.dense_tokens = 0  # forwards of at most this many tokens take the dense dispatch (0: none)
        self._fused: tuple[Tensor, Tensor, tuple[int, ...]] | None = None  # `fuse_dense`: w13, w2, the views' addresses
        self.gate = Gate(layer_id, config)
        self.experts = GroupedExperts(self.n_routed, config.dim, config.moe_inter_dim, config.swiglu_limit)
        self.shared_experts = Expert(config.dim, config.moe_inter_dim, config.swiglu_limit)
        self.last_load: dict[str, Tensor] | None = None
        self.last_balance_loss: Tensor | None = None
        # Hooks for parallelism applied from outside (`dsv41.parallel`); None on one device.
        # expert_dispatch(moe, x (N, dim), weights (N, k), indices (N, k)) → routed sum (N, dim) fp32
        # (expert parallelism: tokens travel to the rank holding their experts and back).
        self.expert_dispatch: Callable[[MoE, Tensor, Tensor, Tensor], Tensor] | None = None
        # sequence_reduce(t) sums per-sequence statistics over the ranks that hold parts of each
        # sequence (context parallelism), so the balance loss sees whole sequences.
        self.sequence_reduce: Callable[[Tensor], Tensor] | None = None

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
        dense = self.expert_dispatch is None and (self.moe_impl == "dense" or B * T <= self.dense_tokens
                                                  or _dense_while_capturing(self.moe_impl, x))
        fused = dense and self._fused_ok()
        # (N, k), (N, k), (N, E), and with `dense` (N, E), or (N, E + 1) fused: the shared expert's block weighted 1
        weights, indices, scores, route = self.gate.route(flat, img, dense, dense_ones=int(fused))
        if self.expert_dispatch is not None:
            y = torch.add(self.expert_dispatch(self, flat, weights, indices), self.shared_experts(flat))  # fp32
            return self._finish(y, x, scores, indices, img, token_mask)
        if dense:  # route: each chosen expert's weight, 0 elsewhere (and the shared block's 1 when fused)
            y = self._dense_fused(flat, route, x.dtype) if fused else \
                torch.add(self.experts.dense(flat, route), self.shared_experts(flat))  # fp32 + the compute dtype
            return self._finish(y, x, scores, indices, img, token_mask)

        # Sort the N·k (token, slot) pairs by expert: each expert's rows become one contiguous segment.
        # Every shape below depends on N, k, E only, and nothing is read on the host (grouped path).
        idx = indices.reshape(-1)  # (N·k,)
        order = idx.argsort(stable=True)  # (N·k,)
        counts = torch.zeros(self.n_routed, dtype=torch.long, device=x.device).scatter_add_(
            0, idx, torch.ones_like(idx)
        )  # (E,) rows per expert, on the device (no bincount: its output size is data-dependent)
        xs = flat.index_select(0, order // k)  # (N·k, dim)
        ws = weights.reshape(-1, 1).index_select(0, order)  # (N·k, 1) fp32
        out = self.experts(xs, ws, counts, grouped=_use_grouped(self.moe_impl, x))  # (N·k, dim), expert-sorted
        out = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, slot) order
        y = out.view(B * T, k, dim).sum(dim=1, dtype=torch.float32)  # (N, dim) fp32
        y = torch.add(y, self.shared_experts(flat))  # fp32: the promotion casts in the add (one kernel, no copy)
        return self._finish(y, x, scores, indices, img, token_mask)

    # ------------------------------------------------------------------ the dense dispatch, shared expert fused
    @torch.no_grad()
    def fuse_dense(self) -> bool:
        """Lay the weights out so that the dense dispatch runs the shared expert as one more expert block (route
        weight 1): the w1 and w3 rows of every routed expert and of the shared expert become one (2·(E+1)·inter,
        dim) matrix and the w2 matrices one (E+1, dim, inter) stack, and the parameters become views into them
        (no copy kept, the state dict unchanged, in-place updates seen by both). A dense forward is then one
        GEMM, a SwiGLU, one batched GEMM and a sum — 5 kernels instead of 10 (the engine's decode steps and
        small prefill pieces; `Engine` calls it where it sets `dense_tokens`). Same function and rounding steps
        as the unfused dense path (each expert's product rounded to the compute dtype, fp32 sum) up to the fp32
        sum's order. Only plain weights of one dtype (not the release's FP8 / MXFP4 modules); False otherwise.
        Idempotent: weights laid out already stay where they are — an engine's CUDA graphs read them by address,
        and a second engine on the same model must not free them (H100, 2026-12-07: the first engine's outputs
        turned to garbage from their first token, then an illegal memory access)."""
        if self._fused_ok():
            return True
        ex, sh = self.experts, self.shared_experts
        if not isinstance(ex, GroupedExperts) or not isinstance(sh, Expert) or ex.inter_dim != sh.w1.out_features \
                or ex.swiglu_limit != sh.swiglu_limit:
            return False
        mats = self._dense_weights()
        if len({(m.dtype, m.device) for m in mats}) != 1 or any(type(m) is not nn.Parameter for m in mats):
            return False
        E, inter = ex.n_experts, ex.inter_dim
        w13 = torch.cat([ex.w1.reshape(E * inter, -1), sh.w1.weight, ex.w3.reshape(E * inter, -1), sh.w3.weight])
        w2 = torch.cat([ex.w2, sh.w2.weight.unsqueeze(0)])  # (E+1, dim, inter)
        cut = (E + 1) * inter
        ex.w1.data = w13[:E * inter].view(E, inter, -1)
        sh.w1.weight.data = w13[E * inter:cut]
        ex.w3.data = w13[cut:cut + E * inter].view(E, inter, -1)
        sh.w3.weight.data = w13[cut + E * inter:]
        ex.w2.data, sh.w2.weight.data = w2[:E], w2[E]
        self._fused = (w13, w2, self._weight_addresses())
        return True

    def _dense_weights(self) -> tuple[Tensor, ...]:
        ex, sh = self.experts, self.shared_experts
        return ex.w1, ex.w2, ex.w3, sh.w1.weight, sh.w2.weight, sh.w3.weight

    def _weight_addresses(self) -> tuple[int, ...]:
        return tuple(w.data_ptr() for w in self._dense_weights())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self._fused is not None and not self._fused_ok():  # a conversion gave the parameters new tensors
            self._fused = None
        return self

    def _fused_ok(self) -> bool:
        """The fused layout is still what all six parameters view (a cast or a reassigned `.data` undoes it)."""
        fused = self._fused
        return fused is not None and self._weight_addresses() == fused[2]

    def _dense_fused(self, flat: Tensor, route: Tensor, out_dtype: torch.dtype) -> Tensor:
        """`experts.dense(flat, route) + shared_experts(flat)` from the fused layout (`fuse_dense`), (N, dim) in
        out_dtype: the sum over the E + 1 blocks accumulates in fp32 and rounds once (torch's reductions of bf16 /
        fp16 accumulate in fp32), so no fp32 copy is written and cast after."""
        w13, w2, _ = self._fused
        N, inter = flat.size(0), self.experts.inter_dim
        E1 = w2.size(0)
        dtype = _compute_dtype(flat)
        gu = F.linear(flat.to(dtype), w13.to(dtype))  # (N, 2·(E+1)·inter): every expert's w1 and w3, the shared too
        # route (N, E + 1): the shared expert's block × 1 (exact)
        h = ops.swiglu(gu[:, :E1 * inter], gu[:, E1 * inter:], self.experts.swiglu_limit, route, dtype)
        out = torch.bmm(h.view(N, E1, inter).transpose(0, 1), w2.to(dtype).transpose(1, 2))  # (E+1, N, dim)
        return out.sum(dim=0, dtype=out_dtype)

    def _finish(self, y: Tensor, x: Tensor, scores: Tensor, indices: Tensor, img: Tensor | None,
                token_mask: Tensor | None) -> Tensor:
        """Record the training statistics; y (N, dim) fp32 → x's dtype and shape."""
        B, T, dim = x.shape
        k = self.topk
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
            ones = sel.long()[:, None].expand(-1, k).reshape(-1)  # (N·k,) 1 for counted slots, no sync
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
            1, indices.reshape(B, T * k), m[:, :, None].expand(B, T, k).reshape(B, T * k)
        )  # (B, E) selections per expert
        if self.sequence_reduce is not None:  # counts of the whole sequence; p below stays this part's
            chosen, n_tok = self.sequence_reduce(chosen), self.sequence_reduce(n_tok)
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
            bias.add_(bias_step(load[name].to(bias.device), speed))


def bias_step(load: Tensor, speed: float) -> Tensor:
    """The aux-loss-free bias change for one modality's per-expert load (E,): speed · sign(mean − load),
    zero when the modality saw no token (no host sync)."""
    n = load.to(torch.float32)  # (E,)
    seen = (n.sum() > 0).float()
    return speed * seen * torch.sign(n.mean() - n)


def official_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """`named_parameters()` with each GroupedExperts' stacked weights as per-expert (out, in) views under
    the release's names, in its order (`...experts.0.w1.weight`, `...experts.0.w2.weight`, ...): what an
    initializer walking separate Linears saw (same names, same order of random draws)."""
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, GroupedExperts):
            for i in range(module.n_experts):
                for w in _WEIGHTS:
                    yield _expert_name(prefix, i, w), getattr(module, w)[i]
        else:
            yield from module.named_parameters(prefix=module_name, recurse=False)


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
