"""SWA pool backends: in-process LRU + TTL on a fake clock, and Redis (a real redis-server when installed):
round trip, GETEX refresh of the entry's TTL, two pools sharing data, and an unreachable server."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from dsv41.engine.prefix_store import InProcessSWAPool, RedisSWAPool, SWAPool, encode_unit, make_swa_pool
from dsv41.engine.prefix_store.swa_pool import default_pool_bytes

LOGGER = "dsv41.engine.prefix_store.swa_pool"


class FakeClock:
    def __init__(self, t: float = 50.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def window_rings(seed: int, layers: int = 3, slots: int = 128) -> tuple[dict[str, torch.Tensor], dict]:
    """FP8 window rings as the engine packs them: per layer `slots` entries of 528 bytes, random."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.window": torch.randint(0, 256, (slots, 528), dtype=torch.uint8, generator=g)
               for i in range(layers)}
    tensors["positions"] = torch.randint(0, 1 << 20, (slots,), dtype=torch.int64, generator=g)
    return tensors, {"n_tokens": int(torch.randint(128, 9000, (1,), generator=g)), "end": "prompt"}


def assert_same(got, expected) -> None:
    (gt, gm), (et, em) = got, expected
    assert gm == em and gt.keys() == et.keys()
    for k in et:
        assert gt[k].dtype == et[k].dtype and torch.equal(gt[k], et[k]), k


# ---- in-process -----------------------------------------------------------------------------------------


def test_in_process_round_trip_and_protocol():
    pool = InProcessSWAPool(capacity_bytes=1 << 24)
    assert isinstance(pool, SWAPool)
    unit = window_rings(1)
    assert pool.put(b"\x01\x02", *unit) and pool.get("0102") is not None  # bytes keys are their hex
    got = pool.get(b"\x01\x02")
    assert_same(got, unit)
    got[0]["layers.0.window"].zero_()  # the caller may overwrite what it got
    assert_same(pool.get(b"\x01\x02"), unit)
    assert pool.get("absent") is None
    st = pool.stats()
    assert st["hits"] == 3 and st["misses"] == 1 and st["entries"] == 1
    assert st["bytes"] == len(encode_unit(*unit))
    assert pool.delete(b"\x01\x02") and not pool.delete(b"\x01\x02") and pool.get(b"\x01\x02") is None
    pool.put("a", *unit)
    pool.clear()
    assert pool.stats()["entries"] == 0 and pool.stats()["bytes"] == 0


def test_in_process_ttl_refreshes_on_hit():
    clock = FakeClock()
    pool = InProcessSWAPool(capacity_bytes=1 << 24, clock=clock)
    a, b = window_rings(1), window_rings(2)
    pool.put("a", *a, ttl_s=10)
    pool.put("b", *b, ttl_s=30)
    clock.t += 8
    assert_same(pool.get("a"), a)  # a now lives until t0 + 18
    clock.t += 8
    assert_same(pool.get("a"), a)  # until t0 + 26
    clock.t += 11
    assert pool.get("a") is None
    assert_same(pool.get("b"), b)  # b had 30 s
    assert pool.stats()["expired"] == 1


def test_in_process_lru_capacity():
    clock = FakeClock()
    units = {i: window_rings(i) for i in range(5)}
    size = len(encode_unit(*units[0]))
    pool = InProcessSWAPool(capacity_bytes=3 * size, clock=clock)
    for i in range(3):
        assert pool.put(str(i), *units[i])
    pool.get("0")  # LRU order: 1, 2, 0
    assert pool.put("3", *units[3])
    assert pool.get("1") is None
    assert pool.put("4", *units[4])
    assert pool.get("2") is None
    for i in (0, 3, 4):
        assert_same(pool.get(str(i)), units[i])
    st = pool.stats()
    assert st["evictions"] == 2 and st["bytes"] == 3 * size
    assert not pool.put("big", *window_rings(9, layers=10))  # larger than the pool
    assert pool.stats()["entries"] == 3


def test_default_capacity_and_factory():
    pool = make_swa_pool(None)
    assert isinstance(pool, InProcessSWAPool) and isinstance(make_swa_pool("memory"), InProcessSWAPool)
    ram = default_pool_bytes(1.0)
    assert ram > 0 and pool.capacity_bytes == pytest.approx(0.10 * ram, rel=1e-6)
    with open("/proc/meminfo") as f:
        mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert ram == pytest.approx(mem_total, rel=0.05)
    assert isinstance(make_swa_pool("redis://127.0.0.1:1/0"), RedisSWAPool)
    with pytest.raises(ValueError):
        make_swa_pool("memcached://x")


