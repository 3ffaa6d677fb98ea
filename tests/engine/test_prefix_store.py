"""Persistent prefix store and prefix-unit keys: exact round trips, chain-hash properties, TTL/LRU on a fake clock,
corruption and disk-full handling, orphan cleanup, and SIGKILL crash safety (tests/engine/crash_writer.py)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading

import crash_writer
import pytest
import torch

from dsv41.engine.prefix_store import (
    CorruptBlob,
    PersistentStore,
    chain_hashes,
    compression_lcm,
    decode_unit,
    default_cache_root,
    encode_unit,
    longest_hit,
    model_salt,
    unit_boundaries,
)

LOGGER = "dsv41.engine.prefix_store.persistent"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def random_unit(seed: int, nbytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Packed-KV-like tensors: FP4 main entries (288 B) and index keys (68 B) per layer, random bytes."""
    g = torch.Generator().manual_seed(seed)
    if nbytes is not None:
        return {"kv": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)}, {"seed": seed}
    n = int(torch.randint(1, 40, (1,), generator=g))
    tensors = {f"layers.{i}.{name}": torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)
               for i in range(3) for name, width in (("kv", 288), ("index_k", 68))}
    return tensors, {"n_tokens": 4 * n, "seed": seed}


def assert_same_unit(got, expected) -> None:
    (gt, gm), (et, em) = got, expected
    assert gm == em
    assert gt.keys() == et.keys()
    for k in et:
        assert gt[k].dtype == et[k].dtype and gt[k].shape == et[k].shape, k
        assert torch.equal(gt[k].reshape(-1).view(torch.uint8), et[k].contiguous().reshape(-1).view(torch.uint8)), k


def key(i: int) -> str:
    return chain_hashes([i], [1], b"test")[0].hex()


def blob_files(root) -> list:
    return sorted(p for p in (root / "blobs").glob("*/*") if p.is_file())


# ---- blob format ----------------------------------------------------------------------------------------


def test_round_trip_is_byte_exact(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "kv": torch.randint(0, 256, (37, 288), dtype=torch.uint8, generator=g),
        "window": torch.randn(128, 66, generator=g).to(torch.float8_e4m3fn),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f32_t": torch.randn(6, 9, generator=g).t(),  # non-contiguous input
        "scalar": torch.tensor(123456789012, dtype=torch.int64),
        "empty": torch.empty(0, 68, dtype=torch.uint8),
        "flags": torch.rand(11, generator=g) > 0.5,
    }
    meta = {"n_tokens": 4096, "layers": [1, 2, 3], "format": "fp4"}
    assert_same_unit(decode_unit(encode_unit(tensors, meta)), (tensors, meta))
    with PersistentStore(tmp_path) as store:
        assert store.put(key(1), tensors, meta)
        got = store.get(key(1))
        assert_same_unit(got, (tensors, meta))
        got[0]["kv"].fill_(0)  # returned tensors are the caller's: a second read is unaffected
        assert_same_unit(store.get(key(1)), (tensors, meta))
        (blob,) = blob_files(tmp_path)
        assert blob.read_bytes()[:8] == b"DSV41PU\x00" and blob.name == f"{key(1)}.bin"


def test_a_valid_blob_under_another_units_key_is_a_miss(tmp_path):
    """The index row's checksum names the blob: a self-consistent blob of another unit in a unit's file
    (a mixed-up copy, a restore from elsewhere) is refused, not served as that unit."""
    with PersistentStore(tmp_path) as store:
        a, b = random_unit(11, nbytes=300), random_unit(12, nbytes=300)
        assert store.put(key(1), *a) and store.put(key(2), *b)
        path_a = store._blob_path(key(1))
        path_a.write_bytes(store._blob_path(key(2)).read_bytes())
        assert store.get(key(1)) is None
        assert_same_unit(store.get(key(2)), b)


def test_every_single_byte_flip_is_detected():
    blob = bytearray(encode_unit(*random_unit(2, nbytes=40)))
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CorruptBlob):
            decode_unit(bad)
    for cut in (0, 10, 64, len(blob) - 1):
        with pytest.raises(CorruptBlob):
            decode_unit(blob[:cut])
    decode_unit(blob)


# ---- keys and boundaries --------------------------------------------------------------------------------


