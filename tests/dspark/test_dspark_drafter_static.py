"""The DSpark drafter's fixed device state and static propose against the per-sequence eager drafter.

The reference (`_EagerReference`) is the drafter as it was before the static form: one (W, D) ring per
sequence and stage, `observe` one sequence at a time, `propose` stacking the rings of the batch — no
pool, no slots, no padding. On a tiny random drafter (fp32, CPU):
  (a) `observe_many` leaves the rings the placement rule gives (bit-equal, keys of the same batched call)
      and the counts and rings of `observe` row by row (equal counts; rings within a few ulps: the CPU
      GEMM's last bit depends on how many rows share a product), random T and keep (0 and T included,
      T past the window too);
  (b) the padded static propose drafts what the reference drafts (tokens equal, confidences 1e-6) for
      batches of 1, 3, 5 with observed counts below and past the window;
  (c) a finished sequence's slot is reused (its stale ring rows are masked), a full pool is a clear error;
  (d) padding rows and dropped positions touch only the dummy slot, and garbage there changes no live row;
  (e) the hand-over's commit padded to the graph shapes (Bb > B, Tb > T, stale rows full of garbage) leaves
      every live ring bit-equal and every count equal to the unpadded commit.
The GPU tests: CUDA-graph replay = eager propose (fp32 and bf16), graphed observe_many = eager (fp32 bit-equal,
bf16 1e-2) over successive calls of other B, T and keep, and neither replay makes a host sync.
"""

from __future__ import annotations

import time

import pytest
import torch
from tests.conftest import BF16_RTOL, assert_close, randomize_mixing

from dsv41.config import load_config, with_dspark
from dsv41.engine.dspark_drafter import DrafterFull, DSparkDrafter, Proposal
from dsv41.model.dspark import DSpark
from dsv41.model.transformer import Transformer

WINDOW = 8


def _models(seed: int) -> tuple[Transformer, DSpark]:
    c = with_dspark(load_config("tiny").replace(window_size=WINDOW))
    main = Transformer(c).init_weights(seed=seed).eval()
    randomize_mixing(main, seed)
    drafter = DSpark(c).init_weights(seed=seed + 1).bind(main).eval()
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for stage in drafter.mtp:  # init leaves sinks zero and mixing near-identity: make every part count
            stage.attn.attn_sink.normal_(0, 1.0, generator=g)
            for which in ("attn", "ffn"):
                getattr(stage, f"hc_{which}_fn").normal_(0, 0.05, generator=g)
                getattr(stage, f"hc_{which}_base").normal_(0, 0.5, generator=g)
    return main, drafter


