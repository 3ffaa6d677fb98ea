"""Prefix cache storage (SPEC §6): persistent global-KV prefix units on disk, short-lived SWA rings in a pool.

Engine-agnostic: both tiers store named tensors + JSON meta under a key. `hashing` decides where units are cut
and how a token prefix names one; `persistent` is the disk tier (LRU, TTL, checksums, crash safe); `swa_pool`
is the in-process or Redis window pool.
"""

from dsv41.engine.prefix_store.hashing import (
    PrefixHit,
    anchor_keys,
    anchor_position,
    chain_hashes,
    compression_lcm,
    cut_points,
    longest_hit,
    model_salt,
    namespace_salt,
    unit_boundaries,
)
from dsv41.engine.prefix_store.persistent import (
    CorruptBlob,
    PersistentStore,
    decode_unit,
    default_cache_root,
    encode_unit,
)
from dsv41.engine.prefix_store.swa_pool import InProcessSWAPool, RedisSWAPool, SWAPool, make_swa_pool
from dsv41.engine.prefix_store.writer import BackgroundWriter

__all__ = [
    "BackgroundWriter", "CorruptBlob", "InProcessSWAPool", "PersistentStore", "PrefixHit", "RedisSWAPool", "SWAPool",
    "anchor_keys", "anchor_position", "chain_hashes", "compression_lcm", "cut_points", "decode_unit",
    "default_cache_root", "encode_unit", "longest_hit", "make_swa_pool", "model_salt", "namespace_salt",
    "unit_boundaries",
]