def test_chain_hashes_prefix_property_and_sensitivity():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 129_280, (3000,), generator=g).tolist()
    salt = model_salt({"dim": 64}, 1)
    h = chain_hashes(tokens, [256, 1024, 3000], salt)
    assert len(set(h)) == 3 and all(len(x) == 32 for x in h)
    # a prefix's key does not depend on later tokens nor on which other boundaries are cut
    other = tokens[:1024] + torch.randint(0, 129_280, (500,), generator=g).tolist()
    assert chain_hashes(other, [256, 1024, 1524], salt)[:2] == h[:2]
    assert chain_hashes(tokens, [1024], salt) == [h[1]]
    assert chain_hashes(tokens, [100, 700, 1024], salt)[2] == h[1]
    # any token before the boundary matters, the salt matters
    changed = list(tokens)
    changed[1023] += 1
    hc = chain_hashes(changed, [256, 1024, 3000], salt)
    assert hc[0] == h[0] and hc[1] != h[1] and hc[2] != h[2]
    assert chain_hashes(tokens, [256], model_salt({"dim": 64}, 2)) != h[:1]
    assert chain_hashes(tokens, [256], model_salt({"dim": 65}, 1)) != h[:1]
    assert model_salt({"a": 1, "b": 2}, 1) == model_salt({"b": 2, "a": 1}, 1)
    for bad in ([0], [5, 5], [3001]):
        with pytest.raises(ValueError):
            chain_hashes(tokens, bad, salt)
    with pytest.raises(ValueError):
        chain_hashes([1, -2, 3], [3], salt)
    # every bit of a token id counts: ids 2^16 apart (the release's vocabulary has 129,280) differ
    assert chain_hashes([70_000, 5], [2], salt) != chain_hashes([70_000 - 65_536, 5], [2], salt)
    assert chain_hashes([129_279], [1], salt) != chain_hashes([129_279 - 65_536], [1], salt)


def test_unit_boundaries_are_aligned():
    assert compression_lcm([0, 0, 2, 1, 4, 128]) == 128 and compression_lcm([0, 0]) == 1
    assert unit_boundaries(10_000, interval=4096, ratio_lcm=128, ends=[9999, 5000]) == [4096, 4992, 8192, 9984]
    assert unit_boundaries(100, interval=4096, ratio_lcm=4, ends=[3, 99]) == [96]  # 3 aligns down to 0: dropped
    g = torch.Generator().manual_seed(4)
    for _ in range(50):
        n, interval, lcm = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (20_000, 5000, 130))
        ends = torch.randint(0, n + 1, (3,), generator=g).tolist()
        b = unit_boundaries(n, interval=interval, ratio_lcm=lcm, ends=ends)
        assert b == sorted(set(b)) and all(0 < x <= n and x % lcm == 0 for x in b)
        for e in ends:
            assert e - e % lcm in b or e < lcm
        assert len(b) >= n // interval - sum(k * interval < lcm for k in range(1, n // interval + 1))
    with pytest.raises(ValueError):
        unit_boundaries(10, ratio_lcm=2, ends=[11])


def test_longest_hit(tmp_path, caplog):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 129_280, (2000,), generator=g).tolist()
    salt = model_salt({"dim": 64}, 1)
    lengths = [128, 512, 1024]
    units = {n: random_unit(n) for n in lengths}
    with PersistentStore(tmp_path) as store:
        for n, k in zip(lengths, chain_hashes(tokens, lengths, salt)):
            assert store.put(k, units[n][0], units[n][1], n_tokens=n)
        # units of another model (salt) and of a different text never match
        store.put(chain_hashes(tokens, [1536], model_salt({"dim": 65}, 1))[0], *random_unit(9), n_tokens=1536)
        store.put(chain_hashes(list(reversed(tokens)), [1792], salt)[0], *random_unit(10), n_tokens=1792)
        hit = longest_hit(store, tokens + [7, 8, 9], salt, min_tokens=128)
        assert hit.n_tokens == 1024 and hit.key == chain_hashes(tokens, [1024], salt)[0]
        assert_same_unit((hit.tensors, hit.meta), units[1024])
        diverged = list(tokens)
        diverged[600] += 1
        assert longest_hit(store, diverged, salt, min_tokens=128).n_tokens == 512
        assert longest_hit(store, tokens[:1000], salt, min_tokens=128).n_tokens == 512
        assert longest_hit(store, tokens[:511], salt, min_tokens=128) is None  # only the 128-token unit: not > 128
        assert longest_hit(store, tokens, salt, min_tokens=1024) is None
        assert longest_hit(store, tokens, model_salt({"dim": 64}, 2), min_tokens=0) is None
        # a unit that fails its checks is skipped for the next shorter one
        path = tmp_path / "blobs" / hit.key.hex()[:2] / f"{hit.key.hex()}.bin"
        path.write_bytes(path.read_bytes()[:-1])
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert longest_hit(store, tokens, salt, min_tokens=128).n_tokens == 512
        assert "dropped" in caplog.text


# ---- lifetime and capacity ------------------------------------------------------------------------------