class _EagerReference:
    """The pre-static drafter: per-sequence rings, one sequence per observe, rings stacked per propose."""

    def __init__(self, drafter: DSpark):
        self.drafter, self.window = drafter, drafter.window
        self.rings: dict[int, list[torch.Tensor]] = {}
        self.observed: dict[int, int] = {}

    def start(self, seq: int) -> None:
        D = self.drafter.config.head_dim
        self.rings[seq] = [torch.zeros(self.window, D) for _ in self.drafter.mtp]
        self.observed[seq] = 0

    @torch.no_grad()
    def observe(self, seq: int, tokens: torch.Tensor, features: dict[int, torch.Tensor]) -> None:
        n = int(tokens.numel())
        if n == 0:
            return
        rows = torch.cat([features[i] for i in self.drafter.target_layer_ids], dim=-1)  # (m, F)
        keep = min(rows.size(0), self.window)
        rows = rows[rows.size(0) - keep:]
        first = self.observed[seq] + n - keep
        positions = torch.arange(first, first + keep).unsqueeze(0)  # (1, keep)
        main_x = self.drafter.main_x(rows.unsqueeze(0))  # (1, keep, dim)
        for ring, kv in zip(self.rings[seq], self.drafter.context_keys(main_x, positions)):
            ring[positions[0] % self.window] = kv[0]
        self.observed[seq] += n

    @torch.no_grad()
    def propose(self, seqs: list[int], last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        observed = torch.tensor([self.observed[s] for s in seqs])  # (B,)
        valid = (torch.arange(self.window).unsqueeze(0) < observed.unsqueeze(1)).unsqueeze(1)  # (B, 1, W)
        contexts = [(torch.stack([self.rings[s][k] for s in seqs]).unsqueeze(1), valid)
                    for k in range(len(self.drafter.mtp))]
        anchors = last_tokens.long().view(-1, 1)  # (B, 1)
        hidden = self.drafter.block_hidden(anchors, observed.view(-1, 1), contexts)  # (B, 1, K, dim)
        tokens, _, conf = self.drafter.sample(hidden[:, 0], anchors[:, 0])
        return tokens, torch.sigmoid(conf)


def _features(drafter: DSpark, shape: tuple[int, ...], g: torch.Generator) -> dict[int, torch.Tensor]:
    return {i: torch.randn(*shape, drafter.config.dim, generator=g) for i in drafter.target_layer_ids}


def _prefill(drafters, seq: int, n: int, drafter: DSpark, g: torch.Generator) -> None:
    """A prompt of n tokens, features of its last min(n, W + 2) positions (the bounded-replay hand-over)."""
    tokens = torch.randint(17, 16384, (n,), generator=g)
    feats = _features(drafter, (min(n, WINDOW + 2),), g)
    for d in drafters:
        d.start(seq)
        d.observe(seq, tokens, feats)


def _pool_rows(static: DSparkDrafter, seq: int) -> list[torch.Tensor]:
    return [ring[static.slot(seq)] for ring in static.rings]


def _placed(drafter: DSpark, before: list[torch.Tensor], slots: list[int], starts: list[int], feats, keep):
    """The rings after a block, placed row by row with the old observe's rule (each row's last min(keep, W)
    positions at position % W) from keys computed for the whole (B, T) block in one call — the batched
    numerics, so the expected rings are exact."""
    B, T = next(iter(feats.values())).shape[:2]
    positions = torch.tensor(starts).unsqueeze(1) + torch.arange(T)  # (B, T)
    rows = torch.cat([feats[i] for i in drafter.target_layer_ids], dim=-1)  # (B, T, F)
    keys = drafter.context_keys(drafter.main_x(rows), positions)  # [(B, T, D)] per stage
    after = [ring.clone() for ring in before]
    for ring, kv in zip(after, keys):
        for b, (slot, n) in enumerate(zip(slots, keep)):
            for t in range(max(0, n - WINDOW), n):
                ring[slot, int(positions[b, t]) % WINDOW] = kv[b, t]
    return after


@torch.no_grad()
def test_observe_many_equals_row_by_row_observe():
    """Exact against the placement rule; row-by-row `observe` within a few ulps. Bit-equality with the
    row-by-row calls cannot hold on the CPU: MKL picks other GEMM kernels for 1-3 rows and splits rows
    over threads (measured: products of 1-3 rows, and of 5-11 rows on 2 threads, differ in the last bit
    from the same rows inside a larger product; 1.1e-6 max on these rings)."""
    _, drafter = _models(seed=10)
    g = torch.Generator().manual_seed(11)
    batched, single = DSparkDrafter(drafter, max_sequences=6), DSparkDrafter(drafter, max_sequences=6)
    reference = _EagerReference(drafter)
    seqs = [4, 9, 2, 7, 5]
    for s, n in zip(seqs, (3, 11, 1, 20, 7)):
        _prefill([batched, single, reference], s, n, drafter, g)
    seen_keep, worst = set(), 0.0
    for step in range(8):
        ids = [seqs[i] for i in torch.randperm(len(seqs), generator=g)[: 2 + step % 4].tolist()]
        T = int(torch.randint(1, WINDOW + 4, (1,), generator=g))  # past the window too: only the last W land
        keep = torch.randint(0, T + 1, (len(ids),), generator=g).tolist()
        keep[0], keep[-1] = 0, T  # both ends every step
        seen_keep.update(n == T for n in keep)
        tokens = torch.randint(17, 16384, (len(ids), T), generator=g)
        feats = _features(drafter, (len(ids), T), g)
        slots = [batched.slot(s) for s in ids]
        live = [ring[:batched.dummy] for ring in batched.rings]  # the dummy slot is scratch
        want = _placed(drafter, live, slots, [batched.observed_host[x] for x in slots], feats, keep)
        batched.observe_many(ids, tokens, feats, keep)
        for k, (got, exp) in enumerate(zip(batched.rings, want)):
            if not torch.equal(got[:batched.dummy], exp):
                err = (got[:batched.dummy] - exp).abs().max().item()
                raise AssertionError(f"step {step} stage {k}: rings ≠ the placement rule, max err {err:.3e}")
        for b, (s, n) in enumerate(zip(ids, keep)):
            single.observe(s, tokens[b, :n], {i: f[b, :n] for i, f in feats.items()})
            reference.observe(s, tokens[b, :n], {i: f[b, :n] for i, f in feats.items()})
        for s in seqs:
            slot = batched.slot(s)
            assert slot == single.slot(s)
            assert batched.observed_host[slot] == single.observed_host[slot] == reference.observed[s]
            assert int(batched.observed[slot]) == reference.observed[s], "device counts follow the host's"
            for k, (got, one, ref) in enumerate(zip(_pool_rows(batched, s), _pool_rows(single, s), reference.rings[s])):
                assert torch.equal(one, ref), f"step {step} sequence {s}: observe ≠ the eager reference"
                # a wrong slot or position is off by O(1); the batched GEMM by a few ulps of O(1) keys
                assert_close(got, one, rtol=1e-5, atol=1e-5, what=f"step {step} sequence {s} stage {k}")
                worst = max(worst, (got - one).abs().max().item())
    assert seen_keep == {True, False}
    assert max(reference.observed.values()) > 2 * WINDOW  # the rings wrapped
    print(f"observe_many vs row-by-row observe: max |err| {worst:.2e}")


@torch.no_grad()
@torch.no_grad()
def test_observe_many_skipping_positions_equals_observe_of_more_tokens_than_features():
    """`observe_many(..., skip=)` (the engine's catch-up of rows more than a window behind): row b's block lands
    skip[b] positions after what it observed — the counts and rings of the eager reference's `observe` of
    skip[b] + W tokens with the last W positions' features, and a proposal from them the same; rows without a skip
    in the same call as `observe_many` alone. A skip with a block short of the window is refused."""
    _, drafter = _models(seed=12)
    g = torch.Generator().manual_seed(13)
    static, reference = DSparkDrafter(drafter, max_sequences=4), _EagerReference(drafter)
    ids = [3, 8, 6]
    for s, n in zip(ids, (5, WINDOW + 3, 2 * WINDOW)):
        _prefill([static, reference], s, n, drafter, g)
    skip, keep = [WINDOW + 9, 0, 1], [WINDOW, 4, WINDOW]
    tokens = torch.randint(17, 16384, (3, WINDOW), generator=g)
    feats = _features(drafter, (3, WINDOW), g)
    static.observe_many(ids, tokens, feats, keep, skip)
    for b, s in enumerate(ids):
        lead = torch.randint(17, 16384, (skip[b],), generator=g)  # the skipped tokens: their features never come
        reference.observe(s, torch.cat([lead, tokens[b, :keep[b]]]), {i: f[b, :keep[b]] for i, f in feats.items()})
    for s in ids:
        slot = static.slot(s)
        assert static.observed_host[slot] == int(static.observed[slot]) == reference.observed[s]
        for k, (got, want) in enumerate(zip(_pool_rows(static, s), reference.rings[s])):
            assert_close(got, want, rtol=1e-5, atol=1e-5, what=f"sequence {s} stage {k}")
    last = torch.randint(17, 16384, (3,), generator=g)
    assert torch.equal(static.propose(ids, last).tokens, reference.propose(ids, last)[0])
    with pytest.raises(ValueError, match="skip"):
        static.observe_many(ids[:1], tokens[:1, :4], {i: f[:1, :4] for i, f in feats.items()}, [4], [2])


@pytest.mark.parametrize("B", [1, 3, 5])
def test_static_propose_on_a_padded_batch_equals_the_eager_reference(B):
    _, drafter = _models(seed=20 + B)
    g = torch.Generator().manual_seed(30 + B)
    static, reference = DSparkDrafter(drafter, max_sequences=8), _EagerReference(drafter)
    lengths = [2, WINDOW + 5, 1, 3 * WINDOW + 1, WINDOW - 1, 5, WINDOW][:B + 2]  # some < W, some > W
    ids = list(range(100, 100 + len(lengths)))
    for s, n in zip(ids, lengths):
        _prefill([static, reference], s, n, drafter, g)
    # one verification's observation, then a proposal for B of the sequences in a scrambled order
    T = drafter.block_size + 1
    keep = torch.randint(0, T + 1, (len(ids),), generator=g).tolist()
    tokens, feats = torch.randint(17, 16384, (len(ids), T), generator=g), _features(drafter, (len(ids), T), g)
    static.observe_many(ids, tokens, feats, keep)
    for b, (s, n) in enumerate(zip(ids, keep)):
        reference.observe(s, tokens[b, :n], {i: f[b, :n] for i, f in feats.items()})
    batch = [ids[i] for i in (1, 0, 3, 5, 2, 4, 6)[:B]]  # not the start order; counts on both sides of W
    counts = [reference.observed[s] for s in batch]
    if B > 1:
        assert min(counts) < WINDOW < max(counts), counts
    last = torch.randint(17, 16384, (B,), generator=g)
    got = static.propose(batch, last)
    want_tokens, want_conf = reference.propose(batch, last)
    assert isinstance(got, Proposal) and got.probs is None
    assert got.tokens.shape == (B, drafter.block_size) and got.tokens.dtype == torch.long
    assert torch.equal(got.tokens, want_tokens), (got.tokens, want_tokens)
    assert_close(got.confidence, want_conf, rtol=1e-6, atol=1e-6, what=f"confidence at B={B}")


@torch.no_grad()
def test_sampled_propose_stays_eager_and_draws_from_its_probabilities():
    _, drafter = _models(seed=40)
    g = torch.Generator().manual_seed(41)
    sampled = DSparkDrafter(drafter, temperature=1.0, generator=torch.Generator().manual_seed(0), max_sequences=4)
    assert sampled.graphs is None
    for s, n in ((0, 5), (1, 19), (2, 3)):
        _prefill([sampled], s, n, drafter, g)
    prop = sampled.propose([2, 0, 1], torch.randint(17, 16384, (3,), generator=g))
    assert prop.probs.shape == (3, drafter.block_size, drafter.config.vocab_size)
    assert_close(prop.probs.sum(-1), torch.ones(3, drafter.block_size), what="probabilities sum to 1")
    assert bool((prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all())
    assert bool(((prop.confidence > 0) & (prop.confidence < 1)).all())


@torch.no_grad()
def test_slots_are_reused_after_finish_and_a_full_pool_is_a_clear_error():
    _, drafter = _models(seed=50)
    g = torch.Generator().manual_seed(51)
    static = DSparkDrafter(drafter, max_sequences=3)
    for s, n in ((0, 2 * WINDOW + 3), (1, 4), (2, 9)):
        _prefill([static], s, n, drafter, g)
    assert sorted(static.slot(s) for s in (0, 1, 2)) == [0, 1, 2]
    with pytest.raises(DrafterFull, match="all 3 drafter slots"):
        static.start(3)
    with pytest.raises(KeyError, match="already started"):
        static.start(1)
    freed = static.slot(0)  # its ring is full of sequence 0's keys
    static.finish(0)
    with pytest.raises(KeyError, match="not started"):
        static.propose([0], torch.tensor([20]))
    fresh = DSparkDrafter(drafter, max_sequences=3)
    prompt = torch.randint(17, 16384, (3,), generator=g)
    feats = _features(drafter, (3,), g)
    for d in (static, fresh):
        d.start(7)
        d.observe(7, prompt, feats)  # 3 < W positions: the other W − 3 rows of the reused ring are stale
    assert static.slot(7) == freed and static.observed_host[freed] == 3 and int(static.observed[freed]) == 3
    assert not torch.equal(static.rings[0][freed], fresh.rings[0][fresh.slot(7)]), "stale rows stay"
    anchor = torch.tensor([321])
    got, want = static.propose([7], anchor), fresh.propose([7], anchor)
    assert torch.equal(got.tokens, want.tokens)
    assert_close(got.confidence, want.confidence, rtol=1e-6, atol=1e-6, what="reused slot")
    static.finish(7)
    static.finish(7)  # a second finish is harmless
    assert len(static._free) == 1


@torch.no_grad()
def test_padding_rows_and_dropped_positions_touch_only_the_dummy_slot():
    _, drafter = _models(seed=60)
    g = torch.Generator().manual_seed(61)
    static = DSparkDrafter(drafter, max_sequences=8)
    ids = [0, 1, 2, 3]
    for s, n in zip(ids, (WINDOW + 2, 3, 2 * WINDOW, 6)):
        _prefill([static], s, n, drafter, g)
    live = [static.slot(s) for s in ids]
    before = [ring.clone() for ring in static.rings]
    last = torch.randint(17, 16384, (3,), generator=g)
    first = static.propose([2, 0, 3], last)  # padded to 4 rows: one reads the dummy slot
    assert all(torch.equal(a, b) for a, b in zip(static.rings, before)), "propose wrote a ring"
    # garbage in the dummy slot (finite, large) changes no live row of a padded proposal
    for ring in static.rings:
        ring[static.dummy].normal_(0, 50.0, generator=g)
    again = static.propose([2, 0, 3], last)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.confidence, first.confidence)
    before = [ring.clone() for ring in static.rings]
    # a row keeping nothing and a row keeping 2 of 6: the 4 dropped positions go to the dummy slot only
    T = 6
    static.observe_many([1, 3], torch.randint(17, 16384, (2, T), generator=g), _features(drafter, (2, T), g), [0, 2])
    W, s3 = WINDOW, static.slot(3)
    written = {(s3 * W + (static.observed_host[s3] - 2 + t) % W) for t in range(2)}
    for k, (ring, old) in enumerate(zip(static.rings, before)):
        flat, flat_old = ring.view(-1, ring.size(-1)), old.view(-1, old.size(-1))  # (slots·W, D)
        for slot in live:
            for j in range(W):
                row = slot * W + j
                same = torch.equal(flat[row], flat_old[row])
                assert same != (row in written), f"stage {k} slot {slot} row {j}: written={not same}"
        assert not torch.equal(ring[static.dummy], old[static.dummy]), "the dropped positions went somewhere else"
    assert static.observed_host[static.slot(1)] == 3 and int(static.observed[static.dummy]) == 0


@torch.no_grad()
def test_padded_commit_step_leaves_every_live_ring_and_count_as_the_unpadded_commit():
    """The graph shapes on the CPU: commits padded to (batch bucket Bb > B, power of two Tb > T), padding rows
    and stale rows-buffer positions full of garbage, against the unpadded eager commit — live rings bit-equal
    (fp32) and counts equal. One intra-op thread and ≥ 4 live rows per product: MKL's last bit then does not
    depend on how many rows share the product (measured: it does for 1-3 rows, and on 2 threads)."""
    _, drafter = _models(seed=90)
    g = torch.Generator().manual_seed(91)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager, padded = DSparkDrafter(drafter, max_sequences=8), DSparkDrafter(drafter, max_sequences=8)
        padded._pad = True  # what a CUDA drafter does (graphed or not)
        shapes = []
        step = padded._commit_step
        padded._commit_step = lambda Bb, Tb: (shapes.append((Bb, Tb)), step(Bb, Tb))
        seqs = [3, 0, 6, 1, 5, 2, 4]
        for s, n in zip(seqs, (2, WINDOW + 3, 5, 3 * WINDOW, 1, WINDOW - 1, 2 * WINDOW + 5)):
            _prefill([eager, padded], s, n, drafter, g)
        padded._rows.normal_(0, 50.0, generator=g)  # stale rows: large and finite, must be masked by count
        for ring in padded.rings:
            ring[padded.dummy].normal_(0, 50.0, generator=g)
        below = above = False
        for i, (B, T) in enumerate(((3, 3), (5, 6), (7, 5), (6, 7), (3, WINDOW + 3), (5, 3))):
            ids = [seqs[j] for j in torch.randperm(len(seqs), generator=g)[:B].tolist()]
            keep = torch.randint(0, T + 1, (B,), generator=g).tolist()
            keep[0], keep[-1] = 0, T
            tokens = torch.randint(17, 16384, (B, T), generator=g)
            feats = _features(drafter, (B, T), g)
            shapes.clear()
            for d in (eager, padded):
                d.observe_many(ids, tokens, feats, keep)
            (Bb, Tb), = shapes
            assert Bb > B and (Tb > T or T > WINDOW), (B, T, Bb, Tb)
            live = eager.dummy
            for k, (got, want) in enumerate(zip(padded.rings, eager.rings)):
                if not torch.equal(got[:live], want[:live]):
                    err = (got[:live] - want[:live]).abs().max().item()
                    raise AssertionError(f"step {i} (B={B}, T={T} at {Bb}×{Tb}) stage {k}: live rings differ, "
                                         f"max err {err:.3e}")
            assert torch.equal(padded.observed[:live], eager.observed[:live]), (padded.observed, eager.observed)
            assert padded.observed_host[:live] == eager.observed_host[:live]
            counts = [eager.observed_host[eager.slot(s)] for s in ids]
            below, above = below or min(counts) < WINDOW, above or max(counts) > WINDOW
        assert below and above
    finally:
        torch.set_num_threads(threads)


def test_observe_many_with_device_counts_equals_observe_many():
    """`observe_many_device` (the counts a device tensor: the engine's greedy acceptance, read later) commits what
    `observe_many` with the same counts commits — rings and device counts bit-equal, proposals equal — and leaves the
    host mirror until `observed_more` moves it to the same counts; bad input is a clear error."""
    _, drafter = _models(seed=95)
    g = torch.Generator().manual_seed(96)
    host, device = DSparkDrafter(drafter, max_sequences=4), DSparkDrafter(drafter, max_sequences=4)
    seqs = [2, 0, 3]
    for s, n in zip(seqs, (3, WINDOW + 2, 2 * WINDOW)):
        _prefill([host, device], s, n, drafter, g)
    T = 6
    for step in range(4):
        keep = torch.randint(1, T + 1, (len(seqs),), generator=g)
        keep[step % len(seqs)] = T
        tokens = torch.randint(17, 16384, (len(seqs), T), generator=g)
        feats = _features(drafter, (len(seqs), T), g)
        before = list(device.observed_host)
        host.observe_many(seqs, tokens, feats, keep.tolist())
        device.observe_many_device(seqs, feats, keep)
        assert device.observed_host == before  # the host has not read the counts yet
        device.observed_more(seqs, keep.tolist())
        assert device.observed_host == host.observed_host
        assert torch.equal(device.observed, host.observed)
        assert all(torch.equal(a, b) for a, b in zip(device.rings, host.rings))
    anchors = torch.randint(17, 16384, (len(seqs),), generator=g)
    assert torch.equal(device.propose(seqs, anchors).tokens, host.propose(seqs, anchors).tokens)
    with pytest.raises(ValueError, match="keep of shape"):
        device.observe_many_device(seqs, feats, keep[:2])
    with pytest.raises(ValueError, match="twice"):
        device.observe_many_device([2, 2, 0], feats, keep)
    with pytest.raises(ValueError, match="expected"):
        device.observe_many_device(seqs, {i: f[:2] for i, f in feats.items()}, keep)
    with pytest.raises(ValueError, match=f"T ≤ {WINDOW}"):  # longer than a window: its counts are not checkable
        device.observe_many_device(seqs, _features(drafter, (len(seqs), WINDOW + 1), g), keep)


def test_bad_observe_many_input_is_a_clear_error():
    _, drafter = _models(seed=70)
    static = DSparkDrafter(drafter, max_sequences=2)
    static.start(0)
    static.start(1)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    feats = _features(drafter, (2, 3), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="outside 0"):
        static.observe_many([0, 1], tokens, feats, [1, 4])
    with pytest.raises(ValueError, match="twice"):
        static.observe_many([0, 0], tokens, feats, [1, 1])
    with pytest.raises(ValueError, match="expected"):
        static.observe_many([0, 1], tokens, {i: f[:, :2] for i, f in feats.items()}, [1, 1])
    with pytest.raises(KeyError, match="not started"):
        static.observe_many([0, 5], tokens, feats, [1, 1])
    assert static.observed_host[:2] == [0, 0]


# ---------------------------------------------------------------------- GPU (the H200)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_graph_replay_equals_eager_propose_and_makes_no_host_sync(dtype):
    main, drafter = _models(seed=80)
    main.to("cuda", dtype)
    drafter.to("cuda", dtype)
    graphed = DSparkDrafter(drafter, max_sequences=16)
    eager = DSparkDrafter(drafter, max_sequences=16, cuda_graphs=False)  # same modules: the dense MoE too
    assert graphed.graphs is not None and eager.graphs is None
    assert all(m.moe_impl == "dense" for m in drafter.moe_layers())
    g = torch.Generator().manual_seed(81)
    ids = list(range(11))
    for s in ids:
        n = int(torch.randint(1, 4 * WINDOW, (1,), generator=g))
        tokens = torch.randint(17, 16384, (n,), generator=g, device="cpu").cuda()
        feats = {i: f.to("cuda", dtype) for i, f in _features(drafter, (min(n, WINDOW + 2),), g).items()}
        for d in (graphed, eager):
            d.start(s)
            d.observe(s, tokens, feats)
    rtol = 1e-5 if dtype == torch.float32 else BF16_RTOL
    timings = {}
    for B in (1, 3, 8, 11):
        batch = ids[:B][::-1]
        for step in range(3):  # replays after the capture read the rows of this call
            last = torch.randint(17, 16384, (B,), generator=g).cuda()
            want = eager.propose(batch, last)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")  # step 0 captures: that may sync
            try:
                got = graphed.propose(batch, last)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(got.tokens, want.tokens), (B, step, got.tokens, want.tokens)
            assert_close(got.confidence, want.confidence, rtol=rtol, atol=rtol, what=f"B={B} {dtype}")
            T = drafter.block_size + 1  # then a verification's observation, batched
            keep = torch.randint(0, T + 1, (B,), generator=g).tolist()
            tokens = torch.randint(17, 16384, (B, T), generator=g).cuda()
            feats = {i: f.to("cuda", dtype) for i, f in _features(drafter, (B, T), g).items()}
            for d in (graphed, eager):
                d.observe_many(batch, tokens, feats, keep)
        for name, d in (("eager", eager), ("graph", graphed)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                d.propose(batch, last)
            torch.cuda.synchronize()
            timings[(name, B)] = (time.perf_counter() - t0) / 20 * 1e3
    assert graphed.graphs.captures == 4  # buckets 1, 4, 8, 16
    print(f"\n{dtype} propose ms: " + ", ".join(f"{n} B={B}: {ms:.2f}" for (n, B), ms in timings.items()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_graphed_observe_many_equals_eager_and_its_replay_makes_no_host_sync(dtype):
    """The hand-over replayed from CUDA graphs (one per (Bb, Tb)) against the same padded commit run eagerly:
    rings and counts after every call of a sequence of calls with other B, T and keep; features handed over
    as the engine does (fp32 views of one persistent buffer, cast into the drafter dtype)."""
    _, drafter = _models(seed=100)
    drafter.to("cuda", dtype)
    graphed = DSparkDrafter(drafter, max_sequences=16)
    eager = DSparkDrafter(drafter, max_sequences=16, cuda_graphs=False)
    assert graphed.observe_graphs is not None and eager.observe_graphs is None
    assert graphed.graphs.pool is graphed.observe_graphs.pool  # one pool for the drafter's graphs
    replays = []
    run = graphed.observe_graphs.run

    def checked_run(*key):
        if key not in graphed.observe_graphs.graphs:  # the capture may sync
            return run(*key)
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(*key)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        replays.append(key)

    graphed.observe_graphs.run = checked_run
    g = torch.Generator().manual_seed(101)
    ids = list(range(11))
    for s in ids:
        n = int(torch.randint(1, 4 * WINDOW, (1,), generator=g))
        tokens = torch.randint(17, 16384, (n,), generator=g).cuda()
        feats = {i: f.cuda() for i, f in _features(drafter, (min(n, WINDOW + 2),), g).items()}  # fp32
        for d in (graphed, eager):
            d.start(s)
            d.observe(s, tokens, feats)
    K1 = drafter.block_size + 1  # a verification's block
    buffer = torch.zeros(len(drafter.target_layer_ids), 16, WINDOW + 3, drafter.config.dim, device="cuda")
    worst, live = 0.0, graphed.dummy
    schedule = [(1, K1), (3, K1), (8, K1), (11, K1), (1, K1), (3, 2), (3, K1), (11, WINDOW), (8, K1), (5, 3),
                (11, K1), (5, WINDOW + 3), (1, 1), (1, K1)]
    for step, (B, T) in enumerate(schedule):
        batch = [ids[j] for j in torch.randperm(len(ids), generator=g)[:B].tolist()]
        keep = torch.randint(0, T + 1, (B,), generator=g).tolist()
        keep[0] = T  # both ends every call of more than one row
        if B > 1:
            keep[-1] = 0
        tokens = torch.randint(17, 16384, (B, T), generator=g).cuda()
        buffer.normal_()
        feats = {layer: buffer[j, :B, :T] for j, layer in enumerate(drafter.target_layer_ids)}  # (B, T, dim) fp32
        for d in (graphed, eager):
            d.observe_many(batch, tokens, feats, keep)
        for k, (got, want) in enumerate(zip(graphed.rings, eager.rings)):
            if dtype == torch.float32 and not torch.equal(got[:live], want[:live]):
                err = (got[:live] - want[:live]).abs().max().item()
                raise AssertionError(f"step {step} (B={B}, T={T}) stage {k}: graphed rings ≠ eager, max err {err:.3e}")
            assert_close(got[:live].float(), want[:live].float(), rtol=BF16_RTOL, atol=BF16_RTOL,
                         what=f"step {step} stage {k} {dtype}")
            worst = max(worst, (got[:live].float() - want[:live].float()).abs().max().item())
        assert torch.equal(graphed.observed[:live], eager.observed[:live]), (step, graphed.observed, eager.observed)
        assert graphed.observed_host == eager.observed_host
        assert graphed.observed[:live].tolist() == graphed.observed_host[:live]
    assert len(replays) >= 6, replays  # the repeated shapes replayed, under the sync check
    timings = {}
    for B in (1, 8):
        batch, keep = ids[:B], [3] * B
        feats = {layer: buffer[j, :B, :K1] for j, layer in enumerate(drafter.target_layer_ids)}
        tokens = torch.randint(17, 16384, (B, K1), generator=g).cuda()
        for name, d in (("eager", eager), ("graph", graphed)):
            d.observe_many(batch, tokens, feats, keep)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                d.observe_many(batch, tokens, feats, keep)
            torch.cuda.synchronize()
            timings[(name, B)] = (time.perf_counter() - t0) / 20 * 1e3
    print(f"\n{dtype} graphed vs eager rings max |err| {worst:.2e}; observe_many ms: "
          + ", ".join(f"{n} B={B}: {ms:.3f}" for (n, B), ms in timings.items()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_warm_up_captures_every_graph_a_run_needs_and_leaves_started_sequences_alone():
    """`warm_up` (the engine calls it at start-up): afterwards proposals and hand-overs of any batch and span
    capture nothing more; the captures ran on padding rows, so the rings and counts of sequences started
    before it are unchanged (byte-compare), and its proposals equal an eager drafter's."""
    main, drafter = _models(seed=120)
    main.to("cuda")  # the drafter shares its embedding and head
    drafter.to("cuda")
    graphed = DSparkDrafter(drafter, max_sequences=16)
    eager = DSparkDrafter(drafter, max_sequences=16, cuda_graphs=False)
    g = torch.Generator().manual_seed(121)
    ids = list(range(9))
    for s in ids:
        n = int(torch.randint(1, 4 * WINDOW, (1,), generator=g))
        tokens = torch.randint(17, 16384, (n,), generator=g).cuda()
        feats = {i: f.cuda() for i, f in _features(drafter, (min(n, WINDOW + 2),), g).items()}
        for d in (graphed, eager):
            d.start(s)
            d.observe(s, tokens, feats)
    rings, observed = [r.clone() for r in graphed.rings], graphed.observed.clone()
    before = graphed.captures  # the observes above captured their (1, Tb) hand-overs
    assert graphed.warm_up() > 0
    captured = graphed.captures
    spans = {1 << t for t in range(WINDOW.bit_length()) if 1 << t <= WINDOW}  # 1, 2, 4, 8 = WINDOW
    assert set(graphed.observe_graphs.graphs) == {(b, t) for b in graphed.buckets for t in spans}
    assert set(graphed.graphs.graphs) == {(b,) for b in graphed.buckets}
    assert captured - before == len(graphed.buckets) * (len(spans) + 1) - before
    live = graphed.dummy
    assert all(torch.equal(a[:live], b[:live]) for a, b in zip(graphed.rings, rings))
    assert torch.equal(graphed.observed[:live], observed[:live])
    assert graphed.warm_up() == 0  # idempotent
    for B, T in ((1, 1), (3, drafter.block_size + 1), (9, WINDOW), (5, 3), (2, WINDOW + 3)):
        batch = ids[:B]
        last = torch.randint(17, 16384, (B,), generator=g).cuda()
        got, want = graphed.propose(batch, last), eager.propose(batch, last)
        assert torch.equal(got.tokens, want.tokens), (B, got.tokens, want.tokens)
        keep = torch.randint(0, T + 1, (B,), generator=g).tolist()
        tokens = torch.randint(17, 16384, (B, T), generator=g).cuda()
        feats = {i: f.cuda() for i, f in _features(drafter, (B, T), g).items()}
        for d in (graphed, eager):
            d.observe_many(batch, tokens, feats, keep)
    assert graphed.captures == captured, "a call after warm_up captured a graph"


def test_a_bf16_drafter_keeps_its_fp32_multiplied_weights_in_fp32_and_drafts_the_same(monkeypatch):
    """`DSparkDrafter` stores the weights the drafter only multiplies in fp32 (`drafter_fp32_weights`: each
    stage's router, sink and mHC coefficients, the Markov and confidence heads) in fp32 — the same values, one
    cast fewer per use. A bf16 drafter then drafts bit-for-bit what it drafts with those weights left in bf16
    (tokens and confidences equal), and every other weight stays bf16 (the router biases are fp32 anyway)."""
    import copy

    import dsv41.engine.dspark_drafter as dd

    _, drafter = _models(seed=40)
    drafter = drafter.to(torch.bfloat16)
    main = drafter.main.to(torch.bfloat16)
    as_is = copy.deepcopy(drafter).bind(main)
    kept_names = {id(w) for w in dd.drafter_fp32_weights(drafter)}
    assert len(kept_names) == 8 * drafter.config.n_mtp_layers + 3  # router, sink, 6 mHC tensors per stage; heads
    static = DSparkDrafter(drafter, max_sequences=4)
    assert all(w.dtype == torch.float32 for w in dd.drafter_fp32_weights(drafter))
    others = [(n, p.dtype) for n, p in drafter.mtp.named_parameters() if id(p) not in kept_names]
    assert all(dtype == torch.bfloat16 or n.endswith("gate.bias") for n, dtype in others)  # router biases: fp32
    monkeypatch.setattr(dd, "keep_in_fp32", lambda weights: None)
    reference = DSparkDrafter(as_is, max_sequences=4)
    assert all(w.dtype == torch.bfloat16 for w in dd.drafter_fp32_weights(as_is))
    g = torch.Generator().manual_seed(41)
    for s, n in zip((1, 2, 3), (5, WINDOW + 3, 2 * WINDOW)):
        tokens = torch.randint(17, 16384, (n,), generator=g)
        feats = {i: f.bfloat16() for i, f in _features(drafter, (min(n, WINDOW + 2),), g).items()}
        for d in (static, reference):
            d.start(s)
            d.observe(s, tokens, feats)
    last = torch.randint(17, 16384, (3,), generator=g)
    got, want = static.propose([1, 2, 3], last), reference.propose([1, 2, 3], last)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.confidence, want.confidence)
