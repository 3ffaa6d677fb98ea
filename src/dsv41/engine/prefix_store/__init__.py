"""Prefix cache storage (SPEC §6): persistent global-KV prefix units on disk, short-lived SWA rings in a pool.

Engine-agnostic: both tiers store named tensors + JSON meta under a key. `hashing` decides where units are cut
and how a token prefix names one; `persistent` is the disk tier (LRU, TTL, checksums, crash safe); `swa_pool`
is the in-process or Redis window pool.
"""

from dsv41.engine.prefix_store.hashing import (
    PrefixHit,
    chain_hashes,
    compression_lcm,
    longest_hit,
    model_salt,
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

__all__ = [
    "CorruptBlob", "InProcessSWAPool", "PersistentStore", "PrefixHit", "RedisSWAPool", "SWAPool", "chain_hashes",
    "compression_lcm", "decode_unit", "default_cache_root", "encode_unit", "longest_hit", "make_swa_pool",
    "model_salt", "unit_boundaries",
]
