"""Corpus cache, pre-splitting and best-fit packing: padding, coverage (nothing lost or duplicated),
row structure (doc ids, loss mask), exact resume, validation pass."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsv41.train.data import (
    PackedDataset,
    TokenizedCorpus,
    best_fit_pack,
    collate,
    load_texts,
    split_pieces,
    tokenize_corpus,
    val_batches,
)
from dsv41.train.tokenizer import BOS_ID, DATA_DIR, EOS_ID, PAD_ID, Tok, load_tokenizer

SEQ = 512  # rows of 513 tokens
SAMPLE = DATA_DIR / "sample"


@pytest.fixture(scope="module")
def tok() -> Tok:
    return load_tokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokcache")


@pytest.fixture(scope="module")
def corpus(tok, cache_dir) -> TokenizedCorpus:
    return tokenize_corpus(SAMPLE, tok, cache_dir, split="all")  # ~650K tokens


def tiled(corpus: TokenizedCorpus, k: int) -> TokenizedCorpus:
    lengths = np.tile(corpus.lengths, k)
    return TokenizedCorpus(np.tile(np.asarray(corpus.tokens), k), np.concatenate([[0], np.cumsum(lengths)]))


def coverage(corpus: TokenizedCorpus, plan) -> np.ndarray:
    """How many times each corpus token position is placed in the plan's rows."""
    count = np.zeros(corpus.num_tokens, np.int64)
    for d, s, n in zip(plan.doc, plan.start, plan.length):
        count[corpus.offsets[d] + s:corpus.offsets[d] + s + n] += 1
    return count


def epoch_rows(ds: PackedDataset, plan) -> tuple[np.ndarray, np.ndarray]:
    rows = [ds.row_arrays(plan, r) for r in range(len(plan))]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])  # (R, T + 1) each


