"""SWA pool: short-lived sliding-window KV rings saved at prompt end and output end (SPEC §6).

Window KV is never persisted. The report keeps it in a distributed in-memory pool (~10% of each host's DRAM)
with a life of minutes; a miss is harmless because the engine falls back to bounded replay of the last n_win
tokens. Two backends behind one protocol:

- `InProcessSWAPool`: LRU + TTL inside the serving process (default capacity 10% of physical RAM).
- `RedisSWAPool`: one blob per key, `SET key blob EX ttl`, `GETEX key EX ttl` on a hit, so every engine process
  pointing at the same Redis shares the pool and Redis does the expiry and eviction (configure `maxmemory` and
  `maxmemory-policy allkeys-lru` on the server). An unreachable or hung Redis turns every operation into a miss
  at once (a circuit breaker): the first failed call (bounded by a short socket timeout) marks the server down,
  logs one warning per outage, and from then on callers never touch the network; a background probe pings it
  every `retry_s` seconds and closes the breaker when it answers. A stalled Redis therefore costs the engine
  thread at most one socket timeout per outage, and the server goes on through bounded replay.

Values use the prefix store's blob encoding (`encode_unit` / `decode_unit`, checksummed); the entry's TTL rides
in an 8-byte prefix so a hit refreshes it to the TTL it was stored with. TTLs count from the last access.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

from dsv41.engine.prefix_store.persistent import CorruptBlob, decode_unit, encode_unit

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0
_TTL = struct.Struct("<d")


@runtime_checkable
class SWAPool(Protocol):
    def put(self, key: bytes | str, tensors: dict[str, Tensor], meta: dict, ttl_s: float = DEFAULT_TTL_S) -> bool:
        ...

    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None: ...
    def delete(self, key: bytes | str) -> bool: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, int]: ...


def _key_text(key: bytes | str) -> str:
    return key.hex() if isinstance(key, (bytes, bytearray)) else str(key)


def default_pool_bytes(fraction: float = 0.10) -> int:
    """`fraction` of physical RAM (sysconf, else /proc/meminfo, else 1 GiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    if total <= 0:
        try:
            with open("/proc/meminfo") as f:
                total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
        except (OSError, StopIteration, ValueError):
            total = 10 * 1024**3
    return int(total * fraction)


class InProcessSWAPool:
    """LRU by access, TTL from last access; values stored encoded (immutable, exact byte accounting)."""

    def __init__(self, capacity_bytes: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.capacity_bytes = default_pool_bytes() if capacity_bytes is None else int(capacity_bytes)
        self.clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float, float]] = OrderedDict()  # key → (blob, ttl, expires)
        self._bytes = 0
        self._lock = threading.Lock()
        self._counters = dict(hits=0, misses=0, evictions=0, expired=0, errors=0)

    def put(self, key: bytes | str, tensors: dict[str, Tensor], meta: dict, ttl_s: float = DEFAULT_TTL_S) -> bool:
        key, blob = _key_text(key), encode_unit(tensors, meta)
        with self._lock:
            self._remove(key)
            if len(blob) > self.capacity_bytes:
                self._counters["errors"] += 1
                return False
            now = self.clock()
            for k in [k for k, (_, _, expires) in self._entries.items() if expires <= now]:
                self._remove(k)
                self._counters["expired"] += 1
            while self._bytes + len(blob) > self.capacity_bytes:
                self._remove(next(iter(self._entries)))  # least recently used first
                self._counters["evictions"] += 1
            self._entries[key] = (blob, float(ttl_s), now + ttl_s)
            self._bytes += len(blob)
        return True

    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None:
        key = _key_text(key)
        with self._lock:
            entry = self._entries.get(key)
            now = self.clock()
            if entry is not None and entry[2] <= now:
                self._remove(key)
                self._counters["expired"] += 1
                entry = None
            if entry is None:
                self._counters["misses"] += 1
                return None
            blob, ttl, _ = entry
            self._entries[key] = (blob, ttl, now + ttl)
            self._entries.move_to_end(key)
            self._counters["hits"] += 1
        return decode_unit(blob)

    def delete(self, key: bytes | str) -> bool:
        with self._lock:
            return self._remove(_key_text(key))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(entries=len(self._entries), bytes=self._bytes, **self._counters)

    def _remove(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[0])
        return entry is not None


