"""Which parameter goes to which optimizer — the grouping rules of SPEC §7 in one table.

    Sinkhorn-balanced   embed.weight, head.weight, mtp.N.{embed,head}.weight, *.engram.embed.weight
    AdamW, decay        *norm.weight
    AdamW, no decay     attn_sink, hc_*_{fn,base,scale}, engram.{q,k}_weight, every 0-D/1-D param
    Muon, head-wise     attn.wq_b (n_heads), attn.indexer.wq_b (index_n_heads),
                        key projections attn.wkv, *compressor.wkv, indexer.wk (one KV head ⇒ heads=1)
    Muon                every other matrix (wq_a, wo_a, wo_b, compressor.wgate, indexer.weights_proj,
                        ffn.gate, experts, shared_experts, engram.wkv, mtp.N.main_proj, the projector
                        `aligner.w{1,2}`, the ViT's patch embedding, fused wqkv, wo and SwiGLU);
                        the stacked routed experts `ffn.experts.w{1,2,3}` (E, out, in) are E matrices,
                        each orthogonalized and scaled (0.18·√max(out, in)) on its own
    skipped             requires_grad=False (the MoE gate bias is updated by rule, not by gradient)

Every `*.engram.*` parameter additionally gets lr × engram_lr_mult, whichever optimizer it lands in.
The rules are checked top to bottom; the first match wins. `build_optimizer` returns one
`CombinedOptimizer` that a trainer steps and a schedule drives through `param_groups`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dsv41.optim.muon import Muon
from dsv41.optim.sinkhorn import SinkhornBalanced

SINKHORN = (
    re.compile(r"^(mtp\.\d+\.)?(embed|head)\.weight$"),  # token embedding / prediction head (+ MTP copies)
    re.compile(r"(^|\.)engram\.embed\.weight$"),  # Engram n-gram tables
)
ADAMW_DECAY = (re.compile(r"norm\.weight$"), re.compile(r"^vision\.blocks\.\d+\.norm[12]\.weight$"))  # RMSNorm gains
ADAMW_NO_DECAY = (
    re.compile(r"(^|\.)attn_sink$"),
    re.compile(r"(^|\.)hc_\w+_(fn|base|scale)$"),  # mHC gating factors, even the 2-D hc_*_fn
    re.compile(r"(^|\.)engram\.[qk]_weight$"),
)
QUERY_HEADWISE = re.compile(r"(^|\.)attn\.(indexer\.)?wq_b\.weight$")  # heads from the config
KEY_HEADWISE = (  # a single KV head each: head-wise with heads=1 is plain Muon, routed here to show it
    re.compile(r"(^|\.)attn\.wkv\.weight$"),
    re.compile(r"(^|\.)compressor\.wkv\.weight$"),
    re.compile(r"(^|\.)indexer\.wk\.weight$"),
)
KNOWN_MUON = (
    re.compile(r"(^|\.)attn\.(wq_a|wo_a|wo_b)\.weight$"),
    re.compile(r"(^|\.)compressor\.wgate\.weight$"),
    re.compile(r"(^|\.)indexer\.weights_proj\.weight$"),
    re.compile(r"(^|\.)ffn\.(gate|(experts\.\d+|shared_experts)\.w[123])\.weight$"),
    re.compile(r"(^|\.)ffn\.experts\.w[123]$"),  # GroupedExperts: (E, out, in), Muon per expert matrix
    re.compile(r"(^|\.)engram\.wkv\.weight$"),
    re.compile(r"(^|\.)mtp\.\d+\.(main_proj|[eh]_proj)\.weight$"),
    re.compile(r"projector\..*weight$"),  # a vision–language projector by its generic name
    re.compile(r"^aligner\.w[12]\.weight$"),  # ... and by the release's (`aligner`)
    re.compile(r"^vision\.(patch_embed\.proj|blocks\.\d+\.(attn\.(wqkv|wo)|mlp\.w[12]))\.weight$"),  # ViT matrices
)
ENGRAM = re.compile(r"(^|\.)engram\.")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """Where one parameter goes and with which per-group settings."""

    optimizer: str  # "muon" | "sinkhorn" | "adamw" | "skip"
    rule: str  # short human-readable reason
    heads: int | None = None  # Muon only: head-wise split when set
    decay: bool = False  # weight decay applies (Muon always, AdamW only for norm weights)
    lr_mult: float = 1.0  # engram_lr_mult for Engram params


def _match(patterns: tuple[re.Pattern, ...], name: str) -> bool:
    return any(p.search(name) for p in patterns)


def assign(name: str, param: Tensor, heads_for: Callable[[str], int] | None, engram_lr_mult: float = 5.0) -> Assignment:
    """The grouping table above, as code: first matching rule wins."""
    lr_mult = engram_lr_mult if ENGRAM.search(name) else 1.0
    if not param.requires_grad:
        return Assignment("skip", "requires_grad=False")
    if _match(SINKHORN, name) and param.ndim == 2:
        return Assignment("sinkhorn", "embedding / head / Engram table", lr_mult=lr_mult)
    if _match(ADAMW_DECAY, name):
        return Assignment("adamw", "norm weight", decay=True, lr_mult=lr_mult)
    if _match(ADAMW_NO_DECAY, name):
        return Assignment("adamw", "sink / mHC / Engram scale", lr_mult=lr_mult)
    if param.ndim < 2:
        return Assignment("adamw", "bias / scale (<2-D)", lr_mult=lr_mult)
    if QUERY_HEADWISE.search(name):
        if heads_for is None:
            raise ValueError(f"{name} needs a head count: pass heads_for= or give the model a config")
        return Assignment("muon", "query, head-wise", heads=heads_for(name), decay=True, lr_mult=lr_mult)
    if _match(KEY_HEADWISE, name):
        return Assignment("muon", "key, head-wise (1 head)", heads=1, decay=True, lr_mult=lr_mult)
    if _match(KNOWN_MUON, name):
        rule = "matrix" if param.ndim == 2 else f"{param.shape[0]} stacked matrices, one by one"
        return Assignment("muon", rule, decay=True, lr_mult=lr_mult)
    if param.ndim > 2:
        rule = f"unknown {param.ndim}-D tensor (default Muon over its last two dims)"
    else:
        rule = "unknown matrix (default Muon)"
    return Assignment("muon", rule, decay=True, lr_mult=lr_mult)


def heads_from_config(config) -> Callable[[str], int]:
    """Query head counts from a ModelConfig: `index_n_heads` for the indexer, `n_heads` otherwise."""

    def heads_for(name: str) -> int:
        return config.index_n_heads if ".indexer." in name else config.n_heads

    return heads_for


@dataclass
class GroupingSummary:
    """Per-parameter assignments, for logging and tests."""

    assignments: dict[str, tuple[tuple[int, ...], Assignment]] = field(default_factory=dict)

    def counts(self) -> dict[str, tuple[int, int]]:
        """optimizer → (number of tensors, number of elements)."""
        out: dict[str, tuple[int, int]] = {}
        for shape, a in self.assignments.values():
            n, numel = out.get(a.optimizer, (0, 0))
            out[a.optimizer] = (n + 1, numel + int(torch.Size(shape).numel()))
        return out

    def notes(self) -> list[str]:
        unknown = [(name, a) for name, (_, a) in self.assignments.items() if a.rule.startswith("unknown")]
        return [f"{name}: {a.rule}" for name, a in unknown]

    def __str__(self) -> str:
        lines = [f"{'parameter':<48} {'shape':<18} {'optimizer':<9} {'heads':>5} {'wd':>3} {'lr×':>4}  rule"]
        for name, (shape, a) in self.assignments.items():
            heads = "" if a.heads is None else str(a.heads)
            lines.append(
                f"{name:<48} {str(list(shape)):<18} {a.optimizer:<9} {heads:>5} {'y' if a.decay else '':>3} "
                f"{a.lr_mult:>4g}  {a.rule}"
            )
        for opt, (n, numel) in self.counts().items():
            lines.append(f"{opt}: {n} tensors, {numel:,} elements")
        lines += [f"note: {note}" for note in self.notes()]
        return "\n".join(lines)


class CombinedOptimizer:
    """Several torch optimizers driven as one: step, zero_grad, param_groups, state_dict.

    Every group carries `lr_mult`; a schedule sets group["lr"] = lr · group["lr_mult"].
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], summary: GroupingSummary | None = None):
        self.optimizers = optimizers
        self.summary = summary

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"optimizer state has {sorted(state_dict)}, expected {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


