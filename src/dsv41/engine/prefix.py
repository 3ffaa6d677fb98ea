"""Prefix cache policy: what the engine persists, what it looks up, and how a hit resumes (SPEC §6).

Two tiers (storage in `engine/prefix_store/`):
  * **Persistent units** hold only global KV: the packed FP4 entries and index keys of every
    kv-source layer for the tokens (start, end] of a unit — a *delta* over its parent unit, so a
    long conversation stores each token's 890 bytes once. Units are cut at prompt ends, output
    ends and every `interval` tokens of long inputs, aligned down to the lcm of the compression
    ratios (a unit holds only complete entries). A unit's key is the hash of its whole token
    prefix (plus a model/format salt); its meta names its parent.
  * **SWA snapshots** (short-lived pool) hold the window rings of every layer, the compressors'
    partial groups and the few entries past the aligned unit boundary, captured at prompt end and
    output end.

Resume for a request whose prompt extends a stored prefix of length b (> n_win):
  * snapshot hit at q ∈ [b, b + lcm) → exact resume at q: entries, windows and partial groups are
    restored and only the suffix is prefilled (decoder windows continue);
  * no snapshot → Encoder SWA Bounded Replay: the last n_win cached tokens run through the encoder
    again to rebuild its windows (replayed tokens = n_win), then the suffix is prefilled.
Cached global KV is read as stored rows and appended as is: never recomputed, never rewritten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.engine.cache import SequenceCache
from dsv41.engine.prefix_store import (
    PersistentStore,
    SWAPool,
    chain_hashes,
    compression_lcm,
    longest_hit,
    model_salt,
    unit_boundaries,
)

log = logging.getLogger(__name__)
FORMAT_VERSION = "dsv41-kv-1"  # packed FP4 entries (E4M3/16) + FP4 index keys (E8M0/32); FP8 windows (E8M0/32)


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


class PrefixCache:
    def __init__(self, config: ModelConfig, store: PersistentStore | None, pool: SWAPool | None = None, *,
                 interval: int = 4096):
        self.config = config
        self.store, self.pool, self.interval = store, pool, interval
        self.salt = model_salt(config.to_dict(), FORMAT_VERSION)
        self.swa_salt = model_salt(config.to_dict(), FORMAT_VERSION + "-swa")
        self.lcm = compression_lcm(config.compress_ratios[:config.n_layers])
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ lookup and resume
    def resume(self, seq: SequenceCache, prompt: list[int]) -> Resume | None:
        """Fill an empty `seq` from the cache for the longest usable prefix of prompt[:-1]."""
        if self.store is None:
            return None
        self.stats.lookups += 1
        hit = longest_hit(self.store, prompt[:-1], self.salt, min_tokens=self.config.window_size)
        chain = self._chain(hit) if hit is not None else None
        if chain is None:
            self.stats.misses += 1
            return None
        b = hit.n_tokens
        snapshot, q = self._snapshot(prompt, b)
        for store_layer, entry_store in seq.entry_stores.items():
            for unit in chain:  # root first: rows are appended in token order, exactly as stored
                entry_store.kv.append(unit[f"{store_layer}.kv"])
                entry_store.index_k.append(unit[f"{store_layer}.index_k"])
        seq.tokens.extend(prompt[:b])
        self.stats.hits += 1
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
            self.stats.exact_resumes += 1
            self.stats.cached_tokens += q
            seq.persisted = (b, hit.key)
            return Resume(q, 0, True)
        replay = self.config.window_size
        self.stats.cached_tokens += b
        self.stats.replayed_tokens += replay
        seq.persisted = (b, hit.key)
        return Resume(b, replay, False)

    def _chain(self, hit) -> list[dict[str, Tensor]] | None:
        """The hit unit and its ancestors, root first; None when an ancestor is gone."""
        units, unit, meta = [], hit.tensors, hit.meta
        while True:
            units.append(unit)
            parent = meta.get("parent")
            if parent is None:
                break
            got = self.store.get(parent)
            if got is None:
                self.stats.broken_chains += 1
                log.warning("prefix unit %s lost its parent %s; treating as a miss", hit.key.hex()[:12], parent[:12])
                return None
            unit, meta = got
        return units[::-1]

    def _snapshot(self, prompt: list[int], b: int):
        if self.pool is None:
            return None, b
        last = min(b + self.lcm, len(prompt))  # q ≤ len(prompt) − 1: at least one token is left to run
        positions = list(range(b, last))
        for q, key in sorted(zip(positions, chain_hashes(prompt, positions, self.swa_salt)), reverse=True):
            got = self.pool.get(key)
            if got is not None and got[1].get("n_tokens") == q:
                return got, q
        return None, b

    # ------------------------------------------------------------------ saving
    def save(self, seq: SequenceCache, ends: list[int], snapshot: bool = True) -> None:
        """Persist the units of seq up to the given end positions, and a window snapshot at its end."""
        if self.store is not None:
            self._save_units(seq, ends)
        if snapshot and self.pool is not None:
            self._save_snapshot(seq)

    def _save_units(self, seq: SequenceCache, ends: list[int]) -> None:
        done, parent = seq.persisted
        cuts = [b for b in unit_boundaries(seq.n_tokens, interval=self.interval, ratio_lcm=self.lcm, ends=ends)
                if b > done]
        if not cuts:
            return
        keys = chain_hashes(seq.tokens, cuts, self.salt)
        for b, key in zip(cuts, keys):
            tensors = {}
            for layer_id, store in seq.entry_stores.items():
                lo, hi = done // store.ratio, b // store.ratio
                tensors[f"{layer_id}.kv"] = store.kv.read(lo, hi).contiguous()
                tensors[f"{layer_id}.index_k"] = store.index_k.read(lo, hi).contiguous()
            meta = {"start": done, "end": b, "n_tokens": b, "parent": None if parent is None else parent.hex(),
                    "format": FORMAT_VERSION}
            if self.store.put(key, tensors, meta, n_tokens=b):
                self.stats.units_written += 1
                self.stats.unit_tokens_written += b - done
                self.stats.unit_bytes_written += sum(t.numel() for t in tensors.values())
            else:  # could not persist (disk full, ...): later units must not point at a missing parent
                return
            done, parent = b, key
            seq.persisted = (done, parent)

    def _save_snapshot(self, seq: SequenceCache) -> None:
        q = seq.n_tokens
        b = q - q % self.lcm
        tensors: dict[str, Tensor] = {}
        for layer_id, store in seq.entry_stores.items():
            lo, hi = b // store.ratio, q // store.ratio
            tensors[f"{layer_id}.tail_kv"] = store.kv.read(lo, hi).contiguous()
            tensors[f"{layer_id}.tail_index_k"] = store.index_k.read(lo, hi).contiguous()
            if layer_id in seq.pending:
                kv, score = seq.pending[layer_id]
                tensors[f"{layer_id}.pending_kv"] = kv.contiguous()
                tensors[f"{layer_id}.pending_score"] = score.contiguous()
        for i, ring in enumerate(seq.windows):
            for k, v in ring.state().items():
                tensors[f"window.{i}.{k}"] = v
        key = chain_hashes(seq.tokens, [q], self.swa_salt)[0]
        if self.pool.put(key, {k: v.cpu() for k, v in tensors.items()}, {"n_tokens": q}):
            self.stats.snapshots_written += 1

    def metrics(self) -> dict:
        out = {k: v for k, v in vars(self.stats).items() if k != "extra"}
        if self.store is not None:
            out["store"] = self.store.stats()
            tokens = out["unit_tokens_written"]
            out["bytes_per_cached_token"] = out["unit_bytes_written"] / tokens if tokens else None
        if self.pool is not None:
            out["pool"] = self.pool.stats()
            lookups = out["pool"].get("hits", 0) + out["pool"].get("misses", 0)
            out["pool_hit_rate"] = out["pool"].get("hits", 0) / lookups if lookups else None
        return out
