"""Prefix-unit keys and boundaries: where units are cut and how a token prefix names one (SPEC §6).

Key idea: the key of the unit ending at boundary b is a SHA-256 over (domain tag, salt, tokens[:b]) taken from
one streaming hasher, snapshotted at each boundary. That is the chain hash_k = H-state(hash_{k-1} + tokens in
(b_{k-1}, b_k]) computed incrementally (every token is hashed once), with one refinement over hashing the previous
*digest*: the key at b does not depend on which other boundaries were cut. A unit cut at one request's prompt end
is therefore found by a later request whose own boundaries lie elsewhere; the key never depends on later tokens.
The salt (`model_salt`) names the model and the KV format, so a unit is only ever reused by the same weights.

A lookup only needs to hash at lengths that some stored unit has (`store.lengths()`), so it costs one hash pass
over the tokens plus one batched index query, whatever the prompt length.
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
    h = hashlib.sha256(_DOMAIN)
    h.update(len(salt).to_bytes(4, "little") + salt)
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


class PrefixUnitStore(Protocol):
    def lengths(self) -> list[int]: ...
    def present(self, keys: Sequence[bytes | str]) -> set[str]: ...
    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None: ...


@dataclass
class PrefixHit:
    n_tokens: int  # the unit covers tokens[:n_tokens]
    key: bytes
    tensors: dict[str, Tensor]
    meta: dict


def longest_hit(store: PrefixUnitStore, tokens: Sequence[int], salt: bytes, min_tokens: int) -> PrefixHit | None:
    """The longest stored unit that is a prefix of `tokens` and longer than `min_tokens` (pass n_win: a hit that
    short saves nothing over the window replay). A unit that fails to load is skipped for the next shorter one.
    A hit may cover all of `tokens`; pass tokens[:-1] when the last token must still be run."""
    candidates = [n for n in store.lengths() if min_tokens < n <= len(tokens)]
    if not candidates:
        return None
    keys = chain_hashes(tokens, candidates, salt)
    stored = store.present(keys)
    for n, key in sorted(zip(candidates, keys), reverse=True):
        if key.hex() not in stored:
            continue
        unit = store.get(key)
        if unit is not None:
            return PrefixHit(n, key, *unit)
    return None
