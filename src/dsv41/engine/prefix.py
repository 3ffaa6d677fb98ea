"""Prefix cache policy: what the engine persists, what it looks up, and how a hit resumes (SPEC §6).

Two tiers (storage in `engine/prefix_store/`):
  * **Persistent units** hold only global KV: the packed FP4 entries and index keys of every
    kv-source layer for the tokens (start, end] of a unit — a *delta* over its parent unit, so a
    long conversation stores each token's 890 bytes once. Units are cut where later prompts
    really repeat (`cut_points`): at chat-template boundaries (message ends, role markers — so a
    shared system prompt and a conversation's history, up to just before the reasoning-effort
    line, are unit ends), at prompt and output ends, and every `stride` tokens; aligned down to the
    lcm of the compression ratios (a unit holds only complete entries). A unit's key hashes its
    whole token prefix under a salt naming the weights, tokenizer and config (`identity`), and the
    request's namespace (cache salt / API key), so neither another checkpoint nor another tenant
    can hit it — nor learn from `cached_tokens` that it exists. Its meta and index row name its parent.
  * **SWA snapshots** (short-lived pool) hold the window rings of every layer, the compressors'
    partial groups and the few entries past the aligned unit boundary, captured at prompt end and
    output end.

Lookup never scans the index: each unit is filed under the key of its last stride mark (its
*anchor*); a lookup asks which lengths hang under the prompt's own stride marks, then probes
those (O(prefix / stride) indexed probes, whatever the number of stored units). Hot units live in
a bounded in-memory tier shared by every sequence (a hot system prompt is read from disk once, not
per request). Writes can go through a `BackgroundWriter`: the engine thread only copies rows, the
fsync / Redis work happens on the writer thread.

Resume for a request whose prompt extends a stored prefix of length b (> n_win):
  * snapshot hit at q ∈ [b, b + lcm) → exact resume at q: entries, windows and partial groups are
    restored and only the suffix is prefilled (decoder windows continue);
  * no snapshot → Encoder SWA Bounded Replay: the last n_win cached tokens run through the encoder
    again to rebuild its windows (replayed tokens = n_win), then the suffix is prefilled.
Cached global KV is read as stored rows and appended as is: never recomputed, never rewritten.

Namespaces reach the cache as `resume(..., namespace=)` / `save(..., namespace=)` (the engine passes
each request's own); a `save` without one uses the namespace its sequence was resumed under.

Images: every position of an image span holds the same placeholder id, so token ids alone cannot key
a prompt with images. `image_namespace` folds the images' content hashes (in order) into the
request's namespace: the same images with the same tokens share units, other images never hit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.engine.cache import SequenceCache
from dsv41.engine.prefix_store import (
    BackgroundWriter,
    PersistentStore,
    SWAPool,
    anchor_keys,
    anchor_position,
    chain_hashes,
    compression_lcm,
    cut_points,
    model_salt,
    namespace_salt,
)

log = logging.getLogger(__name__)
FORMAT_VERSION = "dsv41-kv-1"  # packed FP4 entries (E4M3/16) + FP4 index keys (E8M0/32); FP8 windows (E8M0/32)
DEFAULT_STRIDE = 256  # tokens between forced cuts (long inputs without chat boundaries)
DEFAULT_MEMORY_BYTES = 256 << 20  # hot units kept decoded in memory


@dataclass
class Resume:
    """How a new sequence starts from the prefix cache."""

    cached_tokens: int  # tokens whose state comes from the cache
    encoder_replay: int  # tokens to replay through the encoder (0 on an exact resume)
    exact: bool  # windows restored from the pool


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    exact_resumes: int = 0
    cached_tokens: int = 0
    replayed_tokens: int = 0
    units_written: int = 0
    unit_bytes_written: int = 0
    unit_tokens_written: int = 0
    snapshots_written: int = 0
    broken_chains: int = 0
    extra: dict = field(default_factory=dict)



def image_namespace(namespace: bytes | str | None, hashes: Sequence[str]) -> bytes | str | None:
    """The namespace of a request with images: its own namespace plus the images' content hashes, in
    prompt order (no images: the namespace unchanged)."""
    if not hashes:
        return namespace
    ns = b"" if not namespace else namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return len(ns).to_bytes(4, "little") + ns + b"\x00images\x00" + "\x00".join(hashes).encode()

class UnitMemory:
    """Bounded LRU of decoded units (key hex → (tensors, meta)), shared by every sequence of the engine."""

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._units: OrderedDict[str, tuple[dict[str, Tensor], dict, int]] = OrderedDict()
        self._by_anchor: dict[str, dict[int, int]] = {}  # anchor → {n_tokens: how many units}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> tuple[dict[str, Tensor], dict] | None:
        with self._lock:
            got = self._units.get(key)
            if got is None:
                return None
            self._units.move_to_end(key)
            self.hits += 1
            return got[0], got[1]

    def put(self, key: str, tensors: dict[str, Tensor], meta: dict) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.capacity:
            return
        with self._lock:
            self._pop(key)
            while self._units and self._bytes + nbytes > self.capacity:
                self._pop(next(iter(self._units)))
            self._units[key] = (tensors, meta, nbytes)
            self._bytes += nbytes
            if meta.get("anchor"):
                lengths = self._by_anchor.setdefault(meta["anchor"], {})
                lengths[meta["n_tokens"]] = lengths.get(meta["n_tokens"], 0) + 1

    def discard(self, key: str) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key: str) -> None:
        old = self._units.pop(key, None)
        if old is None:
            return
        self._bytes -= old[2]
        anchor, n = old[1].get("anchor"), old[1].get("n_tokens")
        lengths = self._by_anchor.get(anchor)
        if lengths is not None and n in lengths:
            lengths[n] -= 1
            if not lengths[n]:
                del lengths[n]
            if not lengths:
                del self._by_anchor[anchor]

    def present(self, keys: Sequence[str]) -> set[str]:
        with self._lock:
            return {k for k in keys if k in self._units}

    def lengths_under(self, anchors: Sequence[str]) -> set[int]:
        with self._lock:
            return {n for a in anchors for n in self._by_anchor.get(a, ())}


class PrefixCache:
    def __init__(self, config: ModelConfig, store: PersistentStore | None, pool: SWAPool | None = None, *,
                 identity: str | bytes | None = None, stride: int = DEFAULT_STRIDE,
                 boundary_ids: Sequence[int] = (), writer: BackgroundWriter | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, interval: int | None = None):
        self.config = config
        self.store, self.pool = store, pool
        self.stride = int(interval if interval is not None else stride)
        self.boundary_ids = tuple(int(t) for t in boundary_ids)
        self.writer = writer
        if identity is None:
            log.warning("prefix cache keyed by the model config only: pass identity= (dsv41.fingerprint."
                        "model_identity) so that other weights of the same config never hit")
        ident = identity.hex() if isinstance(identity, bytes) else (identity or "")
        self.salt = model_salt({"config": config.to_dict(), "identity": ident}, FORMAT_VERSION)
        self.swa_salt = model_salt({"config": config.to_dict(), "identity": ident}, FORMAT_VERSION + "-swa")
        self.lcm = compression_lcm(config.compress_ratios[:config.n_layers])
        self.memory = UnitMemory(memory_bytes)
        self.stats = PrefixStats()
        self._stats_lock = threading.Lock()
        self._namespace_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq → namespace

    @classmethod
    def for_model(cls, model, tok, store: PersistentStore | None, pool: SWAPool | None = None, **kwargs):
        """A cache keyed by this model's weights, tokenizer and config, cut at its chat template's boundaries."""
        from dsv41.fingerprint import model_identity
        from dsv41.train.tokenizer import chat_boundary_ids

        kwargs.setdefault("boundary_ids", chat_boundary_ids(tok) if tok is not None else ())
        return cls(model.config, store, pool, identity=model_identity(model, tok), **kwargs)

    # ------------------------------------------------------------------ namespaces
    def _salts(self, namespace) -> tuple[bytes, bytes]:
        return namespace_salt(self.salt, namespace), namespace_salt(self.swa_salt, namespace)

    def _count(self, **delta: int) -> None:
        with self._stats_lock:
            for k, v in delta.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # ------------------------------------------------------------------ lookup and resume
    def resume(self, seq: SequenceCache, prompt: list[int], namespace: bytes | str | None = None) -> Resume | None:
        """Fill an empty `seq` from the cache for the longest usable prefix of prompt[:-1]."""
        self._namespace_of[seq] = namespace
        if self.store is None:
            return None
        salt, swa_salt = self._salts(namespace)
        self._count(lookups=1)
        found = self._longest(prompt[:-1], salt)
        if found is None:
            self._count(misses=1)
            return None
        b, key, chain, keys = found
        snapshot, q = self._snapshot(prompt, b, swa_salt)
        for store_layer, entry_store in seq.entry_stores.items():
            for unit in chain:  # root first: rows are appended in token order, exactly as stored
                entry_store.kv.append(unit[f"{store_layer}.kv"])
                entry_store.index_k.append(unit[f"{store_layer}.index_k"])
        seq.tokens.extend(prompt[:b])
        self._touch(keys)
        seq.persisted = (b, key)
        if snapshot is not None:
            tensors, _ = snapshot
            for layer_id, store in seq.entry_stores.items():
                store.kv.append(tensors[f"{layer_id}.tail_kv"])
                store.index_k.append(tensors[f"{layer_id}.tail_index_k"])
                if f"{layer_id}.pending_kv" in tensors:
                    seq.pending[layer_id] = (tensors[f"{layer_id}.pending_kv"].to(seq.device),
                                             tensors[f"{layer_id}.pending_score"].to(seq.device))
            for i, ring in enumerate(seq.windows):
                ring.load_state({k: tensors[f"window.{i}.{k}"] for k in ("values", "scales", "positions")})
            seq.tokens.extend(prompt[b:q])
            self._count(hits=1, exact_resumes=1, cached_tokens=q)
            return Resume(q, 0, True)
        replay = self.config.window_size
        self._count(hits=1, cached_tokens=b, replayed_tokens=replay)
        return Resume(b, replay, False)

    def _longest(self, tokens: list[int], salt: bytes):
        """(n_tokens, key, chain root first, chain keys) of the longest usable stored prefix, or None."""
        marks = list(range(0, len(tokens), self.stride))  # anchors a unit of length <= len(tokens) can hang under
        if not marks or len(tokens) <= self.config.window_size:
            return None
        anchors = [k.hex() for k in anchor_keys(tokens, marks, salt)]
        lengths = self.memory.lengths_under(anchors) | self.store.lengths_under(anchors)
        candidates = sorted(n for n in lengths if self.config.window_size < n <= len(tokens))
        if not candidates:
            return None
        keys = chain_hashes(tokens, candidates, salt)
        hexes = [k.hex() for k in keys]
        present = self.memory.present(hexes) | self.store.present(hexes)
        for n, key, hx in sorted(zip(candidates, keys, hexes), reverse=True):
            if hx not in present:
                continue
            chain = self._chain(hx)
            if chain is not None:
                return n, key, [tensors for _, tensors in chain], [k for k, _ in chain]
        return None

    def _get(self, key: str) -> tuple[dict[str, Tensor], dict] | None:
        got = self.memory.get(key)
        if got is None:
            got = self.store.get(key)
            if got is not None:
                self.memory.put(key, *got)
        return got

    def _chain(self, key: str) -> list[tuple[str, dict[str, Tensor]]] | None:
        """(key, tensors) of the unit and its ancestors, root first; None when one is gone (the store never keeps
        such a unit, but another process may remove a parent between our probe and our read)."""
        units = []
        while key is not None:
            got = self._get(key)
            if got is None:
                if units:
                    self._count(broken_chains=1)
                    log.warning("prefix unit lost its parent %s; treating as a miss", key[:12])
                return None
            units.append((key, got[0]))
            key = got[1].get("parent")
        return units[::-1]

    def _touch(self, keys: list[str]) -> None:
        """Units served from memory still count as used in the store (LRU / TTL of the whole chain)."""
        if self.writer is not None:
            self.writer.submit(lambda: self.store.touch(keys))
        else:
            self.store.touch(keys)

    def _snapshot(self, prompt: list[int], b: int, swa_salt: bytes):
        if self.pool is None:
            return None, b
        last = min(b + self.lcm, len(prompt))  # q ≤ len(prompt) − 1: at least one token is left to run
        positions = list(range(b, last))
        for q, key in sorted(zip(positions, chain_hashes(prompt, positions, swa_salt)), reverse=True):
            got = self.pool.get(key)
            if got is not None and got[1].get("n_tokens") == q:
                return got, q
        return None, b

    # ------------------------------------------------------------------ saving
    def save(self, seq: SequenceCache, ends: list[int], snapshot: bool = True,
             namespace: bytes | str | None = None) -> None:
        """Persist the units of seq up to the given end positions, and a window snapshot at its end."""
        if namespace is None:
            namespace = self._namespace_of.get(seq)
        salt, swa_salt = self._salts(namespace)
        if self.store is not None:
            self._save_units(seq, ends, salt)
        if snapshot and self.pool is not None:
            self._save_snapshot(seq, swa_salt)

    def _run(self, job, nbytes: int) -> bool:
        """Run a write now, or hand it to the background writer (False: dropped or failed)."""
        if self.writer is None:
            return bool(job())
        return self.writer.submit(job, nbytes)

    def _save_units(self, seq: SequenceCache, ends: list[int], salt: bytes) -> None:
        done, parent = seq.persisted
        cuts = cut_points(seq.tokens, lo=done, stride=self.stride, ratio_lcm=self.lcm,
                          boundary_ids=self.boundary_ids, ends=ends)
        if not cuts:
            return
        keys = chain_hashes(seq.tokens, cuts, salt)
        marks = sorted({anchor_position(b, self.stride) for b in cuts})
        anchor_of = dict(zip(marks, (k.hex() for k in anchor_keys(seq.tokens, marks, salt))))
        for b, key in zip(cuts, keys):
            tensors = {}
            for layer_id, store in seq.entry_stores.items():
                lo, hi = done // store.ratio, b // store.ratio
                tensors[f"{layer_id}.kv"] = store.kv.read(lo, hi).contiguous()  # a copy: the job may run later
                tensors[f"{layer_id}.index_k"] = store.index_k.read(lo, hi).contiguous()
            meta = {"start": done, "end": b, "n_tokens": b, "parent": None if parent is None else parent.hex(),
                    "anchor": anchor_of[anchor_position(b, self.stride)], "format": FORMAT_VERSION}
            nbytes = sum(t.numel() for t in tensors.values())
            hx = key.hex()

            def write(hx=hx, tensors=tensors, meta=meta, b=b, tokens=b - done, nbytes=nbytes) -> bool:
                ok = self.store.put(hx, tensors, meta, n_tokens=b)
                if ok:
                    self._count(units_written=1, unit_tokens_written=tokens, unit_bytes_written=nbytes)
                else:
                    self.memory.discard(hx)
                return ok

            self.memory.put(hx, tensors, meta)
            if not self._run(write, nbytes):  # could not persist: later units must not point at a missing parent
                self.memory.discard(hx)
                return
            done, parent = b, key
            seq.persisted = (done, parent)

    def _save_snapshot(self, seq: SequenceCache, swa_salt: bytes) -> None:
        q = seq.n_tokens
        b = q - q % self.lcm
        tensors: dict[str, Tensor] = {}
        for layer_id, store in seq.entry_stores.items():
            lo, hi = b // store.ratio, q // store.ratio
            tensors[f"{layer_id}.tail_kv"] = store.kv.read(lo, hi).contiguous()
            tensors[f"{layer_id}.tail_index_k"] = store.index_k.read(lo, hi).contiguous()
            if layer_id in seq.pending:
                kv, score = seq.pending[layer_id]
                tensors[f"{layer_id}.pending_kv"] = kv.detach().cpu().clone()
                tensors[f"{layer_id}.pending_score"] = score.detach().cpu().clone()
        for i, ring in enumerate(seq.windows):
            for k, v in ring.state().items():
                tensors[f"window.{i}.{k}"] = v.detach().cpu().clone()  # the ring goes on changing
        tensors = {k: v.cpu() for k, v in tensors.items()}
        key = chain_hashes(seq.tokens, [q], swa_salt)[0]

        def write() -> bool:
            ok = self.pool.put(key, tensors, {"n_tokens": q})
            if ok:
                self._count(snapshots_written=1)
            return ok

        self._run(write, sum(t.numel() * t.element_size() for t in tensors.values()))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the background writer (if any) to finish what is queued."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def metrics(self) -> dict:
        with self._stats_lock:
            out = {k: v for k, v in vars(self.stats).items() if k != "extra"}
        out["memory_hits"] = self.memory.hits
        if self.writer is not None:
            out["writer"] = dict(self.writer.counters)
        if self.store is not None:
            out["store"] = self.store.stats()
            tokens = out["unit_tokens_written"]
            out["bytes_per_cached_token"] = out["unit_bytes_written"] / tokens if tokens else None
        if self.pool is not None:
            out["pool"] = self.pool.stats()
            lookups = out["pool"].get("hits", 0) + out["pool"].get("misses", 0)
            out["pool_hit_rate"] = out["pool"].get("hits", 0) / lookups if lookups else None
        return out
