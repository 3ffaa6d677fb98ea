"""Corpus loading, a token cache on disk, and best-fit packing into fixed-length rows (SPEC §7).

A document is encoded once as `BOS + text + EOS` and kept in a memory-mapped token array with
document offsets (`TokenizedCorpus`, cached by tokenizer and input hash). Training rows hold
`row_len = seq_len + 1` tokens: inputs `row[:-1]`, targets `row[1:]`.

Packing, one epoch at a time, depends only on (document lengths, seed, epoch, carried rows):
1. Pre-split: a document longer than `row_len` is cut into pieces of exactly `row_len` tokens from
   its start, plus one shorter remainder. Full pieces are rows by themselves (no padding).
2. Documents are shuffled (seeded per epoch) and streamed in buffers of `buffer_tokens` tokens.
   Within a buffer, pieces are placed largest first into the open row with the least remaining
   space that fits (best-fit decreasing); a new row is opened when none fits.
3. Gap closing. With a few pieces per row (short rows), best fit leaves ~1% of rows with gaps of a
   few tokens that no remaining piece fits: the item sizes, not the algorithm, set that floor
   (~2e-4 of tokens at row 513 on the 83 MB corpus, 6% at row 4097). So after each buffer the
   pieces of long documents (those step 1 already cut) are lifted out of the open rows and
   refill them, fullest row first: the largest piece that fits, else the head of the largest
   piece (a cut); when they run out, a completed row made only of long-document pieces is
   dissolved into the pool. The rest of the pool fills new rows the same way. The result is
   optimal (ceil(tokens / row_len) rows on the sample and on the 83 MB corpus at rows of 513,
   2049, 4097); a short document is never truncated; each cut costs one extra piece boundary
   (at row 513: 1.1% more pieces, 3e-5 of the prediction targets).
4. A row leaves the packer only when it is exactly full. Open rows carry into the next buffer and,
   at the end of an epoch, into the next epoch (they are part of `PackedDataset.state_dict()`), so
   no token is dropped. Only if more than `max_open_rows` rows are open are the fullest closed with
   padding: the only place padding enters the training stream. Validation (`val_batches`) pads its
   last open rows instead of carrying them.
5. The rows a buffer completes are shuffled among themselves, so a batch mixes long and short pieces.

Each row carries per-token document ids (int32, 1.. within the row, 0 = padding) and a loss mask:
position t is trained iff token t and its target t+1 belong to the same piece. So a document's last
text token predicts its EOS, but its EOS never predicts the next document's BOS, and padding and the
token that ends a piece cut at the row end are never targets across a boundary. The model's
attention must not cross document ids (sample-level masks, SPEC §7).

The cursor of the stream is (epoch, row, rows carried into that epoch): loading a
`PackedDataset.state_dict()` rebuilds the epoch's plan and continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.train.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tok

CACHE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# reading documents


def _doc_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return sorted(p for p in source.iterdir() if p.suffix in (".jsonl", ".txt"))


def read_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Documents of .jsonl files ({"text": ...} per line) and .txt files (one document each)."""
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)["text"]
        else:
            yield path.read_text(encoding="utf-8")


