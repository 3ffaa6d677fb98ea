"""DSpark: the release's speculative drafter — draft stages `mtp.{k}` on top of a frozen backbone.

What it is (SPEC §1a "DSpark", §5; the official `inference/model.py` DSparkBlock / DSparkAttention /
DSparkMarkovHead / DSparkConfidenceHead):
  * `n_mtp_layers` stages, each a full `Block` (mHC, attention, MoE with `dspark_n_routed_experts` /
    `dspark_n_activated_experts`) of layer id `n_layers + k`, window-only, no Engram;
  * stage 0 owns `main_proj` / `main_norm`: the backbone's features — the mean over the hc streams of the
    *input* of each `dspark_target_layer_ids` layer, concatenated — projected to one `main_x` per position;
  * a draft block is the anchor token followed by `dspark_block_size - 1` noise tokens
    (`dspark_noise_token_id`) at positions a .. a+K-1; block position i predicts the token at a+i+1, so a
    block of K proposes K tokens;
  * DSpark attention (every stage): queries from the block; keys = this stage's own window KV of the
    main features, `kv_norm(wkv(main_x))` rotated at their positions, over the last `window_size`
    positions before the anchor, plus the block's own keys — non-causal inside the block; one softmax
    with the sink; inverse RoPE and the grouped output projection (the backbone `Attention`'s pieces);
  * the last stage owns the final `norm`, the low-rank Markov head (previous token → `embed` (V, r) →
    `head` (V, r) logit bias) and the confidence head (`proj` over [collapsed hidden, Markov embedding
    of the previous token] → a logit; sigmoid = predicted acceptance of that position);
  * embedding and LM head are the frozen backbone's (`bind(main)`); the checkpoint has no copy of them.

Training form and decode form are one computation: `block_hidden` takes, per anchor, the gathered
window of context keys; training gathers it from the whole row (`context_windows`), the engine adapter
(`dsv41.engine.dspark_drafter`) from a per-sequence ring. Parameter names equal the official ones:
`DSpark.state_dict()` is `mtp.{k}.*`, and `attach(main)` registers the same stages as `main.mtp`, so the
backbone's state dict reads like the release's whole checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.kernels import ops
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.moe import MoE, official_parameters
from dsv41.model.norm import RMSNorm
from dsv41.model.transformer import Block, Transformer
from dsv41.plan import WINDOW, LayerPlan


def stage_plan(config: ModelConfig, stage: int) -> LayerPlan:
    """A draft stage as a layer: id n_layers + stage, window-only, plain RoPE at rope_theta, no Engram."""
    return LayerPlan(config.n_layers + stage, "dspark", WINDOW, 0, None, None, False, False, False, "window")


class MarkovHead(nn.Module):
    """Low-rank first-order token bias: bias(prev) = head · embed[prev] (official DSparkMarkovHead)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)  # weight (V, r), as the release stores it

    def forward(self, prev: Tensor) -> tuple[Tensor, Tensor]:
        """prev (...) token ids → (logit bias (..., V) fp32, Markov embedding (..., r))."""
        e = self.embed(prev)
        return F.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    """Logit of a draft position's acceptance from [hidden, Markov embedding] (no bias, fp32 product)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)

    def forward(self, hidden: Tensor, markov_embed: Tensor) -> Tensor:
        joined = torch.cat([hidden.float(), markov_embed.float()], dim=-1)
        return F.linear(joined, self.proj.weight.float()).squeeze(-1)


def dspark_attention(attn: nn.Module, x: Tensor, positions: Tensor, ctx_kv: Tensor, ctx_valid: Tensor,
                     block_size: int) -> Tensor:
    """DSpark attention of one stage for A blocks of K tokens per row.

    x (B, A·K, dim) normalized block input; positions (B, A, K) block positions; ctx_kv (B, A, W, D)
    context keys of each block (already rotated); ctx_valid (B, A, W). Each query sees its block's valid
    context keys and all K keys of its own block (non-causal), one softmax with the sink; K = V."""
    B, Q, _ = x.shape
    A, K = Q // block_size, block_size
    cos, sin = attn.angles(positions.reshape(B, Q))
    _, q = attn.query(x, cos, sin)  # (B, Q, H, D)
    own = attn.window_kv(x, cos, sin)  # (B, Q, D): the block's keys, rotated at their positions
    H, D = q.shape[-2:]
    q = q.reshape(B, A, K, H, D)  # (B, A, K, H, D)
    keys = torch.cat([ctx_kv.to(own.dtype), own.reshape(B, A, K, D)], dim=2)  # (B, A, W + K, D)
    valid = torch.cat([ctx_valid, ctx_valid.new_ones(B, A, K)], dim=2)  # (B, A, W + K)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax for bf16 models (fp64 stays fp64)
    scores = torch.einsum("bakhd,basd->bahks", q.to(acc), keys.to(acc)) * attn.scale  # (B, A, H, K, W + K)
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    sink = attn.attn_sink.to(acc).view(1, 1, H, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("bahks,basd->bakhd", probs, keys.to(acc)).to(x.dtype)
    return attn.output(o.reshape(B, Q, H, D), cos, sin)  # (B, Q, H, D) → inverse RoPE, grouped projection


class DSparkStage(Block):
    """One draft stage (official DSparkBlock): a window-only Block plus stage 0's input projection and
    the last stage's norm, Markov head and confidence head."""

    def __init__(self, config: ModelConfig, stage: int):
        super().__init__(config, stage_plan(config, stage))
        c = config
        self.stage = stage
        if stage == 0:
            self.main_proj = nn.Linear(c.dim * len(c.dspark_target_layer_ids), c.dim, bias=False)
            self.main_norm = RMSNorm(c.dim, c.norm_eps)
        if stage == c.n_mtp_layers - 1:
            self.norm = RMSNorm(c.dim, c.norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, c.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(c.dim + c.dspark_markov_rank)

    def context_kv(self, main_x: Tensor, positions: Tensor) -> Tensor:
        """This stage's window keys of the main features: main_x (B, T, dim), positions (B, T) → (B, T, D)."""
        cos, sin = self.attn.angles(positions)
        return self.attn.window_kv(main_x, cos, sin)


class DSpark(nn.Module):
    """The drafter: `mtp` = the draft stages. Call `bind(main)` before a forward (embedding and head)."""

    def __init__(self, config: ModelConfig, stages: nn.ModuleList | None = None):
        super().__init__()
        if not config.dspark_block_size:
            raise ValueError("DSpark: the config has no drafter (dspark_block_size = 0; see config.with_dspark)")
        self.config = c = config
        self.block_size, self.noise_token_id = c.dspark_block_size, c.dspark_noise_token_id
        self.target_layer_ids = list(c.dspark_target_layer_ids)
        self.window = c.window_size
        self.mtp = stages if stages is not None else nn.ModuleList(DSparkStage(c, k) for k in range(c.n_mtp_layers))
        self._main: tuple[Transformer, ...] = ()  # the frozen backbone, deliberately not a submodule

    # ------------------------------------------------------------------ the backbone it rides on
    def bind(self, main: Transformer) -> DSpark:
        """Use `main`'s embedding and head (not registered: they stay out of this state dict)."""
        if main.config.dim != self.config.dim or main.config.vocab_size != self.config.vocab_size:
            raise ValueError("DSpark.bind: backbone and drafter disagree on dim or vocab_size")
        if max(self.target_layer_ids) >= len(main.layers):
            raise ValueError(f"DSpark.bind: target layers {self.target_layer_ids} exceed the backbone's "
                             f"{len(main.layers)} layers")
        self._main = (main,)
        return self

    @property
    def main(self) -> Transformer:
        if not self._main:
            raise RuntimeError("DSpark: call bind(main) first (the drafter shares the backbone's embedding and head)")
        return self._main[0]

    def attach(self, main: Transformer) -> DSpark:
        """Bind and register the stages as `main.mtp`, so `main.state_dict()` holds the official `mtp.*`."""
        main.mtp = self.mtp
        return self.bind(main)

    @property
    def first(self) -> DSparkStage:
        return self.mtp[0]

    @property
    def last(self) -> DSparkStage:
        return self.mtp[-1]

    # ------------------------------------------------------------------ pieces
    def main_x(self, features: Tensor) -> Tensor:
        """Target-layer features (..., n_targets·dim) → main_norm(main_proj(·)) (..., dim)."""
        return self.first.main_norm(self.first.main_proj(features))

    def context_keys(self, main_x: Tensor, positions: Tensor) -> list[Tensor]:
        """Every stage's window keys of main_x (B, T, dim) at positions (B, T): [(B, T, D)] per stage."""
        return [stage.context_kv(main_x, positions) for stage in self.mtp]

    def block_hidden(self, anchor_tokens: Tensor, positions: Tensor, contexts: Sequence[tuple[Tensor, Tensor]],
                     token_mask: Tensor | None = None) -> Tensor:
        """The draft blocks through every stage.

        anchor_tokens (B, A); positions (B, A) of the anchors; contexts[k] = (keys (B, A, W, D), valid
        (B, A, W)) of stage k; token_mask (B, A) False = a padding block (MoE statistics skip it).
        Returns the collapsed hidden state before the final norm, (B, A, K, dim)."""
        B, A = anchor_tokens.shape
        K = self.block_size
        ids = anchor_tokens.new_full((B, A, K), self.noise_token_id)
        ids[:, :, 0] = anchor_tokens
        pos = positions.unsqueeze(-1) + torch.arange(K, device=positions.device)  # (B, A, K)
        x = self.main.embed(ids.reshape(B, A * K))  # (B, A·K, dim)
        h = x.unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)  # (B, A·K, n, dim)
        pre_mix = identity_pre_mix(h, self.config.hc_mult)
        mask = None if token_mask is None else token_mask.unsqueeze(-1).expand(B, A, K).reshape(B, A * K)
        for stage, (ctx_kv, ctx_valid) in zip(self.mtp, contexts):
            attention = partial(dspark_attention, stage.attn, positions=pos, ctx_kv=ctx_kv, ctx_valid=ctx_valid,
                                block_size=K)
            h, pre_mix, _ = stage(h, pre_mix, attention, token_mask=mask)
        return hc_pre(h, pre_mix).reshape(B, A, K, -1)  # (B, A, K, dim)

    def base_logits(self, hidden: Tensor) -> Tensor:
        """Final norm of the last stage, the backbone's head: (..., dim) → (..., V) fp32."""
        return F.linear(self.last.norm(hidden).float(), self.main.head.weight.float())

    def head_outputs(self, hidden: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced heads: hidden (..., K, dim), prev (..., K) the token before each position →
        (draft logits (..., K, V) = base + Markov bias, confidence logits (..., K))."""
        bias, markov = self.last.markov_head(prev)
        return self.base_logits(hidden) + bias, self.last.confidence_head(hidden, markov)

    def sample(self, hidden: Tensor, anchor_tokens: Tensor, temperature: float = 0.0,
               generator: torch.Generator | None = None, return_probs: bool = True
               ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Semi-autoregressive drafting: one forward gave every position's base logits; the Markov head
        adds the previous *drafted* token's bias, position by position (official forward_head).

        hidden (..., K, dim), anchor_tokens (...) → (tokens (..., K) long, draft probabilities (..., K, V)
        the tokens were drawn from (one-hot when greedy), confidence logits (..., K)). `return_probs=False`
        gives None for the probabilities and skips building them (the engine's greedy drafting: a
        (B, K, V) one-hot it never reads) and runs the loop below as one op (`ops.markov_greedy`: K + 1
        kernels on CUDA). No host reads: the greedy form is CUDA-graph capturable."""
        base = self.base_logits(hidden)  # (..., K, V)
        if temperature <= 0 and not return_probs:
            K, markov = self.block_size, self.last.markov_head
            tokens, conf = ops.markov_greedy(base.reshape(-1, K, base.size(-1)),  # (B, K, V)
                                             hidden.reshape(-1, K, hidden.size(-1)),  # (B, K, dim)
                                             anchor_tokens.reshape(-1), markov.embed.weight, markov.head.weight,
                                             self.last.confidence_head.proj.weight)
            return tokens.view(*anchor_tokens.shape, K), None, conf.view(*anchor_tokens.shape, K)  # (..., K)
        prev = anchor_tokens
        tokens, probs, conf = [], [], []
        for i in range(self.block_size):
            bias, markov = self.last.markov_head(prev)
            logits = base[..., i, :] + bias
            conf.append(self.last.confidence_head(hidden[..., i, :], markov))
            if temperature <= 0:
                nxt = logits.argmax(-1)
                p = F.one_hot(nxt, logits.size(-1)).float() if return_probs else None
            else:
                p = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(p.reshape(-1, p.size(-1)), 1, generator=generator).view(p.shape[:-1])
            tokens.append(nxt)
            probs.append(p)
            prev = nxt
        drawn = torch.stack(probs, -2) if return_probs else None
        return torch.stack(tokens, -1), drawn, torch.stack(conf, -1)

    # ------------------------------------------------------------------ training form
    def context_windows(self, keys: Tensor, doc_ids: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """Gather each anchor's context window from a row: keys (B, T, D), doc_ids (B, T), anchors (B, A)
        row indices → (keys (B, A, W, D), valid (B, A, W)): rows a−W .. a−1 of the anchor's document."""
        B, T, D = keys.shape
        idx = anchors.unsqueeze(-1) - self.window + torch.arange(self.window, device=keys.device)  # (B, A, W)
        safe = idx.clamp(min=0)
        same_doc = doc_ids.gather(1, safe.flatten(1)).view_as(idx) == doc_ids.gather(1, anchors).unsqueeze(-1)
        valid = (idx >= 0) & same_doc
        gathered = keys.gather(1, safe.flatten(1).unsqueeze(-1).expand(-1, -1, D)).view(B, *idx.shape[1:], D)
        return gathered, valid

    def forward(self, features: Tensor, tokens: Tensor, positions: Tensor, doc_ids: Tensor, anchors: Tensor,
                token_mask: Tensor | None = None) -> Tensor:
        """Training form: features (B, T, n_targets·dim) of a row, its tokens / positions / doc_ids (B, T),
        anchors (B, A) row indices → block hidden (B, A, K, dim)."""
        main_x = self.main_x(features)
        contexts = [self.context_windows(kv, doc_ids, anchors) for kv in self.context_keys(main_x, positions)]
        return self.block_hidden(tokens.gather(1, anchors), positions.gather(1, anchors), contexts, token_mask)

    # ------------------------------------------------------------------ utilities
    def moe_layers(self) -> list[MoE]:
        return [stage.ffn for stage in self.mtp]

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> DSpark:
        """The backbone's training initialization (normal(std) matrices, output projections scaled,
        unit norms, zero sinks and gate biases, near-identity mHC mixing), on the draft stages."""
        if seed is not None:
            torch.manual_seed(seed)
        n_layers = self.config.n_layers + self.config.n_mtp_layers
        for name, p in official_parameters(self):
            if p.dim() < 2 or ".hc_" in f".{name}":
                continue
            scale = 1 / math.sqrt(2 * n_layers) if name.endswith(("wo_b.weight", "w2.weight")) else 1.0
            nn.init.normal_(p, std=std * scale)
        n = self.config.hc_mult
        for stage in self.mtp:
            stage.init_mixing(n)
            stage.ffn.gate.bias.zero_()
            if stage.ffn.gate.bias_vl is not None:
                stage.ffn.gate.bias_vl.zero_()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def drafter_of(main: Transformer) -> DSpark | None:
    """The drafter whose stages are registered as `main.mtp` (by `attach` or `load_checkpoint`), bound."""
    stages = getattr(main, "mtp", None)
    if stages is None or not main.config.dspark_block_size:
        return None
    return DSpark(main.config, stages).bind(main)


# ---------------------------------------------------------------------- backbone features
@contextmanager
def capture_features(main: Transformer, layer_ids: Sequence[int]) -> Iterator[dict[int, Tensor]]:
    """While active, every forward of `main` records, for each layer in `layer_ids`, the mean over the hc
    streams of that block's input (B, T, dim) — what the release's drafter reads ("the MTP head reads the
    attention input of its target layers, not their output"). Forward pre-hooks: the model is unchanged."""
    found: dict[int, Tensor] = {}

    def hook(layer_id: int, module: nn.Module, args: tuple) -> None:
        found[layer_id] = args[0].mean(dim=2)  # (B, T, n, d) → (B, T, d)

    handles = [main.layers[i].register_forward_pre_hook(partial(hook, i)) for i in layer_ids]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def stack_features(found: dict[int, Tensor], layer_ids: Sequence[int]) -> Tensor:
    """The captured features in target-layer order, concatenated: (..., n_targets·dim)."""
    missing = [i for i in layer_ids if i not in found]
    if missing:
        raise KeyError(f"features of target layers {missing} were not captured")
    return torch.cat([found[i] for i in layer_ids], dim=-1)