def test_cache_documents_and_reuse(tok, corpus, cache_dir, monkeypatch):
    texts = load_texts(SAMPLE, "all")
    assert len(corpus) == len(texts) > 500
    assert corpus.tokens.dtype == np.uint16
    for i in (0, len(texts) // 2, len(texts) - 1):
        doc = corpus.doc(i)
        assert doc[0] == BOS_ID and doc[-1] == EOS_ID
        assert tok.decode(doc[1:-1].tolist()) == texts[i]
    monkeypatch.setattr(Tok, "encode_batch", lambda *a, **k: pytest.fail("cache miss: re-encoded"))
    again = tokenize_corpus(SAMPLE, tok, cache_dir, split="all")
    assert np.array_equal(again.tokens, corpus.tokens) and np.array_equal(again.offsets, corpus.offsets)


def test_hash_split_is_a_partition():
    train, val = load_texts(SAMPLE, "train"), load_texts(SAMPLE, "val")
    assert len(val) > 0 and not set(train) & set(val)
    assert sorted(train + val) == sorted(load_texts(SAMPLE, "all"))


def test_pre_split(corpus):
    row = SEQ + 1
    doc, start, length = split_pieces(corpus.lengths, row)
    assert length.min() >= 1 and length.max() <= row
    for d in np.flatnonzero(corpus.lengths > row)[:50]:
        mine = doc == d
        assert np.array_equal(start[mine], np.arange(mine.sum()) * row)  # cut at multiples of row
        assert length[mine].sum() == corpus.lengths[d] and (length[mine][:-1] == row).all()
    assert np.array_equal(np.bincount(doc, length, len(corpus)), corpus.lengths)
    assert (np.bincount(doc) == 1)[corpus.lengths <= row].all()  # short documents are never cut


def test_padding_training_stream(corpus):
    """The training stream of the shipped sample: no padding at all over several epochs (rows leave
    only when full; open rows carry on), and the carried rows stay a handful."""
    ds = PackedDataset(corpus, SEQ, seed=3)
    for epoch in range(4):
        stats = ds.stats(epoch)
        assert stats.padding_fraction <= 1e-4, stats
        assert stats.carried_tokens < 0.01 * corpus.num_tokens, stats
        assert stats.cuts < 0.05 * len(ds.piece_len), stats
    tokens, doc_ids = epoch_rows(ds, ds.plan(0))
    assert ((doc_ids == 0).sum()) == ds.stats(0).padding


def test_padding_flushed_epoch(corpus):
    """Every token of an epoch emitted, the last open rows padded: the packing uses the minimal
    number of rows, ceil(tokens / row_len), up to one. The sample alone is ~1,230 rows, so one
    row of slack would be 8e-4; tiled 16 times the bound 1e-4 holds with room for that row."""
    row = SEQ + 1
    for k in (1, 16):
        big = tiled(corpus, k)
        stats = PackedDataset(big, SEQ).plan(0, flush=True).stats
        assert stats.tokens == big.num_tokens
        lower_bound = -(-big.num_tokens // row) * row - big.num_tokens
        assert stats.padding < lower_bound + row, (k, stats, lower_bound)
    assert stats.padding_fraction <= 1e-4, stats


def test_nothing_lost_or_duplicated(corpus):
    ds = PackedDataset(corpus, SEQ, seed=1)
    flushed = ds.plan(0, flush=True)
    assert (coverage(corpus, flushed) == 1).all()  # every token position exactly once
    tokens, doc_ids = epoch_rows(ds, flushed)
    packed = np.bincount(tokens[doc_ids > 0], minlength=1 << 16)
    assert np.array_equal(packed, np.bincount(np.asarray(corpus.tokens), minlength=1 << 16))
    # the endless stream: carried rows complete the multiset of each epoch
    e0, e1 = ds.plan(0), ds.plan(1)
    carry = np.zeros(corpus.num_tokens, np.int64)
    for row in e0.carry:
        for d, s, n in row:
            carry[corpus.offsets[d] + s:corpus.offsets[d] + s + n] += 1
    assert (coverage(corpus, e0) + carry == 1).all()
    assert coverage(corpus, e1).sum() + sum(n for r in e1.carry for *_, n in r) \
        == corpus.num_tokens + carry.sum()


def test_row_structure_and_loss_mask(corpus):
    ds = PackedDataset(corpus, SEQ, seed=2)
    plan = ds.plan(0, flush=True)
    tokens, doc_ids = epoch_rows(ds, plan)
    for r in range(len(plan)):
        ids = doc_ids[r]
        n = int((ids > 0).sum())
        assert (ids[n:] == 0).all() and (tokens[r, n:] == PAD_ID).all()  # padding only at the end
        runs = ids[:n][np.r_[True, ids[1:n] != ids[:n - 1]]]
        assert np.array_equal(runs, np.arange(1, len(runs) + 1))  # each piece one contiguous run
        for k, p in enumerate(range(plan.offsets[r], plan.offsets[r + 1]), 1):
            start = corpus.offsets[plan.doc[p]] + plan.start[p]
            assert np.array_equal(tokens[r][ids == k], corpus.tokens[start:start + plan.length[p]])
    batch = collate([ds.row_arrays(plan, r) for r in range(len(plan))])  # the same rows, as a batch
    x, y, d, m = batch["tokens"], batch["targets"], batch["doc_ids"], batch["loss_mask"]
    assert x.dtype == torch.long and y.dtype == torch.long and d.dtype == torch.int32 and m.dtype == torch.bool
    assert x.shape == (len(plan), SEQ)
    assert not m[d == 0].any()  # no loss on padding
    assert not (m & (x == EOS_ID)).any()  # EOS never predicts the next document's BOS
    assert not (m & (y == BOS_ID)).any()
    assert (m & (y == EOS_ID)).sum() > 1000  # a document's last token does predict its EOS
    full_ids = torch.from_numpy(doc_ids)
    expected = (full_ids[:, :-1] == full_ids[:, 1:]) & (full_ids[:, :-1] > 0)
    assert torch.equal(m, expected)


def test_resume_is_exact(corpus):
    """23 batches, save, reload into a fresh dataset, 17 more == 40 uninterrupted (crosses an epoch)."""
    def stream(ds, n):
        it = ds.batches(64)
        return [next(it) for _ in range(n)]

    whole = stream(PackedDataset(corpus, SEQ, seed=7), 40)
    first = PackedDataset(corpus, SEQ, seed=7)
    head = stream(first, 23)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    assert state["epoch"] == 1  # the cut lies in the second epoch, with carried rows
    second = PackedDataset(corpus, SEQ, seed=7)
    second.load_state_dict(state)
    tail = stream(second, 17)
    for a, b in zip(whole, head + tail):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    with pytest.raises(ValueError):
        PackedDataset(corpus, SEQ, seed=8).load_state_dict(state)


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_batches_serve_every_planned_row_once_in_plan_order(corpus, batch):
    """`batches(b)`: the rows of epoch 0's plan, then epoch 1's, each exactly once and in plan order, whatever the
    batch size (a batch may straddle the epochs' boundary)."""
    ds = PackedDataset(corpus, SEQ, seed=3)
    want = [ds.row_arrays(ds.plan(e), r)[0] for e in (0, 1) for r in range(len(ds.plan(e)))]
    it, got = ds.batches(batch), []
    while len(got) < len(want):
        got += list(next(it)["tokens"].numpy())
    for k, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a[:-1], b), k  # a batch's tokens are the row without its last (the target's)


def test_seed_order_and_ranks(corpus):
    a = next(PackedDataset(corpus, SEQ, seed=0).batches(8))
    b = next(PackedDataset(corpus, SEQ, seed=0).batches(8))
    c = next(PackedDataset(corpus, SEQ, seed=1).batches(8))
    assert torch.equal(a["tokens"], b["tokens"]) and not torch.equal(a["tokens"], c["tokens"])
    both = next(PackedDataset(corpus, SEQ, seed=0).batches(8))
    r0 = next(PackedDataset(corpus, SEQ, seed=0, rank=0, world_size=2).batches(4))
    r1 = next(PackedDataset(corpus, SEQ, seed=0, rank=1, world_size=2).batches(4))
    assert torch.equal(both["tokens"][0::2], r0["tokens"]) and torch.equal(both["tokens"][1::2], r1["tokens"])


def test_val_batches(tok, cache_dir):
    val = tokenize_corpus(SAMPLE, tok, cache_dir, split="val")
    batches = list(val_batches(val, 128, batch_size=5))
    again = list(val_batches(val, 128, batch_size=5))
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(batches, again))
    plan = PackedDataset(val, 128, shuffle=False).plan(0, flush=True)
    assert (coverage(val, plan) == 1).all()  # one pass over every validation token
    assert len(batches) == -(-len(plan) // 5) and sum(len(b["tokens"]) for b in batches) == len(plan)


def test_best_fit_prefers_tightest_row():
    cuttable = np.zeros(4, bool)
    pieces = [(0, 0, 6), (1, 0, 3), (2, 0, 4), (3, 0, 4)]  # rows of 10: 6 then 4 -> full; 4 + 3 open
    plan = best_fit_pack(pieces, 10, cuttable, 1 << 20, 100, None, flush=True)
    rows = [sorted(int(d) for d in plan.doc[plan.offsets[r]:plan.offsets[r + 1]]) for r in range(len(plan))]
    assert rows == [[0, 2], [1, 3]] and plan.stats.padding == 3