# ---- Redis ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture
def redis_url():
    pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    port = free_port()
    proc = start_redis(port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_redis_round_trip_and_ttl_refresh(redis_url):
    import redis

    pool, client = RedisSWAPool(redis_url), redis.Redis.from_url(redis_url)
    unit = window_rings(3)
    assert pool.put(b"\xab\xcd", *unit, ttl_s=100)
    name = "dsv41:swa:abcd"
    assert 98 <= client.ttl(name) <= 100
    client.expire(name, 5)  # pretend most of its life has passed
    assert_same(pool.get(b"\xab\xcd"), unit)
    assert 98 <= client.ttl(name) <= 100  # a hit gives the entry its own TTL again
    pool.put("d", *window_rings(4))  # default TTL: refreshed by GETEX alone
    client.expire("dsv41:swa:d", 5)
    assert pool.get("d") is not None and 598 <= client.ttl("dsv41:swa:d") <= 600
    assert pool.get("missing") is None
    st = pool.stats()
    assert st["hits"] == 2 and st["misses"] == 1 and st["errors"] == 0 and st["bytes"] > 0
    client.set("dsv41:swa:junk", b"\x00" * 100)
    assert pool.get("junk") is None and client.exists("dsv41:swa:junk") == 0  # corrupt value: miss, removed
    client.set("other:key", b"1")
    pool.clear()
    assert client.exists(name) == 0 and client.get("other:key") == b"1"  # only the pool's keys
    assert pool.delete("d") is False


def test_redis_ttl_expires(redis_url):
    pool = RedisSWAPool(redis_url)
    pool.put("short", *window_rings(5), ttl_s=1)
    assert pool.get("short") is not None
    time.sleep(1.3)
    assert pool.get("short") is None


def test_redis_two_pools_share_entries(redis_url):
    writer, reader = RedisSWAPool(redis_url), make_swa_pool(redis_url)
    unit = window_rings(6)
    assert writer.put("shared", *unit)
    assert_same(reader.get("shared"), unit)
    assert reader.delete("shared") and writer.get("shared") is None


def test_redis_unreachable_is_a_quiet_miss(caplog):
    pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
    port = free_port()  # nothing listens here
    pool = RedisSWAPool(f"redis://127.0.0.1:{port}/0", retry_s=5.0, probe=False)
    attempts = []
    real_call = pool._client.execute_command
    pool._client.execute_command = lambda *a, **k: attempts.append(a[0]) or real_call(*a, **k)
    unit = window_rings(7)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.monotonic()
        for _ in range(20):
            assert pool.get("k") is None
            assert pool.put("k", *unit) is False
        assert time.monotonic() - t0 < 5  # no backoff stalls
        assert len(attempts) == 1 and pool.down  # one failed attempt, then callers never contact the server
        assert not pool.probe_now() and pool.get("k") is None
        assert len(attempts) == 2  # only the probe went out
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert pool.stats()["errors"] >= 40
    if shutil.which("redis-server") is None:
        return
    proc = start_redis(port)  # the server comes back: the probe closes the breaker
    try:
        assert pool.probe_now() and not pool.down
        assert pool.put("k", *unit) and pool.get("k") is not None
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_hung_redis_costs_one_timeout_then_the_probe_recovers(redis_url):
    """SIGSTOP the server (connections accepted, never answered): the first call times out, every later call is
    an instant miss, and after SIGCONT the background probe closes the breaker."""
    import signal

    pool = RedisSWAPool(redis_url, retry_s=0.2, socket_timeout_s=0.3)
    unit = window_rings(8)
    assert pool.put("a", *unit)
    pid = int(pool._client.info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert pool.get("a") is None  # times out once
        first = time.monotonic() - t0
        t0 = time.monotonic()
        for _ in range(50):
            assert pool.get("a") is None and pool.put("b", *unit) is False
        rest = time.monotonic() - t0
        assert first < 2.0 and rest < 0.5, (first, rest)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while pool.down and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.down and pool.get("a") is not None
    pool.close()
