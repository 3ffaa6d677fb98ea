"""DeepSeek-V4.1-Flash text model: embed → hyper-connection streams → 40 blocks → collapse → head.

Reads top-down (SPEC §1a, §2, §5): token embeddings become `hc_mult` identical streams; Engram adds
n-gram memory to the streams before its blocks; each Block runs attention and MoE between mHC
mixes (single-pass: a sublayer is fed by the pre-mix its predecessor computed); the last pre-mix
collapses the streams, then RMSNorm and an fp32 head give logits.

CED (SPEC §2) needs no special module: the decoder's only kv source is its first layer, whose
compressor reads that layer's normalized attention input — the encoder output — so every decoder
layer's global KV is a projection of the encoder output, exactly as in the official model.

`Transformer.forward(tokens)` returns logits. `Transformer.losses(...)` is the training entry
point: LM loss, indexer KL loss and MoE balance loss, separately, on packed batches whose
documents never interact. Parameter names equal the official checkpoint's.

Vision (SPEC §5, `model/vision.py`): a config with `vision_n_layers > 0` also builds the ViT
(`vision`), the aligner (`aligner`) and the learned span embeddings (`image_start`, `image_end`,
`image_newline`). `vision.encode_images` turns images into span embeddings; `forward` / `losses`
take them as `image_embeds` (M, dim), placed in row-major order at the M True positions of
`image_mask`, which also route with `bias_vl` and are dead for Engram.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.kernels import ops
from dsv41.model.attention import Attention
from dsv41.model.engram import Engram, NgramHasher
from dsv41.model.mhc import hc_pre, identity_pre_mix
from dsv41.model.moe import MoE, official_parameters
from dsv41.model.norm import RMSNorm
from dsv41.model.sparse_attention import attention_forward as sparse_attention
from dsv41.model.state import ForwardContext
from dsv41.model.vision import Aligner, ViT, init_vision
from dsv41.plan import LayerPlan, layer_plan

# a sublayer's mHC coefficients: pre (B, T, n), post (B, T, n), comb (B, T, n, n) fp32
Coefs = tuple[Tensor, Tensor, Tensor]
# what a block's last pass hands the next block: (its collapsed input x (B, T, d), its attention coefficients)
Entry = tuple[Tensor, Coefs | None]


class Block(nn.Module):
    """Attention and MoE sublayers between hyper-connection mixes."""

    def __init__(self, config: ModelConfig, plan: LayerPlan):
        super().__init__()
        c = config
        self.layer_id = plan.layer_id
        self.hc_mult, self.single_pass = c.hc_mult, c.single_pass_mhc
        self.attn = Attention(c, plan)
        self.ffn = MoE(plan.layer_id, c)
        self.engram = Engram(c, plan.layer_id) if plan.engram else None
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.dim
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, width))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, width))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))
        self._hc = dict(norm_eps=c.norm_eps, hc_mult=c.hc_mult, iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps)

    def split(self, mixes: Tensor, which: str) -> tuple[Tensor, Tensor, Tensor]:
        """Sinkhorn split of projected mixes into (pre, post, comb) with this sublayer's scale/base."""
        return ops.mhc_split(mixes, *self._split_args(which))

    def mixes(self, h: Tensor, which: str) -> tuple[Tensor, Tensor, Tensor]:
        """(pre, post, comb) of this sublayer from the streams h: projection and split (`ops.mhc_mixes_split`)."""
        return ops.mhc_mixes_split(h, getattr(self, f"hc_{which}_fn"), self._hc["norm_eps"],
                                   *self._split_args(which))

    def _split_args(self, which: str) -> tuple[Tensor, Tensor, int, int, float]:
        """The Sinkhorn split's arguments after the mixes: (scale, base, hc_mult, iters, eps) of a sublayer."""
        hc = self._hc
        return getattr(self, f"hc_{which}_scale"), getattr(self, f"hc_{which}_base"), hc["hc_mult"], hc["iters"], \
            hc["hc_eps"]

    def hand_over(self, h: Tensor, f: Tensor, coefs: Coefs, nxt: Block | None, which: str
                  ) -> tuple[Tensor, Tensor, Coefs | None]:
        """One fused pass over the streams after a sublayer with coefficients `coefs` = (pre, post, comb): the
        residual update, the next sublayer's input (mixed with this `pre`: single-pass) and, when `nxt` is
        given, the coefficients of its `which` sublayer (projection and Sinkhorn split: `ops.mhc_post_split`)."""
        pre, post, comb = coefs
        eps = self._hc["norm_eps"]
        if nxt is None:
            h, x, _ = ops.mhc_post(h, f, post, comb, pre, None, eps)
            return h, x, None
        return ops.mhc_post_split(h, f, post, comb, pre, getattr(nxt, f"hc_{which}_fn"), eps, *nxt._split_args(which))

    def attn_input(self, h: Tensor, pre_mix: Tensor) -> Tensor:
        """The attention sublayer's normalized input (what a kv source compresses)."""
        if not self.single_pass:
            pre_mix = self.mixes(h, "attn")[0]
        return self.attn_norm(hc_pre(h, pre_mix))

    @torch.no_grad()
    def init_mixing(self, n: int) -> None:
        """Training initialization of the block's own small parameters: near-identity mHC mixing (pre ≈ 1/n
        per stream, comb ≈ identity after Sinkhorn, small dynamic weights) and a zero attention sink."""
        for which in ("attn", "ffn"):
            nn.init.normal_(getattr(self, f"hc_{which}_fn"), std=1e-3)
            base = getattr(self, f"hc_{which}_base")
            base.zero_()
            base[:n] = -math.log(n - 1) if n > 1 else 0.0  # pre ≈ 1/n per stream
            base[2 * n:] = (4.0 * torch.eye(n)).flatten()  # comb ≈ identity after Sinkhorn
            getattr(self, f"hc_{which}_scale").fill_(1.0)
        self.attn.attn_sink.zero_()

    def forward(self, h: Tensor, pre_mix: Tensor, attention: Callable[[Tensor], Tensor],
                image_mask: Tensor | None = None, token_mask: Tensor | None = None,
                entry: Entry | None = None, next_block: Block | None = None) -> tuple[Tensor, Tensor, Entry]:
        """h: (B, T, n, d) streams; pre_mix: (B, T, n) made by the previous sublayer; `attention`
        maps the normalized input to the attention output (the model's full-sequence attention or
        the engine's cached one). Each hand-over between sublayers is one fused pass over the
        streams (`hand_over`: residual update, next sublayer's input, next coefficients).
        `entry` = (collapsed input, attention coefficients) when the previous block's last pass made
        them; `next_block` = the block after this one when nothing changes h before it (its attention
        coefficients come out of this block's last pass). Returns (h, pre_mix, entry for the next block)."""
        if entry is None or entry[1] is None:
            entry = (hc_pre(h, pre_mix), self.mixes(h, "attn"))
        x, attn = entry  # attn = (pre, post, comb)
        if not self.single_pass:
            x = hc_pre(h, attn[0])
        f = attention(self.attn_norm(x))
        h, x, ffn = self.hand_over(h, f, attn, self, "ffn")
        if not self.single_pass:
            x = hc_pre(h, ffn[0])
        f = self.ffn(self.ffn_norm(x), image_mask=image_mask, token_mask=token_mask)
        h, x, coefs = self.hand_over(h, f, ffn, next_block, "attn")
        return h, ffn[0], (x, coefs)


