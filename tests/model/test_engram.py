"""Engram: hash ids against a slow pure-Python reference, bucket layout, chunked = full, and the
gated memory read against a float64 hand computation."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import dsv41
from dsv41.model.engram import Engram, NgramHasher, hash_multipliers
from dsv41.plan import engram_primes, engram_table_rows

FP32_RTOL, FP32_ATOL = 3e-7, 3e-7  # fp32 memory read vs fp64: measured worst ratio 0.3 to this bound (4.8e-7 abs)
INT64 = 1 << 64


def _tiny(layers: list[int] | None = None, **changes) -> dsv41.ModelConfig:
    """The tiny preset, optionally with more Engram layers (table rows sized from their primes)."""
    c = dsv41.load_config("tiny")
    if layers is not None:
        c = c.replace(engram_layer_ids=layers, engram_num_embeddings=[1] * len(layers), **changes)
        c = c.replace(engram_num_embeddings=engram_table_rows(c))
    elif changes:
        c = c.replace(**changes)
    return c


def _signed64(v: int) -> int:
    v %= INT64
    return v - INT64 if v >= 1 << 63 else v


def _reference_multipliers(config, size: int) -> list[list[int]]:
    bound = max(1, ((2**63 - 1) // size) // 2)
    out = []
    for layer in config.engram_layer_ids:
        rng = np.random.default_rng(10007 * layer)
        vals = rng.integers(low=0, high=bound, size=(config.engram_max_ngram_size,), dtype=np.int64)
        out.append([int(v) * 2 + 1 for v in vals])
    return out


def _reference_hash(config, tokens, *, doc_ids=None, dead=None, history=None, token_map=None, size=None):
    """Slow, position by position, Python ints: the official rule written out."""
    c = config
    N, heads = c.engram_max_ngram_size, c.engram_n_heads
    size = size or c.engram_compressed_vocab_size or c.vocab_size
    mults = _reference_multipliers(c, size)
    primes = engram_primes(c)
    tmap = token_map if token_map is not None else list(range(c.vocab_size))
    pad = tmap[c.engram_pad_id]
    out = []
    for b, seq in enumerate(tokens):
        hist = history[b] if history is not None else []
        rows = []
        for t in range(len(seq)):
            per_layer = []
            for li in range(len(c.engram_layer_ids)):
                blocked, toks = False, []
                for s in range(N):
                    p = t - s
                    if p >= 0:
                        src = seq[p]
                        bad = src < 0 or (dead is not None and dead[b][p])
                        bad = bad or (doc_ids is not None and doc_ids[b][p] != doc_ids[b][t])
                    else:
                        hi = len(hist) + p
                        src = hist[hi] if hi >= 0 else -1
                        bad = src < 0 or (doc_ids is not None and doc_ids[b][0] != doc_ids[b][t])
                    blocked = blocked or bad
                    toks.append(pad if blocked else tmap[src])
                flat_primes = [p for order in primes[li] for p in order]
                offsets = [sum(flat_primes[:k]) for k in range(len(flat_primes))]
                cols = []
                rolling = _signed64(toks[0] * mults[li][0])
                for i in range(1, N):
                    rolling = _signed64(rolling ^ _signed64(toks[i] * mults[li][i]))
                    for h in range(heads):
                        cols.append(rolling % primes[li][i - 1][h])
                per_layer.append([v + offsets[k] for k, v in enumerate(cols)])
            rows.append(per_layer)
        out.append(rows)
    return torch.tensor(out, dtype=torch.int64)


def _random_batch(config, B: int, T: int, gen: torch.Generator):
    tokens = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    tokens[torch.rand(B, T, generator=gen) < 0.1] = config.engram_pad_id  # real pad tokens occur too
    dead = torch.rand(B, T, generator=gen) < 0.1
    # documents: contiguous runs with random cut points
    doc_ids = torch.cumsum((torch.rand(B, T, generator=gen) < 0.15).long(), dim=1)
    return tokens, dead, doc_ids


# ---------------------------------------------------------------------- multipliers
def test_multipliers_match_official_release():
    c = dsv41.load_config("v41-flash")
    m = hash_multipliers(c)
    assert m.dtype == torch.int64
    assert m.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_bucket_primes_are_distinct_primes_from_the_search_start(preset):
    """One distinct prime per (layer, order, head), each ≥ engram_vocab_size (SPEC §1a)."""
    c = dsv41.load_config(preset)
    primes = [p for layer in engram_primes(c) for order in layer for p in order]
    assert len(primes) == len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads
    assert len(set(primes)) == len(primes), "bucket primes repeat"
    assert min(primes) >= c.engram_vocab_size
    composite = [p for p in primes if any(p % k == 0 for k in range(2, math.isqrt(p) + 1))]  # trial division
    assert not composite, f"not prime: {composite}"


def test_multipliers_follow_compressed_vocab_size():
    c = _tiny([1, 3, 6])
    m = hash_multipliers(c)
    assert m.shape == (3, c.engram_max_ngram_size)
    assert (m % 2 == 1).all() and (m > 0).all()
    assert m.tolist() == _reference_multipliers(c, c.vocab_size)  # compressed 0 -> vocab_size
    assert hash_multipliers(c, 5000).tolist() == _reference_multipliers(c, 5000)
    fixed = c.replace(engram_compressed_vocab_size=5000)
    assert hash_multipliers(fixed).tolist() == _reference_multipliers(c, 5000)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        hash_multipliers(fixed, 4999)


# ---------------------------------------------------------------------- hashing
@pytest.mark.parametrize("case", ["plain", "dead+docs", "history", "all+token_map"])
def test_hash_matches_python_reference(case):
    c = _tiny([1, 5])
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    B, T, H = 3, 29, c.engram_max_ngram_size - 1
    tokens, dead, doc_ids = _random_batch(c, B, T, gen)
    hasher = NgramHasher(c)
    kw, ref_kw = {}, {}
    if case in ("dead+docs", "all+token_map"):
        kw.update(dead_mask=dead, doc_ids=doc_ids)
        ref_kw.update(dead=dead.tolist(), doc_ids=doc_ids.tolist())
    if case in ("history", "all+token_map"):
        history = torch.randint(0, c.vocab_size, (B, H), generator=gen)
        history[0, 0] = -1  # sequence start two tokens back
        history[1, -1] = -1  # dead right before the chunk: blocks everything farther
        kw["history"] = history
        ref_kw["history"] = history.tolist()
    if case == "all+token_map":
        size = 3001
        lookup = torch.randint(0, size, (c.vocab_size,), generator=gen)
        hasher.set_token_map(lookup, size)
        ref_kw.update(token_map=lookup.tolist(), size=size)
    ids = hasher(tokens, **kw)
    ref = _reference_hash(c, tokens.tolist(), **ref_kw)
    assert ids.shape == (B, T, 2, c.n_engram_hash_cols) and ids.dtype == torch.int64
    mismatch = (ids != ref).sum().item()
    assert mismatch == 0, f"{mismatch} of {ref.numel()} hash ids differ"


def test_hash_ids_stay_in_their_buckets():
    c = _tiny([1, 5])
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    tokens, dead, doc_ids = _random_batch(c, 4, 200, gen)
    ids = NgramHasher(c)(tokens, dead_mask=dead, doc_ids=doc_ids)
    primes = engram_primes(c)
    for li, rows in enumerate(engram_table_rows(c)):
        assert rows <= c.engram_num_embeddings[li]
        flat = [p for order in primes[li] for p in order]
        lo = 0
        for k, p in enumerate(flat):
            col = ids[:, :, li, k]
            assert col.min() >= lo and col.max() < lo + p, f"layer {li} column {k} leaves [{lo}, {lo + p})"
            assert col.unique().numel() > 50  # the hash spreads (not a constant column)
            lo += p
        assert lo == rows


def test_boundaries_reset_the_ngram():
    """The first token of a document hashes like the first token of a sequence (with that token)."""
    c = _tiny()
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    hasher = NgramHasher(c)
    tokens = torch.randint(3, c.vocab_size, (1, 12), generator=gen)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    packed = hasher(tokens, doc_ids=doc_ids)
    alone = hasher(tokens[:, 5:])
    assert torch.equal(packed[:, 5:], alone)
    assert not torch.equal(hasher(tokens)[:, 5:], alone)  # without doc ids the look-back crosses


@pytest.mark.parametrize("chunks", ["prefill", "decode"])
def test_chunked_with_history_equals_full(chunks):
    c = _tiny([1, 5])
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    B, T, H = 2, 40, c.engram_max_ngram_size - 1
    tokens, dead, doc_ids = _random_batch(c, B, T, gen)
    hasher = NgramHasher(c)
    hasher.set_token_map(torch.randint(0, 700, (c.vocab_size,), generator=gen), 700)
    full = hasher(tokens, dead_mask=dead, doc_ids=doc_ids)
    if chunks == "decode":
        cuts = list(range(T + 1))
    else:
        cuts = sorted({0, T, *torch.randint(1, T, (4,), generator=gen).tolist()})
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        # what a cache keeps: the last H raw ids, -1 where dead, before the start or in another document
        history = torch.full((B, H), -1, dtype=torch.int64)
        for k in range(H):
            p = a - H + k
            if p >= 0:
                keep = ~dead[:, p] & (doc_ids[:, p] == doc_ids[:, a])
                history[:, k] = torch.where(keep, tokens[:, p], -1)
        parts.append(hasher(tokens[:, a:b], dead_mask=dead[:, a:b], doc_ids=doc_ids[:, a:b], history=history))
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_short_history_and_negative_ids():
    """History narrower than max_ngram - 1 means sequence start beyond it; a negative token is dead."""
    c = _tiny()
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    hasher = NgramHasher(c)
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=gen)
    short = torch.randint(0, c.vocab_size, (2, 1), generator=gen)
    padded = torch.cat([torch.full((2, c.engram_max_ngram_size - 2), -1), short], dim=1)
    ids = hasher(tokens, history=short)
    assert torch.equal(ids, hasher(tokens, history=padded))
    assert not torch.equal(ids, hasher(tokens))
    dead = torch.rand(2, 9, generator=gen) < 0.3
    assert torch.equal(hasher(torch.where(dead, -1, tokens)), hasher(tokens, dead_mask=dead))


def test_token_map_checks():
    c = _tiny()
    hasher = NgramHasher(c)
    with pytest.raises(ValueError, match="token map values"):
        hasher.set_token_map([0, 1, 2, 10], 10)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(c.replace(engram_compressed_vocab_size=10)).set_token_map([0, 1, 2], 11)
    # a short lookup: the missing ids hash like the pad token
    hasher.set_token_map([5, 6, 7, 8], 9)
    assert hasher.token_map[c.vocab_size - 1] == 7
    assert hasher.multipliers.tolist() == _reference_multipliers(c, 9)


# ---------------------------------------------------------------------- the memory read
def _engram(config, layer_id: int, seed: int) -> Engram:
    torch.manual_seed(seed)
    m = Engram(config, layer_id)
    with torch.no_grad():  # non-trivial gate weights, so a swapped q/k or missing product shows
        m.q_weight.uniform_(0.5, 1.5)
        m.k_weight.uniform_(0.5, 1.5)
    return m


def _hand_engram(m: Engram, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """float64, stream by stream, with norms written as vector lengths."""
    c_dim, hc = m.dim, m.hc_mult
    table = m.embed.weight.detach().double()
    W = m.wkv.weight.detach().double()
    B, T = ids.shape[:2]
    out = x.double().clone()
    for b in range(B):
        for t in range(T):
            e = torch.cat([table[i] for i in ids[b, t].tolist()])
            kv = W @ e
            value = kv[hc * c_dim:]
            for j in range(hc):
                key = kv[j * c_dim:(j + 1) * c_dim]
                h = x[b, t, j].double()
                wq = (m.q_weight[j] * m.k_weight[j]).detach().double()
                rms_h = h.norm() / c_dim**0.5
                rms_k = key.norm() / c_dim**0.5
                dot = float((h * wq * key).sum() / (rms_h * rms_k) / c_dim**0.5)
                g = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(max(abs(dot), 1e-6))))
                if mask is not None and not mask[b, t]:
                    g = 0.0
                out[b, t, j] = h + g * value
    return out


def test_engram_matches_hand_computation():
    c = _tiny([1, 5])
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m = _engram(c, 5, seed)
    assert m.engram_index == 1 and m.embed.weight.shape == (c.engram_num_embeddings[1], c.engram_head_dim)
    tokens, dead, doc_ids = _random_batch(c, 2, 7, gen)
    all_ids = NgramHasher(c)(tokens, dead_mask=dead, doc_ids=doc_ids)
    x = torch.randn(2, 7, c.hc_mult, c.dim, generator=gen) * 3
    mask = torch.rand(2, 7, generator=gen) < 0.7
    out = m(x, all_ids[:, :, 1], mask)
    ref = _hand_engram(m, x, all_ids[:, :, 1], mask).float()
    err = (out - ref).abs()
    ratio = (err / (FP32_ATOL + FP32_RTOL * ref.abs())).max()
    msg = f"max {err.max():.3g} mean {err.mean():.3g}, worst ratio {ratio:.2f}"
    assert torch.allclose(out, ref, rtol=FP32_RTOL, atol=FP32_ATOL), msg
    assert torch.equal(m(x, all_ids, mask), out)  # the full hasher output is sliced to this layer


def test_masked_tokens_pass_through_unchanged():
    c = _tiny()
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m = _engram(c, c.engram_layer_ids[0], seed)
    ids = NgramHasher(c)(torch.randint(0, c.vocab_size, (3, 16), generator=gen))[:, :, 0]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, c.hc_mult, c.dim, generator=gen).to(dtype)
        mask = torch.rand(3, 16, generator=gen) < 0.5
        out = m(x, ids, mask)
        assert out.dtype == dtype
        assert torch.equal(out[~mask], x[~mask])
        changed = (out[mask] != x[mask]).flatten(1).any(-1)
        assert changed.all()


def test_gradients_reach_every_parameter():
    c = _tiny()
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m = _engram(c, c.engram_layer_ids[0], seed)
    ids = NgramHasher(c)(torch.randint(0, c.vocab_size, (2, 10), generator=gen))[:, :, 0]
    x = torch.randn(2, 10, c.hc_mult, c.dim, generator=gen, requires_grad=True)
    mask = torch.rand(2, 10, generator=gen) < 0.8
    out = m(x, ids, mask)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    used = torch.zeros(m.embed.num_embeddings, dtype=torch.bool)
    used[ids[mask].flatten()] = True  # rows read only by masked tokens get no gradient
    row_grad = m.embed.weight.grad.abs().sum(-1)
    assert (row_grad[used] > 0).all() and (row_grad[~used] == 0).all()
    for name in ("wkv.weight", "q_weight", "k_weight"):
        g = m.get_parameter(name).grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_init_scales():
    c = _tiny()
    torch.manual_seed(random.randrange(1 << 30))
    m = Engram(c, c.engram_layer_ids[0])
    assert abs(m.embed.weight.std().item() - 1.0) < 0.05
    assert torch.equal(m.q_weight, torch.ones(c.hc_mult, c.dim)) and torch.equal(m.k_weight, m.q_weight)
    ids = NgramHasher(c)(torch.randint(0, c.vocab_size, (4, 64)))[:, :, 0]
    kv = m.wkv(m.embed(ids).flatten(-2))
    key, value = kv.split([c.hc_mult * c.dim, c.dim], dim=-1)
    assert 0.8 < key.pow(2).mean().sqrt().item() < 1.2
    assert 0.07 < value.pow(2).mean().sqrt().item() < 0.13
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(c, 0)