def build_optimizer(
    model: nn.Module,
    lr: float,
    *,
    weight_decay: float = 0.1,
    engram_lr_mult: float = 5.0,
    heads_for: Callable[[str], int] | None = None,
    momentum: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    adam_eps: float = 1e-20,
    muon_rms: float = 0.18,
    sinkhorn_gamma: float = 0.18,
    ns_dtype: torch.dtype = torch.float32,
) -> CombinedOptimizer:
    """Muon + SinkhornBalanced + AdamW over `model`, grouped by `assign`; `.summary` tells who got what.

    Head counts come from `heads_for(name)` or else `model.config` (or `model.args`).
    """
    if heads_for is None:
        config = getattr(model, "config", None) or getattr(model, "args", None)
        heads_for = heads_from_config(config) if config is not None else None
    summary = GroupingSummary()
    # (optimizer, heads, decay, lr_mult) → named params, in model order so a rebuild matches a checkpoint
    buckets: dict[tuple, list[tuple[str, Tensor]]] = {}
    for name, p in model.named_parameters():
        a = assign(name, p, heads_for, engram_lr_mult)
        summary.assignments[name] = (tuple(p.shape), a)
        if a.optimizer != "skip":
            buckets.setdefault((a.optimizer, a.heads, a.decay, a.lr_mult), []).append((name, p))

    for note in summary.notes():
        logger.warning("optimizer grouping: %s", note)

    groups: dict[str, list[dict]] = {"muon": [], "sinkhorn": [], "adamw": []}
    for (kind, heads, decay, lr_mult), named in buckets.items():
        group = {"params": named, "lr": lr * lr_mult, "lr_mult": lr_mult}
        if kind == "muon":
            group |= {"heads": heads, "weight_decay": weight_decay}
        elif kind == "adamw":
            group |= {"weight_decay": weight_decay if decay else 0.0}
        groups[kind].append(group)

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if groups["muon"]:
        optimizers["muon"] = Muon(groups["muon"], lr=lr, momentum=momentum, rms=muon_rms, ns_dtype=ns_dtype)
    if groups["sinkhorn"]:
        optimizers["sinkhorn"] = SinkhornBalanced(groups["sinkhorn"], lr=lr, momentum=momentum, gamma=sinkhorn_gamma)
    if groups["adamw"]:
        optimizers["adamw"] = torch.optim.AdamW(groups["adamw"], lr=lr, betas=betas, eps=adam_eps)
    return CombinedOptimizer(optimizers, summary)