@dataclass
class Losses:
    """Training losses of one forward, kept apart so each can be logged."""

    lm: Tensor  # mean next-token cross-entropy over target tokens
    indexer: Tensor  # mean KL of the index sources (0 when none ran)
    balance: Tensor  # mean sequence-level MoE balance loss over layers (unweighted)
    total: Tensor  # lm + indexer_loss_weight·indexer + balance_loss_weight·balance
    n_tokens: Tensor  # () long: the target tokens counted (a tensor: reading it on the host syncs)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = c = config
        self.plan = layer_plan(c)
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c, p) for p in self.plan)
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.hasher = NgramHasher(c) if c.engram_layer_ids else None
        self.engram_index = {layer: k for k, layer in enumerate(c.engram_layer_ids)}
        # a block's last pass may project the next block's mixes (fused mHC); off when blocks live in
        # separate shards or pipeline stages (`dsv41.parallel`), where the next hc_attn_fn is not at hand
        self.fuse_across_blocks = True
        self.vision: ViT | None = None
        if c.vision_enabled:  # built after the text modules: a text model's initialization is unchanged
            self.vision, self.aligner = ViT(c), Aligner(c)
            self.image_start = nn.Parameter(torch.zeros(c.dim))
            self.image_end = nn.Parameter(torch.zeros(c.dim))
            self.image_newline = nn.Parameter(torch.zeros(c.dim))

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: Tensor, doc_ids: Tensor | None = None, image_mask: Tensor | None = None,
                ctx: ForwardContext | None = None, image_embeds: Tensor | None = None,
                attention: str = "dense") -> Tensor:
        """tokens (B, T) → logits (B, T, vocab) fp32. doc_ids (B, T) separates packed documents;
        image_embeds (M, dim) replace the embeddings at the M True positions of image_mask; attention
        "dense" (the masked spec) or "sparse" (window band ∪ gathered top-k, same math)."""
        ctx = ctx or ForwardContext.build(tokens, doc_ids, attention=attention)
        return self.head_logits(self.hidden(tokens, ctx, image_mask, image_embeds=image_embeds))

    def embed_tokens(self, tokens: Tensor, image_mask: Tensor | None = None,
                     image_embeds: Tensor | None = None) -> Tensor:
        """Token embeddings (B, T, dim), image positions taking `image_embeds` (M, dim) in row-major order."""
        x = self.embed(tokens)
        if image_embeds is None:
            return x
        if image_mask is None or int(image_mask.sum()) != image_embeds.shape[0]:
            n = None if image_mask is None else int(image_mask.sum())
            raise ValueError(f"{image_embeds.shape[0]} image embeddings for {n} image positions")
        return x.masked_scatter(image_mask.unsqueeze(-1), image_embeds.to(x.dtype))

    def hidden(self, tokens: Tensor, ctx: ForwardContext, image_mask: Tensor | None = None,
               token_mask: Tensor | None = None, hash_ids: Tensor | None = None,
               image_embeds: Tensor | None = None) -> Tensor:
        """Collapsed final hidden state (B, T, dim), before the final norm. `hash_ids`: Engram addresses
        computed beforehand (they depend on tokens only; a rank holding part of a sequence hashes the
        whole rows)."""
        if self.hasher is not None and hash_ids is None:
            hash_ids = self.hasher(tokens, doc_ids=ctx.doc_ids, dead_mask=image_mask)
        engram_mask = None if image_mask is None else ~image_mask
        x = self.embed_tokens(tokens, image_mask, image_embeds)
        h = x.unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)  # (B, T, n, d)
        pre_mix = identity_pre_mix(h, self.config.hc_mult)
        entry = None
        for layer in self.layers:
            if layer.engram is not None:
                h = layer.engram(h, hash_ids[:, :, self.engram_index[layer.layer_id]], engram_mask)
                entry = None  # Engram changed the streams: the next block projects them itself
            attn = partial(sparse_attention, layer.attn) if ctx.attention == "sparse" else layer.attn
            h, pre_mix, entry = layer(h, pre_mix, partial(attn, ctx=ctx), image_mask=image_mask,
                                      token_mask=token_mask, entry=entry, next_block=self.next_block(layer.layer_id))
        return entry[0]  # the last pass already collapsed the streams with the last pre-mix

    def next_block(self, layer_id: int, last: int | None = None) -> Block | None:
        """The block after `layer_id` when its attention coefficients (projection and split) can fuse into this
        block's last pass (it exists, is ≤ `last`, and no Engram touches the streams in between)."""
        nxt = layer_id + 1
        last = len(self.layers) - 1 if last is None else last
        if not self.fuse_across_blocks or nxt > last or self.layers[nxt].engram is not None:
            return None
        return self.layers[nxt]

    def head_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(self.norm(hidden).float(), self.head.weight.float())

    # ------------------------------------------------------------------ training entry point
    def losses(self, tokens: Tensor, targets: Tensor, doc_ids: Tensor | None = None,
               loss_mask: Tensor | None = None, image_mask: Tensor | None = None,
               window_start: Tensor | None = None, image_embeds: Tensor | None = None,
               token_mask: Tensor | None = None, attention: str = "dense") -> Losses:
        """All layers on all tokens (ordinary causal LM). `loss_mask` (B, T) picks the target
        positions; `token_mask` (default: loss_mask) the tokens the MoE statistics count — pass the
        non-padding positions when some real tokens are no targets (image positions); an explicit
        `token_mask` also limits the indexer KL to those queries (padding must not train it). `window_start`
        simulates bounded replay (keys before it are hidden from the window). `attention`: "dense" or
        "sparse"."""
        # an explicit token_mask marks the real tokens: padding queries get no indexer KL either
        ctx = ForwardContext.build(tokens, doc_ids, training_losses=True, window_start=window_start,
                                   attention=attention, query_mask=token_mask)
        if loss_mask is None:
            loss_mask = torch.ones_like(targets, dtype=torch.bool)
        token_mask = loss_mask if token_mask is None else token_mask
        hidden = self.hidden(tokens, ctx, image_mask, token_mask=token_mask, image_embeds=image_embeds)
        logits = self.head_logits(hidden)
        n = loss_mask.sum()  # a tensor: no host sync inside the forward (torch.compile, CUDA streams)
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        lm = (ce * loss_mask.flatten()).sum() / n.clamp_min(1)
        zero = lm.new_zeros(())
        indexer = torch.stack(ctx.indexer_losses).mean() if ctx.indexer_losses else zero
        bal = [m.last_balance_loss for m in self.moe_layers() if m.last_balance_loss is not None]
        balance = torch.stack(bal).mean() if bal else zero
        c = self.config
        total = lm + c.indexer_loss_weight * indexer + c.balance_loss_weight * balance
        return Losses(lm=lm, indexer=indexer, balance=balance, total=total, n_tokens=n)

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]

    # ------------------------------------------------------------------ utilities
    def set_engram_token_map(self, lookup: list[int] | Tensor, compressed_vocab_size: int) -> None:
        """Install the tokenizer's compressed-vocabulary map used by Engram hashing."""
        if self.hasher is not None:
            self.hasher.set_token_map(lookup, compressed_vocab_size)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> Transformer:
        """Training initialization: normal(std) linears and embeddings (output projections scaled
        by 1/√(2·layers)), unit norms, zero sinks and gate biases, near-identity mHC mixing."""
        if seed is not None:
            torch.manual_seed(seed)
        c = self.config
        for name, p in official_parameters(self):  # routed experts one (out, in) matrix at a time
            if p.dim() < 2:
                continue
            if ".hc_" in f".{name}" or name.endswith("q_weight") or name.endswith("k_weight"):
                continue
            scale = 1 / math.sqrt(2 * c.n_layers) if name.endswith(("wo_b.weight", "w2.weight")) else 1.0
            nn.init.normal_(p, std=std * scale)
        n = c.hc_mult
        for layer in self.layers:
            layer.init_mixing(n)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            if isinstance(m, Engram):
                m.q_weight.fill_(1.0)
                m.k_weight.fill_(1.0)
        for moe in self.moe_layers():
            moe.gate.bias.zero_()
            if getattr(moe.gate, "bias_vl", None) is not None:
                moe.gate.bias_vl.zero_()
        if self.vision is not None:
            init_vision(self, std)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
