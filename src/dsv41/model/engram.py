"""Engram conditional memory: multi-head n-gram hashing and the gated memory read (SPEC §1a, §5).

Two halves:

* ``NgramHasher`` turns token ids into table addresses. Ids are first canonicalized into the
  compressed vocabulary (``token_map``). For every position t and every n-gram order n = 2..N the
  n-gram ending at t is hashed by a rolling XOR of ``token[t - s] * multiplier[layer, s]`` over
  s = 0..n-1, then reduced modulo one distinct prime per (order, head); adding the bucket's offset
  makes the (order, head) ranges disjoint inside the layer's single table. Look-back stops at the
  sequence start, at dead (image / masked) tokens and, in packed training batches, at document
  boundaries: those slots and every farther one read the pad token instead. Addresses depend on
  token ids only, so they can be computed (and the rows prefetched) before any layer runs.
* ``Engram`` reads the rows, projects them (``wkv``) to one key per residual stream plus one shared
  value, and adds ``gate * value`` to every stream; the gate is a signed square root of the
  normalized dot product of the stream with its key, squashed by a sigmoid.

The formulas are `kernels.ref.engram`'s (the twins of `ops.engram_hash` and `ops.engram_gate`): inference calls
the ops (one kernel each on CUDA), training and packed batches with document ids call the twins.

Names and numerics follow the official reference, so its ``layers.N.engram.*`` weights load as
they are (after the loader dequantizes the FP8 table into ``embed.weight``, or keeps it FP8 for
``weights="as-released"``, `dsv41.model.released`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.kernels import ops
from dsv41.kernels.ref import engram as ref_engram
from dsv41.plan import engram_primes, engram_table_rows


def _compressed_size(config: ModelConfig, compressed_vocab_size: int | None) -> int:
    """The compressed vocabulary size the multipliers derive from; a given size must agree
    with a nonzero config value."""
    configured = config.engram_compressed_vocab_size or config.vocab_size
    if compressed_vocab_size is None:
        return configured
    if compressed_vocab_size <= 0:
        raise ValueError(f"compressed_vocab_size must be positive, got {compressed_vocab_size}")
    if config.engram_compressed_vocab_size and compressed_vocab_size != config.engram_compressed_vocab_size:
        raise ValueError(
            f"token map has compressed vocab size {compressed_vocab_size}, but the config says "
            f"engram_compressed_vocab_size={config.engram_compressed_vocab_size}"
        )
    return compressed_vocab_size


def hash_multipliers(config: ModelConfig, compressed_vocab_size: int | None = None) -> Tensor:
    """Odd hash multipliers (n_engram_layers, engram_max_ngram_size), int64.

    Seeded per layer id with numpy's PCG64 exactly as the reference does; the bound keeps every
    ``token * multiplier`` product inside int64 for tokens of the compressed vocabulary."""
    size = _compressed_size(config, compressed_vocab_size)
    bound = max(1, (np.iinfo(np.int64).max // size) // 2)
    rows = []
    for layer_id in config.engram_layer_ids:
        rng = np.random.default_rng(10007 * layer_id)
        values = rng.integers(low=0, high=bound, size=(config.engram_max_ngram_size,), dtype=np.int64)
        rows.append(values * 2 + 1)
    return torch.from_numpy(np.stack(rows).reshape(len(rows), config.engram_max_ngram_size))


class NgramHasher(nn.Module):
    """Token ids -> Engram table addresses (B, T, n_engram_layers, (max_ngram - 1) * n_heads).

    Columns are order-major, head-minor: (order 2: heads..., order 3: heads..., ...). Buffers are
    not persistent: they are a pure function of the config (and the tokenizer's token map)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        if not c.engram_layer_ids:
            raise ValueError("config has no Engram layers (engram_layer_ids is empty)")
        self.config = c
        self.max_ngram = c.engram_max_ngram_size
        self.n_heads = c.engram_n_heads
        primes = torch.tensor(engram_primes(c), dtype=torch.int64)  # (L, orders, heads)
        flat = primes.flatten(1)  # (L, orders * heads), order-major
        offsets = torch.cumsum(flat, dim=1) - flat  # exclusive cumsum per layer
        # checked in plain Python (engram_table_rows), so building on the meta device works too
        for i, (need, have) in enumerate(zip(engram_table_rows(c), c.engram_num_embeddings)):
            if need > have:
                raise ValueError(
                    f"engram_num_embeddings[{i}] = {have} is smaller than the {need} rows the "
                    f"bucket primes of layer {c.engram_layer_ids[i]} need"
                )
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.register_buffer("multipliers", hash_multipliers(c), persistent=False)
        # identity by default; a tokenizer swaps in its normalized-vocabulary lookup
        self.register_buffer("token_map", torch.arange(c.vocab_size, dtype=torch.int64), persistent=False)
        self.compressed_vocab_size = _compressed_size(c, None)

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def set_token_map(self, lookup: list[int] | Tensor, compressed_vocab_size: int) -> None:
        """Use the tokenizer's raw id -> compressed id table. A lookup shorter than vocab_size
        (a tokenizer smaller than the padded embedding) maps the missing ids like the pad token."""
        size = _compressed_size(self.config, compressed_vocab_size)
        table = torch.as_tensor(lookup, dtype=torch.int64).flatten().cpu()
        vocab, pad = self.config.vocab_size, self.config.engram_pad_id
        if not 0 < table.numel() <= vocab or table.numel() <= pad:
            raise ValueError(f"token map needs {pad + 1}..{vocab} (vocab_size) entries, got {table.numel()}")
        lo, hi = int(table.min()), int(table.max())
        if lo < 0 or hi >= size:
            raise ValueError(f"token map values must lie in [0, {size}), got [{lo}, {hi}]")
        if table.numel() < vocab:
            table = torch.cat([table, table[pad].expand(vocab - table.numel())])
        self.token_map = table.to(self.token_map.device)
        self.multipliers = hash_multipliers(self.config, size).to(self.multipliers.device)
        self.compressed_vocab_size = size

    def forward(
        self,
        tokens: Tensor,
        *,
        doc_ids: Tensor | None = None,
        dead_mask: Tensor | None = None,
        history: Tensor | None = None,
    ) -> Tensor:
        """tokens (B, T) raw ids (negative = dead); doc_ids (B, T) stop look-back at document
        boundaries; dead_mask (B, T) True for image / masked tokens; history (B, <= max_ngram - 1)
        raw ids right before tokens[:, 0], newest last, -1 = sequence start or a dead token (it
        counts as tokens[:, 0]'s document). Returns int64 (B, T, n_engram_layers, n_cols)."""
        args = (tokens, self.token_map, self.multipliers, self.primes, self.offsets, self.config.engram_pad_id)
        if doc_ids is None:  # inference: one kernel on CUDA
            return ops.engram_hash(*args, history=history, dead_mask=dead_mask)
        return ref_engram.engram_hash(*args, history=history, dead_mask=dead_mask, doc_ids=doc_ids)


class Engram(nn.Module):
    """Gated n-gram memory added to the residual streams before block ``layer_id``.

    Init: table rows ~ N(0, 1), like a token embedding (the Sinkhorn-balanced update moves each
    entry by O(lr), so unit entries keep its relative step equal to the token embedding's). ``wkv``
    key rows ~ N(0, 1/fan_in) give unit-RMS keys (their scale cancels in the normalized dot, but
    keeps gradients O(1)); value rows ~ N(0, 0.01/fan_in) give value RMS ≈ 0.1, so the memory
    starts as a small perturbation of the streams while every part still receives gradient.
    ``q_weight`` / ``k_weight`` start at ones (reference)."""

    value_init_rms = 0.1

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        if layer_id not in c.engram_layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer ({c.engram_layer_ids})")
        self.layer_id = layer_id
        self.engram_index = c.engram_layer_ids.index(layer_id)  # picks this layer's hash columns
        self.dim, self.hc_mult, self.eps = c.dim, c.hc_mult, c.norm_eps
        self.n_cols, self.head_dim = c.n_engram_hash_cols, c.engram_head_dim
        self.embed = nn.Embedding(c.engram_num_embeddings[self.engram_index], c.engram_head_dim)
        self.wkv = nn.Linear(self.n_cols * self.head_dim, c.dim * (c.hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.dim))
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, 0.0, 1.0)
        std = 1.0 / math.sqrt(self.wkv.in_features)
        n_key = self.hc_mult * self.dim
        nn.init.normal_(self.wkv.weight[:n_key], 0.0, std)
        nn.init.normal_(self.wkv.weight[n_key:], 0.0, std * self.value_init_rms)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def forward(self, x: Tensor, hash_ids: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """x (B, T, hc, dim) streams; hash_ids (B, T, n_cols) — or the hasher's full
        (B, T, n_engram_layers, n_cols), sliced here; token_mask (B, T), False = no memory."""
        if hash_ids.dim() == 4:
            hash_ids = hash_ids[:, :, self.engram_index]
        rows = self.embed(hash_ids).flatten(-2)  # (B, T, n_cols * head_dim)
        kv = self.wkv(rows)  # (B, T, (hc + 1) * dim); a module call, so `dsv41.model.released` can swap it
        if ops.needs_grad(x, kv, self.q_weight, self.k_weight):  # training: autograd through the twin
            return ref_engram.engram_gate(x, kv, self.q_weight, self.k_weight, self.eps, token_mask)
        return ops.engram_gate(x, kv, self.q_weight, self.k_weight, self.eps, token_mask)  # one kernel on CUDA
