"""Prefix-unit keys and boundaries: where units are cut and how a token prefix names one (SPEC §6).

Key idea: the key of the unit ending at boundary b is a SHA-256 over (domain tag, salt, tokens[:b]) taken from
one streaming hasher, snapshotted at each boundary. That is the chain hash_k = H-state(hash_{k-1} + tokens in
(b_{k-1}, b_k]) computed incrementally (every token is hashed once), with one refinement over hashing the previous
*digest*: the key at b does not depend on which other boundaries were cut. A unit cut at one request's prompt end
is therefore found by a later request whose own boundaries lie elsewhere; the key never depends on later tokens.
The salt (`model_salt`) names the model and the KV format, so a unit is only ever reused by the same weights.

Where units are cut (`cut_points`): at a fixed stride, around chat-template boundary tokens (the message ends and
role markers, so a shared system prompt, a conversation's history and the spot just before the reasoning-effort
line are unit ends) and at prompt / output ends.

How a lookup finds them without scanning the index: every unit is filed under an *anchor*, the key of its prefix
up to the last stride mark before its end (`anchor_position`). A lookup hashes the prompt's stride marks (one pass),
asks the index which unit lengths hang under those anchors (one indexed query; at most stride / lcm lengths per
anchor, whoever stored them), then probes those lengths' keys (one primary-key query). That is O(prefix / stride)
work whatever the number of stored units, and it still finds a unit cut anywhere (another request's prompt end).

Identity (`model_salt`, `namespace_salt`): the salt names the weights (a fingerprint), the tokenizer, the config
and the KV format; a per-tenant namespace (cache salt, API key) is folded in on top, so two checkpoints of one
preset or two tenants never share a key.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch import Tensor

_DOMAIN = b"dsv41-prefix-unit\x00"


def model_salt(config_dict: dict, format_version: int | str) -> bytes:
    """32-byte identity of (model config, KV/blob format): changing either changes every key."""
    canonical = json.dumps(config_dict, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{format_version}\x00{canonical}".encode()).digest()


def namespace_salt(salt: bytes, namespace: bytes | str | None) -> bytes:
    """The salt of one tenant's keys: the model salt itself for the default namespace (None or empty)."""
    if not namespace:
        return salt
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return hashlib.sha256(b"dsv41-prefix-namespace\x00" + salt + len(ns).to_bytes(4, "little") + ns).digest()


def compression_lcm(compress_ratios: Sequence[int]) -> int:
    """lcm of the nonzero compression ratios: a boundary that is a multiple of it closes every layer's entries."""
    return math.lcm(*[int(r) for r in compress_ratios if r] or [1])


def _token_bytes(tokens: Sequence[int] | np.ndarray | Tensor) -> memoryview:
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return memoryview(arr.astype("<u4").tobytes())  # 4 bytes per token: a byte string names one token sequence


def chain_hashes(tokens: Sequence[int], boundaries: Sequence[int], salt: bytes) -> list[bytes]:
    """Key (32 bytes) of the prefix tokens[:b] for each boundary b (strictly increasing, 1 <= b <= len(tokens))."""
    data = _token_bytes(tokens)
    n = len(data) // 4
    h = _root_state(salt)
    out, prev = [], 0
    for b in boundaries:
        if not prev < b <= n:
            raise ValueError(f"boundaries must be strictly increasing within [1, {n}], got {list(boundaries)}")
        h.update(data[4 * prev:4 * b])
        out.append(h.copy().digest())
        prev = b
    return out


def unit_boundaries(n_tokens: int, *, interval: int = 4096, ratio_lcm: int, ends: Sequence[int] = ()) -> list[int]:
    """Where to cut units of an input of n_tokens: every `interval` tokens and at the given prompt/output ends,
    each aligned down to a multiple of `ratio_lcm` so a unit only holds complete compressed entries."""
    if ratio_lcm < 1 or interval < 1:
        raise ValueError(f"interval ({interval}) and ratio_lcm ({ratio_lcm}) must be >= 1")
    cuts = {k - k % ratio_lcm for k in range(interval, n_tokens + 1, interval)}
    for e in ends:
        if not 0 <= e <= n_tokens:
            raise ValueError(f"end position {e} outside [0, {n_tokens}]")
        cuts.add(e - e % ratio_lcm)
    cuts.discard(0)
    return sorted(cuts)