def test_ttl_counts_from_last_access(tmp_path):
    clock = FakeClock()
    store = PersistentStore(tmp_path, ttl_s=100, clock=clock, touch_interval_s=0)
    a, b = random_unit(1), random_unit(2)
    store.put(key(1), *a)
    store.put(key(2), *b)
    clock.t += 60
    assert_same_unit(store.get(key(1)), a)  # refreshes key 1 only
    clock.t += 60  # key 1 accessed 60 s ago, key 2 written 120 s ago
    assert store.contains(key(1)) and not store.contains(key(2))
    assert store.get(key(2)) is None
    assert_same_unit(store.get(key(1)), a)
    clock.t += 101
    assert store.purge_expired() == 1
    st = store.stats()
    assert st["entries"] == 0 and st["expired"] == 2 and blob_files(tmp_path) == []
    store.close()


def test_touch_interval_limits_index_writes(tmp_path):
    clock = FakeClock()
    store = PersistentStore(tmp_path, ttl_s=100, clock=clock, touch_interval_s=30)
    store.put(key(1), *random_unit(1))
    clock.t += 20
    store.get(key(1))  # within the touch interval: last access stays at the write
    clock.t += 90
    assert store.get(key(1)) is None
    store.put(key(2), *random_unit(2))
    clock.t += 40
    store.get(key(2))  # refreshed
    clock.t += 90
    assert store.get(key(2)) is not None
    store.close()


def test_lru_eviction_order(tmp_path):
    clock = FakeClock()
    size = len(encode_unit(*random_unit(0, nbytes=1000)))
    store = PersistentStore(tmp_path, capacity_bytes=3 * size, clock=clock, touch_interval_s=0)
    units = {i: random_unit(i, nbytes=1000) for i in range(6)}
    for i in range(3):
        clock.t += 1
        assert store.put(key(i), *units[i])
    clock.t += 1
    store.get(key(0))  # order by last access is now 1, 2, 0
    for i, evicted in ((3, 1), (4, 2), (5, 0)):
        clock.t += 1
        assert store.put(key(i), *units[i])
        assert not store.contains(key(evicted)) and store.get(key(evicted)) is None
        clock.t += 1
    st = store.stats()
    assert st["entries"] == 3 and st["bytes"] == 3 * size and st["evictions"] == 3
    for i in (3, 4, 5):
        assert_same_unit(store.get(key(i)), units[i])
    assert len(blob_files(tmp_path)) == 3
    assert not store.put(key(9), *random_unit(9, nbytes=4 * size))  # larger than the whole store
    assert store.stats()["entries"] == 3
    store.close()


def test_put_same_key_twice_writes_once(tmp_path):
    store = PersistentStore(tmp_path)
    unit = random_unit(1)
    assert store.put(bytes.fromhex(key(1)), *unit) and store.put(key(1), *unit)  # bytes and hex name one key
    assert store.stats()["bytes_written"] == store.stats()["bytes"] > 0
    other = random_unit(2)
    assert store.put(key(1), *other)  # different content under one key: replaced
    assert_same_unit(store.get(key(1)), other)
    assert store.delete(key(1)) and not store.delete(key(1)) and blob_files(tmp_path) == []
    with pytest.raises(ValueError):
        store.put("not-a-hash", *unit)
    store.close()


# ---- damage -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap", "extend"])
def test_damaged_blob_is_a_miss(tmp_path, caplog, damage):
    store = PersistentStore(tmp_path)
    units = {i: random_unit(i) for i in range(4)}
    for i, u in units.items():
        store.put(key(i), *u)
    path = tmp_path / "blobs" / key(1)[:2] / f"{key(1)}.bin"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "delete":
        path.unlink()
    elif damage == "extend":
        path.write_bytes(data + b"\x00")
    else:  # a valid blob of another key in its place
        other = tmp_path / "blobs" / key(2)[:2] / f"{key(2)}.bin"
        path.write_bytes(other.read_bytes())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(key(1)) is None
        assert store.get(key(1)) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and key(1)[:16] in warnings[0].getMessage()
    assert not store.contains(key(1)) and not path.exists()
    st = store.stats()
    assert st["corrupt_dropped"] == 1 and st["entries"] == 3 and st["misses"] == 2
    for i in (0, 2, 3):
        assert_same_unit(store.get(key(i)), units[i])
    store.close()


def test_verify_all_drops_only_bad_blobs(tmp_path):
    store = PersistentStore(tmp_path)
    units = {i: random_unit(i) for i in range(5)}
    for i, u in units.items():
        store.put(key(i), *u)
    for i in (1, 3):
        path = tmp_path / "blobs" / key(i)[:2] / f"{key(i)}.bin"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)
    assert store.verify_all() == 2
    assert store.verify_all() == 0
    assert sorted(store.keys()) == sorted(key(i) for i in (0, 2, 4))
    for i in (0, 2, 4):
        assert_same_unit(store.get(key(i)), units[i])
    store.close()


