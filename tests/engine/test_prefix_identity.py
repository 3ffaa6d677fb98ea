"""Prefix-cache identity and reuse (issue 17, acceptance 1): other weights of the same preset and other tenants
never hit; a shared system prompt and a chat's history hit; the anchor lookup never scans the index; eviction and
expiry never leave a unit whose parent is gone."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from dsv41 import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import PersistentStore, chain_hashes
from dsv41.engine.sampling import SamplingParams
from dsv41.fingerprint import SIDE_FILE, checkpoint_fingerprint, model_identity, tensor_fingerprint
from dsv41.model.transformer import Transformer
from dsv41.train.tokenizer import load_tokenizer

SYSTEM = ("You are the harbour master's assistant. Answer questions about tides, moorings and the ferry "
          "timetable, briefly and politely, and say so when you do not know.")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    torch.set_num_threads(1)  # the engine runs here: one thread (two spin against each other on a busy box)
    yield


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def tiny(seed: int) -> Transformer:
    return Transformer(load_config("tiny")).init_weights(seed=seed).eval()


def run(engine: Engine, prompt: list[int], namespace: str | None = None, max_tokens: int = 2):
    req = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), namespace=namespace)
    while not req.finished:
        engine.step()
    return req


def random_prompt(seed: int, n: int) -> list[int]:
    return torch.randint(17, 16000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_other_weights_of_the_same_preset_never_hit(tmp_path, tok):
    a, b = tiny(0), tiny(1)
    assert a.config.to_dict() == b.config.to_dict() and model_identity(a, tok) != model_identity(b, tok)
    store = PersistentStore(tmp_path)
    engine_a = Engine(a, prefix_cache=PrefixCache.for_model(a, tok, store))
    engine_b = Engine(b, prefix_cache=PrefixCache.for_model(b, tok, store))
    prompt = random_prompt(1, 70)
    assert run(engine_a, prompt).cached_tokens == 0
    assert run(engine_b, prompt).cached_tokens == 0  # seed 1 must not resume seed 0's KV
    assert run(engine_a, prompt).cached_tokens > 32 and run(engine_b, prompt).cached_tokens > 32  # each its own


def test_checkpoint_fingerprint_names_the_bytes_and_is_cached(tmp_path):
    for name, data in (("one", b"\x01" * 1000), ("two", b"\x01" * 999 + b"\x02")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(data)
    one, two = checkpoint_fingerprint(tmp_path / "one"), checkpoint_fingerprint(tmp_path / "two")
    assert one != two and len(one) == 64
    assert (tmp_path / "one" / SIDE_FILE).exists() and checkpoint_fingerprint(tmp_path / "one") == one
    (tmp_path / "one" / "model.safetensors").write_bytes(b"\x03" * 1001)  # changed file: hashed again
    assert checkpoint_fingerprint(tmp_path / "one") not in (one, two)
    assert tensor_fingerprint(tiny(0)) == tensor_fingerprint(tiny(0)) != tensor_fingerprint(tiny(1))


def test_two_namespaces_never_share_a_hit(tmp_path, tok):
    model = tiny(2)
    engine = Engine(model, prefix_cache=PrefixCache.for_model(model, tok, PersistentStore(tmp_path)))
    prompt = random_prompt(2, 70)
    assert run(engine, prompt, namespace="tenant-a").cached_tokens == 0
    assert run(engine, prompt, namespace="tenant-b").cached_tokens == 0  # another tenant learns nothing
    assert run(engine, prompt, namespace="tenant-a").cached_tokens > 32  # its own tenant hits
    assert run(engine, prompt, namespace=None).cached_tokens == 0  # nor does the default namespace


def test_same_system_prompt_with_another_question_hits_the_system_prompt(tmp_path, tok):
    model = tiny(3)
    engine = Engine(model, prefix_cache=PrefixCache.for_model(model, tok, PersistentStore(tmp_path)))
    first = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}])
    second = tok.encode_chat([{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Where can I moor a small yacht overnight?"}])
    system_end = tok.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert second[:len(system_end)] == first[:len(system_end)] and len(system_end) > 32
    run(engine, first)
    req = run(engine, second)
    lcm = engine.prefix_cache.lcm
    assert len(system_end) - lcm < req.cached_tokens <= len(system_end) + lcm, (req.cached_tokens, len(system_end))


def test_multi_turn_chat_with_effort_hits_the_history_sent_as_clients_send_it(tmp_path, tok):
    model = tiny(4)
    engine = Engine(model, prefix_cache=PrefixCache.for_model(model, tok, PersistentStore(tmp_path)))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide today?"}]
    turn1 = tok.encode_chat(history, reasoning_effort=75)
    req1 = run(engine, turn1, max_tokens=6)
    reply = tok.decode(req1.output, skip_special=True)
    # a standard client: the reply sent back as plain content, no effort field, a new effort for the new turn
    history2 = history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]
    turn2 = tok.encode_chat(history2, reasoning_effort=50)
    shared = tok.encode_chat(history, add_generation_prompt=False)  # up to the first question's <|end|>
    assert turn2[:len(shared)] == turn1[:len(shared)] and turn2[len(shared)] != turn1[len(shared)]
    req2 = run(engine, turn2)
    assert req2.cached_tokens >= len(shared) - engine.prefix_cache.lcm, (req2.cached_tokens, len(shared))


def test_lookup_uses_the_anchor_index_never_a_scan(tmp_path):
    store = PersistentStore(tmp_path)
    store.lengths_under(["ab" * 32])
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        plan = " ".join(str(r) for r in db.execute(
            "EXPLAIN QUERY PLAN SELECT DISTINCT n_tokens FROM units WHERE anchor IN (?, ?) AND last_access >= ?",
            ("a" * 64, "b" * 64, 0.0)))
        assert "units_anchor" in plan and "SCAN units" not in plan, plan
        plan = " ".join(str(r) for r in db.execute(
            "EXPLAIN QUERY PLAN SELECT hash FROM units WHERE last_access >= ? AND hash IN (?, ?)",
            (0.0, "a" * 64, "b" * 64)))
        assert "SCAN units" not in plan, plan


# ---- parents: never a unit without its parent ---------------------------------------------------------------


def unit(seed: int, nbytes: int = 4000):
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)}


def assert_no_orphans(store: PersistentStore) -> None:
    parents = store.parents()
    stranded = {k: p for k, p in parents.items() if p is not None and p not in parents}
    assert not stranded, f"{len(stranded)} units whose parent is gone"


def test_eviction_takes_leaves_first_and_never_strands_a_unit(tmp_path):
    g = torch.Generator().manual_seed(5)
    store = PersistentStore(tmp_path, capacity_bytes=40 * 4200)
    tips: list[tuple[str, int]] = []  # (key, depth) of chain ends to extend
    evicted_before = 0
    for i in range(300):
        if tips and torch.rand((), generator=g) < 0.7:
            parent, depth = tips.pop(int(torch.randint(len(tips), (1,), generator=g)))
        else:
            parent, depth = None, 0
        key = chain_hashes([i], [1], b"evict")[0].hex()
        ok = store.put(key, unit(i), {"n_tokens": depth + 1, "parent": parent})
        if ok:
            tips.append((key, depth + 1))
        else:
            assert parent is not None and parent not in store.parents()  # refused only as an orphan
        assert_no_orphans(store)
        if store.stats()["evictions"] > evicted_before:
            evicted_before = store.stats()["evictions"]
    assert store.stats()["evictions"] > 100 and store.stats()["orphans_refused"] > 0
    assert max(d for _, d in tips) >= 3  # chains did grow
    parents = store.parents()
    assert any(p is not None for p in parents.values())


def test_expiry_and_delete_take_descendants_along(tmp_path):
    clock = [1000.0]
    store = PersistentStore(tmp_path, ttl_s=100, clock=lambda: clock[0], touch_interval_s=0)
    keys = [chain_hashes([i], [1], b"ttl")[0].hex() for i in range(5)]
    assert store.put(keys[0], unit(0), {"n_tokens": 1})
    assert store.put(keys[1], unit(1), {"n_tokens": 2, "parent": keys[0]})
    assert store.put(keys[2], unit(2), {"n_tokens": 3, "parent": keys[1]})
    assert store.put(keys[3], unit(3), {"n_tokens": 2, "parent": keys[0]})
    assert not store.put(keys[4], unit(4), {"n_tokens": 9, "parent": "ee" * 32})  # parent never stored
    clock[0] += 60
    store.touch([keys[2]])  # the leaf is fresh, its ancestors are not
    clock[0] += 60
    assert store.purge_expired() == 4  # the root expired: the whole tree goes, fresh leaf included
    assert store.parents() == {}
    for i in range(3):
        assert store.put(keys[i], unit(i), {"n_tokens": i + 1, "parent": keys[i - 1] if i else None})
    assert store.delete(keys[1]) and store.parents() == {keys[0]: None}
    assert_no_orphans(store)


def test_a_save_without_a_namespace_keeps_the_one_its_sequence_was_resumed_under(tmp_path):
    """`PrefixCache.save(seq, ends)` with no namespace files the units under the namespace `resume` was given for
    that sequence: the tenant hits them, the default namespace and another tenant never do."""
    from dsv41.engine.cache import SequenceCache, private_pools
    from dsv41.engine.prefill import prefill
    from dsv41.engine.runner import Runner

    model = tiny(5)
    c = model.config
    cache = PrefixCache(c, PersistentStore(tmp_path / "store"))
    prompt = random_prompt(7, 3 * c.window_size)

    def fresh() -> SequenceCache:
        return SequenceCache(c, pools=private_pools(c, "cpu", max_tokens=len(prompt) + 8))

    seq = fresh()
    assert cache.resume(seq, prompt, namespace="tenant-a") is None
    prefill(Runner(model), seq, prompt)
    cache.save(seq, ends=[len(prompt)])  # no namespace given
    assert cache.flush(timeout=30)

    def cached(namespace) -> int:
        found = cache.resume(fresh(), prompt + [5], namespace=namespace)
        return 0 if found is None else found.cached_tokens

    assert cached(None) == 0 and cached("tenant-b") == 0
    assert cached("tenant-a") > c.window_size


def test_the_images_of_a_request_name_its_units_in_prompt_order():
    """`image_namespace`: the same images in another order (or other images) at the same placeholder tokens give
    another namespace — a unit holds the encoder's output of those images, in that order."""
    from dsv41.engine.prefix import image_namespace

    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    names = {image_namespace("tenant", [a, b]), image_namespace("tenant", [b, a]), image_namespace("tenant", [a]),
             image_namespace("tenant", [a, a]), image_namespace("other", [a, b]), image_namespace(None, [a, b])}
    assert len(names) == 6
    assert image_namespace("tenant", []) == "tenant"  # no images: the request's own namespace