def _aligned(positions: np.ndarray, lo: int, hi: int, ratio_lcm: int) -> list[int]:
    """Positions aligned down to a multiple of ratio_lcm, kept in (lo, hi], sorted, unique."""
    p = positions[(positions > 0)]
    p = p - p % ratio_lcm
    return sorted(set(p[(p > lo) & (p <= hi)].tolist()))


def _around_boundaries(tokens: Sequence[int], boundary_ids: Sequence[int], offsets: Sequence[int]) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if not len(boundary_ids) or not arr.size:
        return np.empty(0, np.int64)
    at = np.flatnonzero(np.isin(arr, np.asarray(list(boundary_ids), np.int64)))  # indices of boundary tokens
    return np.concatenate([at + o for o in offsets]) if at.size else np.empty(0, np.int64)


def cut_points(tokens: Sequence[int], *, lo: int, stride: int, ratio_lcm: int, boundary_ids: Sequence[int] = (),
               ends: Sequence[int] = ()) -> list[int]:
    """Where to cut the units of `tokens` past the already-persisted end `lo`: every `stride` tokens, just before
    and just after each boundary token (a message end, a role marker), and at each end e and e - 1 (a prompt or
    output end, and the last position a later identical prompt can resume from). Aligned down to a multiple of
    `ratio_lcm` (a unit holds only complete compressed entries), within (lo, len(tokens)]."""
    if ratio_lcm < 1 or stride < 1:
        raise ValueError(f"stride ({stride}) and ratio_lcm ({ratio_lcm}) must be >= 1")
    n = len(tokens)
    for e in ends:
        if not 0 <= e <= n:
            raise ValueError(f"end position {e} outside [0, {n}]")
    positions = [np.arange(stride * (lo // stride + 1), n + 1, stride, dtype=np.int64),
                 _around_boundaries(tokens, boundary_ids, (0, 1)),
                 np.asarray([x for e in ends for x in (e, e - 1)], np.int64)]
    return _aligned(np.concatenate(positions), lo, n, ratio_lcm)


def anchor_position(n_tokens: int, stride: int) -> int:
    """The stride mark a unit ending at n_tokens hangs under: the last multiple of `stride` strictly before it."""
    return ((n_tokens - 1) // stride) * stride


def anchor_keys(tokens: Sequence[int], positions: Sequence[int], salt: bytes) -> list[bytes]:
    """Keys of the prefixes tokens[:a] for stride marks a (strictly increasing; a = 0 names the empty prefix)."""
    positions = list(positions)
    root = [_root_state(salt).digest()] if positions and positions[0] == 0 else []
    rest = positions[1:] if root else positions
    return root + (chain_hashes(tokens, rest, salt) if rest else [])


def _root_state(salt: bytes):
    h = hashlib.sha256(_DOMAIN)
    h.update(len(salt).to_bytes(4, "little") + salt)
    return h


class PrefixUnitStore(Protocol):
    def lengths(self) -> list[int]: ...
    def lengths_under(self, anchors: Sequence[str]) -> set[int]: ...
    def present(self, keys: Sequence[bytes | str]) -> set[str]: ...
    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None: ...


@dataclass
class PrefixHit:
    n_tokens: int  # the unit covers tokens[:n_tokens]
    key: bytes
    tensors: dict[str, Tensor]
    meta: dict


def longest_hit(store: PrefixUnitStore, tokens: Sequence[int], salt: bytes, min_tokens: int,
                candidates: Sequence[int] | None = None, get=None) -> PrefixHit | None:
    """The longest stored unit that is a prefix of `tokens` and longer than `min_tokens` (pass n_win: a hit that
    short saves nothing over the window replay), probing only the prefix lengths in `candidates` (`lookup_points`;
    None: every length some stored unit has, `store.lengths()`, a scan kept for tests). A unit that fails to load
    is skipped for the next shorter one. `get(key)` replaces `store.get` (a memory tier in front of the store).
    A hit may cover all of `tokens`; pass tokens[:-1] when the last token must still be run."""
    if candidates is None:
        candidates = store.lengths()
    candidates = sorted({n for n in candidates if min_tokens < n <= len(tokens)})
    if not candidates:
        return None
    keys = chain_hashes(tokens, candidates, salt)
    stored = store.present(keys)
    for n, key in sorted(zip(candidates, keys), reverse=True):
        if key.hex() not in stored:
            continue
        unit = (get or store.get)(key)
        if unit is not None:
            return PrefixHit(n, key, *unit)
    return None