def is_val(text: str, val_permille: int) -> bool:
    """Hash split: independent of document order and of the other documents."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 1000 < val_permille


def split_files(source: str | Path, split: str) -> tuple[list[Path], bool]:
    """Files of one split. A folder with train.jsonl / val.jsonl (scripts/build_corpus.py) is split
    already; any other folder (the shipped data/sample) is split by `is_val` (the bool says so)."""
    source = Path(source)
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be train, val or all, got {split!r}")
    if source.is_dir() and (source / "train.jsonl").exists():
        names = {"train": ["train.jsonl"], "val": ["val.jsonl"], "all": ["train.jsonl", "val.jsonl"]}
        return [source / n for n in names[split]], False
    return _doc_files(source), split != "all"


def load_texts(source: str | Path, split: str = "all", val_permille: int = 10) -> list[str]:
    files, by_hash = split_files(source, split)
    texts = list(read_texts(files))
    if by_hash:
        texts = [t for t in texts if is_val(t, val_permille) == (split == "val")]
    return texts


# ---------------------------------------------------------------------------------------------
# token cache


class TokenizedCorpus:
    """All documents of a split as one token array (each `BOS + text + EOS`) plus offsets."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens = tokens  # (N,) uint16 or uint32, usually memory-mapped
        self.offsets = offsets  # (n_docs + 1,) int64
        self.lengths = np.diff(offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def from_texts(cls, texts: list[str], tok: Tok, chunk: int = 1024) -> TokenizedCorpus:
        dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
        parts, lengths = [], []
        for i in range(0, len(texts), chunk):
            for ids in tok.encode_batch(texts[i:i + chunk], add_bos=True, add_eos=True):
                parts.append(np.asarray(ids, dtype=dtype))
                lengths.append(len(ids))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(tokens, offsets)

    def save(self, folder: Path, meta: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "tokens.npy", self.tokens)
        np.save(folder / "offsets.npy", self.offsets)
        (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path, mmap: bool = True) -> TokenizedCorpus:
        mode = "r" if mmap else None
        return cls(np.load(folder / "tokens.npy", mmap_mode=mode), np.load(folder / "offsets.npy"))


def load_corpus(source: str | Path, tok: Tok, cache_dir: str | Path, split: str = "train") -> TokenizedCorpus:
    """A split of `source`: a pre-tokenized folder (`source/<split>/meta.json`, as written by
    `TokenizedCorpus.save`, e.g. to carry a corpus to a machine without it) or text to tokenize."""
    folder = Path(source) / split
    if (folder / "meta.json").exists():
        return TokenizedCorpus.load(folder)
    return tokenize_corpus(source, tok, cache_dir, split)


def tokenize_corpus(source: str | Path, tok: Tok, cache_dir: str | Path, split: str = "all",
                    val_permille: int = 10) -> TokenizedCorpus:
    """The cached token form of `source`'s split, encoding it only when the cache misses.

    The cache key hashes the tokenizer (its JSON) and the bytes of every input file, so editing
    either re-encodes; the entry is written to a temporary folder and renamed into place.
    """
    files, by_hash = split_files(source, split)
    h = hashlib.sha256(f"v{CACHE_VERSION}|{split}|{val_permille if by_hash else ''}".encode())
    h.update(hashlib.sha256(tok.tokenizer.to_str().encode()).digest())
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    key = h.hexdigest()[:20]
    folder = Path(cache_dir) / f"{split}-{key}"
    if (folder / "meta.json").exists():
        return TokenizedCorpus.load(folder)
    corpus = TokenizedCorpus.from_texts(load_texts(source, split, val_permille), tok)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    corpus.save(tmp, {"files": [str(f) for f in files], "split": split, "docs": len(corpus),
                      "tokens": corpus.num_tokens, "dtype": str(corpus.tokens.dtype), "key": key})
    try:
        os.replace(tmp, folder)
    except OSError:  # another process wrote the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenizedCorpus.load(folder)


# ---------------------------------------------------------------------------------------------
# pre-splitting and best-fit packing (pure numpy / python on lengths; no tokens touched)


def split_pieces(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, start, length) of every piece: each document cut at multiples of row_len."""
    lengths = np.asarray(lengths, np.int64)
    n_pieces = -(-lengths // row_len)  # ceil
    doc = np.repeat(np.arange(len(lengths)), n_pieces)
    first = np.cumsum(n_pieces) - n_pieces
    k = np.arange(len(doc)) - np.repeat(first, n_pieces)  # index of the piece within its document
    start = k * row_len
    return doc, start, np.minimum(row_len, lengths[doc] - start)


Piece = tuple[int, int, int]  # (document, start token, length)


@dataclass
class PackStats:
    rows: int = 0  # rows emitted
    tokens: int = 0  # non-padding tokens in emitted rows
    padding: int = 0  # padding tokens in emitted rows
    cuts: int = 0  # extra cuts made to close gaps (each splits one long-document piece in two)
    carried_rows: int = 0  # rows still open at the end of the epoch (carried into the next one)
    carried_tokens: int = 0  # tokens in those rows

    @property
    def padding_fraction(self) -> float:
        return self.padding / max(1, self.padding + self.tokens)


@dataclass
class Plan:
    """One epoch's rows: row r holds pieces offsets[r]:offsets[r+1] of (doc, start, length), in order.
    `carry` are the rows left open at the end (partly filled), handed to the next epoch."""

    offsets: np.ndarray  # (rows + 1,) int64
    doc: np.ndarray  # (placed pieces,) int64
    start: np.ndarray  # (placed pieces,) int64, token offset inside the document
    length: np.ndarray  # (placed pieces,) int64
    carry: list[list[Piece]]
    stats: PackStats

    def __len__(self) -> int:
        return len(self.offsets) - 1


class BestFitPacker:
    """Open rows indexed by remaining space; `place` is best fit (the tightest row that fits), and
    `close_gaps` fills the small gaps best fit leaves with pieces cut from long documents."""

    def __init__(self, row_len: int, cuttable: np.ndarray, carry: Iterable[Iterable[Piece]] = ()):
        self.row_len = row_len
        self.cuttable = cuttable  # (n_docs,) bool: the document is longer than a row (already cut)
        self.rows: list[list[Piece]] = []  # pieces of every row opened
        self.free: list[int] = []  # remaining space per row
        self.by_free: dict[int, list[int]] = {}  # remaining space -> open rows with exactly that much
        self.sizes: list[int] = []  # sorted keys of by_free
        self.cuts = 0
        for pieces in carry:
            self.rows.append([tuple(map(int, p)) for p in pieces])
            self.free.append(row_len - sum(p[2] for p in self.rows[-1]))
            self._put(len(self.rows) - 1)

    def _put(self, row: int) -> None:
        if self.free[row] not in self.by_free:
            self.by_free[self.free[row]] = []
            insort(self.sizes, self.free[row])
        self.by_free[self.free[row]].append(row)

    def _take(self, row: int) -> None:
        bucket = self.by_free[self.free[row]]
        bucket.remove(row)
        if not bucket:
            del self.by_free[self.free[row]]
            self.sizes.pop(bisect_left(self.sizes, self.free[row]))

    def open_rows(self) -> list[int]:
        return sorted(r for v in self.by_free.values() for r in v)

    def place(self, piece: Piece) -> int | None:
        """Put a piece into the tightest open row (a new one if none fits); the row if now full."""
        size = piece[2]
        j = bisect_left(self.sizes, size)
        if j < len(self.sizes):
            row = self.by_free[self.sizes[j]][-1]  # newest row of that size: deterministic
            self._take(row)
        else:
            row = len(self.rows)
            self.rows.append([])
            self.free.append(self.row_len)
        self.rows[row].append(piece)
        self.free[row] -= size
        if self.free[row] == 0:
            return row
        self._put(row)
        return None

    def close_gaps(self, spare: list[int]) -> tuple[list[int], set[int]]:
        """Complete the open rows with long-document material; returns (rows completed, spare rows
        used up). The pieces of documents longer than a row are lifted out of the open rows into a
        pool; then each open row, fullest first, takes the largest pool piece that fits, or the
        head of the largest piece when none fits (a cut). When the pool runs dry, the next `spare`
        row (a completed row of long-document pieces only) is dissolved into it. What is left of
        the pool fills new rows the same way, so at most one row stays partly filled. A short
        document is never cut; each cut adds one piece boundary."""
        opened = self.open_rows()
        pool: list[tuple[int, int, int]] = []  # (length, doc, start), sorted
        for r in opened:
            self._take(r)
            for p in self.rows[r]:
                if self.cuttable[p[0]]:
                    insort(pool, (p[2], p[0], p[1]))
            self.rows[r] = [p for p in self.rows[r] if not self.cuttable[p[0]]]
            self.free[r] = self.row_len - sum(p[2] for p in self.rows[r])  # emptied rows vanish
        targets = sorted((r for r in opened if self.rows[r]), key=lambda r: (self.free[r], r))
        spare, done, used = list(spare), [], set()
        for t in targets:
            while self.free[t] > 0 and (pool or spare):
                if not pool:
                    s = spare.pop()
                    used.add(s)
                    for p in self.rows[s]:
                        insort(pool, (p[2], p[0], p[1]))
                    self.rows[s] = []
                self._fill_one(t, pool)
            if self.free[t] == 0:
                done.append(t)
            else:
                self._put(t)
        while pool:  # the rest of the pool: new rows, filled exactly except the last
            t = len(self.rows)
            self.rows.append([])
            self.free.append(self.row_len)
            while self.free[t] > 0 and pool:
                self._fill_one(t, pool)
            if self.free[t] == 0:
                done.append(t)
            else:
                self._put(t)
        return done, used

    def _fill_one(self, row: int, pool: list[tuple[int, int, int]]) -> None:
        """Move the largest pool piece that fits into `row`, or cut the largest piece to fit."""
        gap = self.free[row]
        k = bisect_right(pool, (gap, 1 << 62)) - 1  # largest piece with length <= gap
        if k >= 0:
            length, doc, start = pool.pop(k)
            self.rows[row].append((doc, start, length))
            self.free[row] -= length
        else:  # every piece is longer: the head of the largest fills the gap, its tail stays
            length, doc, start = pool.pop()
            self.rows[row].append((doc, start, gap))
            self.free[row] = 0
            insort(pool, (length - gap, doc, start + gap))
            self.cuts += 1


def best_fit_pack(pieces: list[Piece], row_len: int, cuttable: np.ndarray, buffer_tokens: int,
                  max_open_rows: int, rng: np.random.Generator | None,
                  carry: Iterable[Iterable[Piece]] = (), flush: bool = False) -> Plan:
    """Best-fit decreasing over a stream of pieces, gap closing after each buffer (module
    docstring, steps 2-4). `carry` are open rows handed over from the previous epoch. With
    flush=True the rows still open at the end are emitted with padding instead of carried."""
    packer = BestFitPacker(row_len, cuttable, carry)
    emitted: list[int] = []
    stats = PackStats()
    i = 0
    while i < len(pieces):
        # one buffer: the next pieces of the stream until buffer_tokens are reached
        j, acc = i, 0
        while j < len(pieces) and acc < buffer_tokens:
            acc += pieces[j][2]
            j += 1
        buf = sorted(range(i, j), key=lambda k: (-pieces[k][2], k))  # largest first, then stream order
        done = [r for k in buf if (r := packer.place(pieces[k])) is not None]
        spare = [r for r in done if all(cuttable[p[0]] for p in packer.rows[r])]
        closed, used = packer.close_gaps(spare)
        done = [r for r in done if r not in used] + closed
        left = packer.open_rows()
        if len(left) > max_open_rows:  # close the fullest with padding
            left.sort(key=lambda r: (packer.free[r], r))
            for r in left[:len(left) - max_open_rows]:
                packer._take(r)
                done.append(r)
        if rng is not None:
            done = [done[k] for k in rng.permutation(len(done))]
        emitted += done
        i = j
    left = packer.open_rows()
    if flush:
        emitted += left
        left = []
    stats.rows = len(emitted)
    stats.padding = sum(packer.free[r] for r in emitted)
    stats.cuts = packer.cuts
    stats.carried_rows = len(left)
    stats.carried_tokens = sum(row_len - packer.free[r] for r in left)
    flat = [p for r in emitted for p in packer.rows[r]]
    arr = np.array(flat, np.int64).reshape(-1, 3)  # (placed pieces, 3)
    offsets = np.zeros(len(emitted) + 1, np.int64)
    np.cumsum([len(packer.rows[r]) for r in emitted], out=offsets[1:])
    stats.tokens = int(arr[:, 2].sum())
    return Plan(offsets, arr[:, 0], arr[:, 1], arr[:, 2], [packer.rows[r] for r in left], stats)


# ---------------------------------------------------------------------------------------------
# dataset


class PackedDataset:
    """Packed rows of a TokenizedCorpus, in a seeded order that resumes exactly.

    `batches(B)` yields dict(tokens, targets: LongTensor[B, T], doc_ids: IntTensor[B, T],
    loss_mask: BoolTensor[B, T]) with T = seq_len, endlessly over epochs. Rows still open at the end
    of an epoch carry into the next epoch's packing, so no token is dropped and none is padded
    except when more than `max_open_rows` rows are open (then the fullest are closed with padding).
    With world_size > 1 every rank walks the same plan; of each global batch of world_size*B rows,
    rank r takes rows r, r + world_size, r + 2*world_size, ...
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 buffer_tokens: int = 1 << 22, max_open_rows: int = 1024, rank: int = 0,
                 world_size: int = 1):
        if len(corpus) == 0:
            raise ValueError("empty corpus")
        self.corpus, self.seq_len, self.row_len = corpus, seq_len, seq_len + 1
        self.seed, self.shuffle = seed, shuffle
        self.buffer_tokens, self.max_open_rows = buffer_tokens, max_open_rows
        self.rank, self.world_size = rank, world_size
        self.piece_doc, self.piece_start, self.piece_len = split_pieces(corpus.lengths, self.row_len)
        self.doc_first_piece = np.searchsorted(self.piece_doc, np.arange(len(corpus)))
        self.cuttable = corpus.lengths > self.row_len
        self.epoch, self.row = 0, 0  # cursor: next row to emit
        self._carry_in: dict[int, list[list[Piece]]] = {0: []}  # open rows handed to an epoch
        self._plan: tuple[int, Plan] | None = None

    # -- plan

    def piece_order(self, epoch: int, rng: np.random.Generator | None) -> np.ndarray:
        """Piece ids in stream order: documents shuffled, each document's pieces in order."""
        n_docs = len(self.corpus)
        docs = rng.permutation(n_docs) if rng is not None else np.arange(n_docs)
        counts = np.diff(np.append(self.doc_first_piece, len(self.piece_doc)))[docs]
        starts_out = np.cumsum(counts) - counts
        return np.repeat(self.doc_first_piece[docs] - starts_out, counts) + np.arange(int(counts.sum()))

    def plan(self, epoch: int, flush: bool = False) -> Plan:
        if self._plan is not None and self._plan[0] == epoch and not flush:
            return self._plan[1]
        known = max(e for e in self._carry_in if e <= epoch)
        for e in range(known, epoch + 1):  # earlier epochs' carries, if not computed yet
            rng = np.random.default_rng([self.seed, e]) if self.shuffle else None
            order = self.piece_order(e, rng)
            pieces = list(zip(self.piece_doc[order].tolist(), self.piece_start[order].tolist(),
                              self.piece_len[order].tolist()))
            plan = best_fit_pack(pieces, self.row_len, self.cuttable, self.buffer_tokens,
                                 self.max_open_rows, rng, self._carry_in[e], flush and e == epoch)
            if not (flush and e == epoch):
                self._carry_in[e + 1] = plan.carry
        if len(plan) == 0:
            raise ValueError("the corpus fills no row in an epoch: lower seq_len")
        if not flush:
            self._plan = (epoch, plan)
        return plan

    def stats(self, epoch: int = 0) -> PackStats:
        return self.plan(epoch).stats

    # -- rows

    def row_arrays(self, plan: Plan, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, doc_ids) of one row, each (row_len,)."""
        tokens = np.full(self.row_len, PAD_ID, np.int64)
        doc_ids = np.zeros(self.row_len, np.int32)
        at = 0
        for k, p in enumerate(range(plan.offsets[row], plan.offsets[row + 1]), 1):
            start = int(self.corpus.offsets[plan.doc[p]] + plan.start[p])
            n = int(plan.length[p])
            tokens[at:at + n] = self.corpus.tokens[start:start + n]
            doc_ids[at:at + n] = k
            at += n
        return tokens, doc_ids

    def batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Endless batches from the current cursor; the cursor moves before each yield, so
        `state_dict()` taken after receiving batch n resumes at batch n + 1."""
        n = batch_size * self.world_size
        while True:
            rows = []
            while len(rows) < n:
                plan = self.plan(self.epoch)
                take = min(len(plan) - self.row, n - len(rows))
                rows += [self.row_arrays(plan, r) for r in range(self.row, self.row + take)]
                self.row += take
                if self.row == len(plan):
                    self.epoch, self.row = self.epoch + 1, 0
            yield collate(rows[self.rank::self.world_size])

    # -- resume

    _PLAN_KEYS = ("seed", "seq_len", "shuffle", "buffer_tokens", "max_open_rows", "num_docs", "num_tokens")

    def state_dict(self) -> dict:
        """JSON-able: the cursor, the rows carried into its epoch, and what the plan depends on."""
        self.plan(self.epoch)  # makes sure the carry into the current epoch is known
        return {"epoch": self.epoch, "row": self.row, "carry": self._carry_in[self.epoch],
                "seed": self.seed, "seq_len": self.seq_len, "shuffle": self.shuffle,
                "buffer_tokens": self.buffer_tokens, "max_open_rows": self.max_open_rows,
                "num_docs": len(self.corpus), "num_tokens": self.corpus.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in self._PLAN_KEYS:
            if state[k] != mine[k]:
                raise ValueError(f"state was saved for {k}={state[k]}, this dataset has {mine[k]}")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
        self._carry_in = {self.epoch: [[tuple(map(int, p)) for p in r] for r in state["carry"]]}
        self._plan = None


def collate(rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(np.stack([r[0] for r in rows]))  # (B, T + 1)
    doc_ids = torch.from_numpy(np.stack([r[1] for r in rows]))  # (B, T + 1)
    same_doc = (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] != 0)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "targets": tokens[:, 1:].contiguous(),
        "doc_ids": doc_ids[:, :-1].contiguous(),
        "loss_mask": same_doc,
    }


def val_batches(corpus: TokenizedCorpus, seq_len: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """One deterministic pass over a validation corpus: unshuffled, every token kept (the rows
    still open at the end are emitted with padding); the last batch may be smaller."""
    ds = PackedDataset(corpus, seq_len, shuffle=False)
    plan = ds.plan(0, flush=True)
    for i in range(0, len(plan), batch_size):
        yield collate([ds.row_arrays(plan, r) for r in range(i, min(i + batch_size, len(plan)))])


def stats_dict(stats: PackStats) -> dict:
    return {**asdict(stats), "padding_fraction": stats.padding_fraction}


__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "BestFitPacker", "Piece", "PackStats", "PackedDataset", "Plan", "TokenizedCorpus",
    "best_fit_pack", "collate", "is_val", "load_texts", "read_texts", "split_pieces", "stats_dict",
    "tokenize_corpus", "val_batches",
]