def test_disk_full_put_fails_softly(tmp_path, caplog, monkeypatch):
    store = PersistentStore(tmp_path)
    old = random_unit(1)
    assert store.put(key(1), *old)
    real_write = os.write

    def half_then_enospc(fd, data):
        if len(data) > 1:  # write part of the buffer, then run out of space
            return real_write(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monkeypatch.setattr(os, "write", half_then_enospc)
        results = [store.put(key(i), *random_unit(i)) for i in (2, 3, 4)]
        monkeypatch.setattr(os, "write", real_write)
    assert results == [False, False, False]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert "No space left" in caplog.text
    assert blob_files(tmp_path) == [tmp_path / "blobs" / key(1)[:2] / f"{key(1)}.bin"]  # no temp file left
    assert_same_unit(store.get(key(1)), old)
    assert store.stats()["write_errors"] == 3 and store.stats()["entries"] == 1
    assert store.put(key(2), *random_unit(2))  # space is back
    store.close()


def test_open_cleans_orphans_and_keeps_live_temp_files(tmp_path):
    store = PersistentStore(tmp_path)
    for i in range(3):
        store.put(key(i), *random_unit(i))
    store.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    sub = tmp_path / "blobs" / "ab"
    sub.mkdir(exist_ok=True)
    dead_tmp = sub / f".tmp-{int(dead.stdout)}-{'0' * 32}.bin"
    live_tmp = sub / f".tmp-{os.getpid()}-{'1' * 32}.bin"  # a writer of this (live) process, mid-write
    orphan = sub / f"ab{'2' * 62}.bin"  # renamed into place, then the writer died before committing
    for p in (dead_tmp, live_tmp, orphan):
        p.write_bytes(encode_unit(*random_unit(7)))
    (tmp_path / "blobs" / key(1)[:2] / f"{key(1)}.bin").unlink()  # a row whose blob vanished
    store = PersistentStore(tmp_path)
    assert not dead_tmp.exists() and not orphan.exists() and live_tmp.exists()
    st = store.stats()
    assert st["entries"] == 2 and st["temp_removed"] == 1 and st["orphans_removed"] == 1
    assert sorted(store.keys()) == sorted([key(0), key(2)])
    store.close()


# ---- sharing --------------------------------------------------------------------------------------------


def test_threads_and_two_stores_share_a_root(tmp_path):
    a, b = PersistentStore(tmp_path), PersistentStore(tmp_path)
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(t * 100, t * 100 + 15):
            unit = random_unit(i)
            mine, other = (a, b) if (i + t) % 2 else (b, a)
            if not mine.put(key(i), *unit):
                errors.append(f"put {i}")
            got = other.get(key(i))
            if got is None:
                errors.append(f"get {i}")
            else:
                try:
                    assert_same_unit(got, unit)
                except AssertionError:
                    errors.append(f"bytes {i}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert a.stats()["entries"] == b.stats()["entries"] == 60
    a.close()
    b.close()


def test_default_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c" / "prefix"
    monkeypatch.delenv("DSV41_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_root() == tmp_path / "x" / "dsv41" / "prefix"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_cache_root() == tmp_path / "h" / ".cache" / "dsv41" / "prefix"


# ---- crash safety ---------------------------------------------------------------------------------------


def test_verifier_detects_damage(tmp_path):
    """The crash check itself must be able to fail: a lost row and a corrupt blob are both reported."""
    store = PersistentStore(tmp_path)
    keys = [crash_writer.key_for(99, i) for i in range(4)]
    for k in keys:
        store.put(k, *crash_writer.unit_for(k))
    store.close()
    path = tmp_path / "blobs" / keys[0][:2] / f"{keys[0]}.bin"
    path.write_bytes(path.read_bytes()[:-3])
    counts = crash_writer.verify(tmp_path, keys + [crash_writer.key_for(99, 9)], set(), full=True, strict=True)
    assert counts["committed_lost"] == 2 and counts["rows_read"] == 3


def test_sigkill_never_serves_corrupt_units(tmp_path):
    """20 writers SIGKILLed at random moments (two overlap); after each kill the store is reopened and every
    committed key must read back exactly, no row may be unreadable, no temp file or orphan may survive."""
    seed = int.from_bytes(os.urandom(2), "little")  # a fresh schedule each run; printed to replay a failure
    counts = crash_writer.run_crash_rounds(tmp_path, kills=20, seed=seed)
    print(seed, counts)
    for name in ("corrupt_served", "rows_unreadable", "committed_lost", "temp_left", "orphans_left",
                 "writer_mismatches", "writers_died"):
        assert counts[name] == 0, (name, seed, counts)
    assert counts["committed_total"] > 20 and counts["rows_read"] >= counts["committed_total"]
