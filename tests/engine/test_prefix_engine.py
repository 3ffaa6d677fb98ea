"""Prefix cache in the engine: warm hits equal cold runs; global-only hits replay exactly n_win tokens
and never rewrite cached global KV."""

from __future__ import annotations

import hashlib
import sqlite3

import torch
from tests.conftest import engine_test_model

from dsv41.engine.cache import SequenceCache
from dsv41.engine.engine import Engine
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore
from dsv41.engine.sampling import SamplingParams
from dsv41.model.transformer import Transformer


def checksums(root) -> dict[str, str]:
    """Index checksums and an independent SHA-256 of every blob file on disk."""
    with sqlite3.connect(root / "index.sqlite") as db:
        index = {f"index:{k}": v for k, v in db.execute("SELECT hash, checksum FROM units").fetchall()}
    files = {f"file:{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "blobs").rglob("*.bin")}
    return {**index, **files}


def conversation(model: Transformer, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    W = model.config.window_size
    first = torch.randint(3, V, (3 * W + 7,), generator=g).tolist()
    follow_up = torch.randint(3, V, (W + 9,), generator=g).tolist()  # suffix ≥ n_win
    return first, follow_up


def test_warm_hit_equals_cold_run_token_for_token(tmp_path):
    torch.manual_seed(21)
    model = engine_test_model(21)
    cache = PrefixCache(model.config, PersistentStore(tmp_path), InProcessSWAPool())
    engine = Engine(model, prefix_cache=cache)
    first, follow_up = conversation(model, 21)
    out1 = engine.generate([first], max_tokens=9)[0]
    turn2 = first + out1 + follow_up
    warm_req = engine.add_request(turn2, SamplingParams(max_tokens=12))
    while not warm_req.finished:
        engine.step()
    cold = Engine(model).generate([turn2], max_tokens=12)[0]
    assert warm_req.output == cold
    assert warm_req.cached_tokens >= len(first) + len(out1) - 1 - cache.lcm and warm_req.replayed_tokens == 0
    m = engine.metrics()
    assert m["hits"] == 1 and m["exact_resumes"] == 1 and m["pool"]["hits"] == 1
    # units hold exactly the packed global KV: bytes per cached token = the cache's measured bytes per token
    assert m["bytes_per_cached_token"] == SequenceCache(model.config).bytes_per_token()


def test_global_only_hit_replays_exactly_n_win_and_rewrites_nothing(tmp_path):
    torch.manual_seed(22)
    model = engine_test_model(22)
    W = model.config.window_size
    pool = InProcessSWAPool()
    cache = PrefixCache(model.config, PersistentStore(tmp_path), pool)
    engine = Engine(model, prefix_cache=cache)
    first, follow_up = conversation(model, 22)
    out1 = engine.generate([first], max_tokens=9)[0]
    before = checksums(tmp_path)
    pool.clear()
    turn2 = first + out1 + follow_up
    req = engine.add_request(turn2, SamplingParams(max_tokens=1))
    engine.step()
    assert req.replayed_tokens == W and cache.stats.replayed_tokens == W
    assert req.cached_tokens > W
    after = checksums(tmp_path)
    assert all(after[k] == v for k, v in before.items()), "a cached unit was rewritten"
    assert set(after) > set(before), "the new turn's units are stored"
    # first-token distribution vs a cold run: approximate by design, but close
    cold_logits = _first_logits(Engine(model), turn2)
    hit_logits = _first_logits(Engine(model, prefix_cache=PrefixCache(model.config, PersistentStore(tmp_path),
                                                                       InProcessSWAPool())), turn2)
    kl = torch.sum(cold_logits.softmax(-1) * (cold_logits.log_softmax(-1) - hit_logits.log_softmax(-1))).item()
    print(f"first-token KL(cold || global-only hit) = {kl:.4g}")
    assert 0 <= kl < 0.5


def _first_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    captured = {}
    original = engine._emit

    def capture(reqs, logits, *sampled):
        captured.setdefault("logits", logits[0].clone())
        return original(reqs, logits, *sampled)

    engine._emit = capture
    engine.generate([prompt], max_tokens=1)
    return captured["logits"]


def test_short_hits_are_not_adopted_and_misses_are_counted(tmp_path):
    model = engine_test_model(23)
    cache = PrefixCache(model.config, PersistentStore(tmp_path), InProcessSWAPool())
    engine = Engine(model, prefix_cache=cache)
    W = model.config.window_size
    short = torch.randint(3, model.config.vocab_size, (W - 2,)).tolist()
    engine.generate([short], max_tokens=2)
    req = engine.add_request(short + [5, 6, 7], SamplingParams(max_tokens=1))
    engine.step()
    assert req.cached_tokens == 0 and cache.stats.hits == 0 and cache.stats.misses == 2


def test_unreachable_redis_pool_still_serves_via_replay(tmp_path, caplog):
    import socket

    from dsv41.engine.prefix_store import RedisSWAPool

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = engine_test_model(24)
    cache = PrefixCache(model.config, PersistentStore(tmp_path), RedisSWAPool(f"redis://127.0.0.1:{port}/0"))
    engine = Engine(model, prefix_cache=cache)
    first, follow_up = conversation(model, 24)
    out1 = engine.generate([first], max_tokens=4)[0]
    req = engine.add_request(first + out1 + follow_up, SamplingParams(max_tokens=2))
    while not req.finished:
        engine.step()
    assert len(req.output) == 2 and req.replayed_tokens == model.config.window_size
    warnings = [r for r in caplog.records if "redis" in r.getMessage().lower()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_failing_disk_serves_without_persisting(tmp_path, monkeypatch):
    import errno
    import os

    model = engine_test_model(25)
    store = PersistentStore(tmp_path)
    engine = Engine(model, prefix_cache=PrefixCache(model.config, store, InProcessSWAPool()))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    first, _ = conversation(model, 25)
    out = engine.generate([first], max_tokens=5)[0]
    monkeypatch.undo()
    assert len(out) == 5
    assert store.stats()["entries"] == 0 and store.stats()["write_errors"] > 0