class RedisSWAPool:
    """Shared pool in Redis. Never raises on connection trouble: misses, one warning per outage, timed retry."""

    def __init__(self, url: str, *, key_prefix: str = "dsv41:swa:", retry_s: float = 5.0,
                 socket_timeout_s: float = 0.5, clock: Callable[[], float] = time.monotonic, probe: bool = True):
        import redis  # optional dependency: only needed for this backend
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.key_prefix, self.retry_s, self.clock = url, key_prefix, float(retry_s), clock
        self.probe = probe  # False: no probe thread; call probe_now() yourself (tests)
        self._redis_error = redis.RedisError
        # one quick retry (a pooled connection gone stale after a server restart), no backoff: an outage must not
        # stall the serving loop
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 1))
        self._lock = threading.Lock()
        self._down_until: float | None = None  # set while the server is considered unreachable
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._counters = dict(hits=0, misses=0, errors=0, corrupt=0, bytes_written=0, bytes_read=0)

    def put(self, key: bytes | str, tensors: dict[str, Tensor], meta: dict, ttl_s: float = DEFAULT_TTL_S) -> bool:
        value = _TTL.pack(float(ttl_s)) + encode_unit(tensors, meta)
        ok = self._call(lambda c: c.set(self._name(key), value, ex=_whole_seconds(ttl_s)))
        if ok:
            self._count(bytes_written=len(value))
        return bool(ok)

    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None:
        name = self._name(key)
        value = self._call(lambda c: c.getex(name, ex=_whole_seconds(DEFAULT_TTL_S)))
        if not value:
            self._count(misses=1)
            return None
        try:
            (ttl_s,) = _TTL.unpack_from(value, 0)
            unit = decode_unit(bytearray(memoryview(value)[_TTL.size:]))
        except (struct.error, CorruptBlob) as exc:
            log.warning("SWA pool: dropping corrupt value %s (%s)", name, exc)
            self._call(lambda c: c.delete(name))
            self._count(misses=1, corrupt=1)
            return None
        if _whole_seconds(ttl_s) != _whole_seconds(DEFAULT_TTL_S):
            self._call(lambda c: c.expire(name, _whole_seconds(ttl_s)))  # stored with a non-default TTL
        self._count(hits=1, bytes_read=len(value))
        return unit

    def delete(self, key: bytes | str) -> bool:
        return bool(self._call(lambda c: c.delete(self._name(key))))

    def clear(self) -> None:
        """Delete this pool's keys (those under key_prefix), not the whole database."""
        def wipe(c):
            names = list(c.scan_iter(match=self.key_prefix + "*", count=1000))
            for i in range(0, len(names), 1000):
                c.delete(*names[i:i + 1000])
            return True

        self._call(wipe)

    def stats(self) -> dict[str, int]:
        info = self._call(lambda c: c.info("memory") | c.info("stats")) or {}
        with self._lock:
            return dict(bytes=int(info.get("used_memory", -1)), evictions=int(info.get("evicted_keys", -1)),
                        **self._counters)

    # ---- internals -------------------------------------------------------------------------------------

    def _name(self, key: bytes | str) -> str:
        return self.key_prefix + _key_text(key)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self._counters[k] += v

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down_until is not None

    def probe_now(self) -> bool:
        """Ping the server once; closes the breaker when it answers. True when reachable."""
        try:
            self._client.ping()
        except self._redis_error:
            return False
        with self._lock:
            was_down, self._down_until = self._down_until is not None, None
        if was_down:
            log.info("SWA pool: Redis at %s reachable again", self.url)
        return True

    def close(self) -> None:
        self._closed.set()

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.retry_s):
            if self.probe_now():
                break
        with self._lock:
            self._prober = None

    def _call(self, op):
        """Run op(client); None on any Redis error. While the breaker is open (server down) the network is not
        touched at all: only the background probe talks to the server until it answers."""
        with self._lock:
            if self._down_until is not None:
                self._counters["errors"] += 1
                return None
        try:
            result = op(self._client)
        except self._redis_error as exc:
            with self._lock:
                first = self._down_until is None
                self._down_until = self.clock()
                self._counters["errors"] += 1
                if self.probe and self._prober is None:
                    self._prober = threading.Thread(target=self._probe_loop, name="dsv41-redis-probe", daemon=True)
                    self._prober.start()
            if first:
                log.warning("SWA pool: Redis at %s unreachable (%s); serving misses, probing every %.0f s",
                            self.url, exc, self.retry_s)
            return None
        return result


def _whole_seconds(ttl_s: float) -> int:
    return max(1, round(ttl_s))


def make_swa_pool(spec: str | None = None) -> SWAPool:
    """None / "memory" → in-process pool; "redis://HOST:PORT/DB" (or rediss://, unix://) → Redis pool."""
    if spec is None or spec == "memory":
        return InProcessSWAPool()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisSWAPool(spec)
    raise ValueError(f"unknown SWA pool spec {spec!r}: use 'memory' or 'redis://HOST:PORT/DB'")
