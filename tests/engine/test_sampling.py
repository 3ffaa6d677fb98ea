"""Sampling: greedy, per-request reproducibility, top-k / top-p distributions, finish reasons."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsv41.engine.sampling import (
    MAX_INT,
    TOP_P_MIN,
    SamplingParams,
    StopChecker,
    finish_reason,
    make_generator,
    sample,
    token_logprobs,
)

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = _logits(5, 300, 0)
    logits[1, [7, 200]] = logits[1].max() + 1.0  # a tie: 7 must win
    logits[3, [250, 40, 90]] = 1e4
    out = sample(logits, [SamplingParams()] * 5, [None] * 5)
    expected = logits.argmax(-1)
    assert out.dtype == torch.long and torch.equal(out, expected)
    assert out[1] == 7 and out[3] == 40


def test_top_k_one_is_greedy_at_any_temperature():
    logits = _logits(6, 500, 1)
    logits[2, [11, 3]] = logits[2].max() + 2.0
    params = [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.1, 0.5, 1.0, 2.0, 7.0, 50.0])]
    generators = [make_generator(p.seed) for p in params]
    for _ in range(5):
        assert torch.equal(sample(logits, params, generators), logits.argmax(-1))


def test_tiny_temperature_is_greedy_and_never_nan():
    logits = _logits(4, 1000, 2)
    for temperature in (1e-6, 1e-30, 1e-300):
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
        generators = [make_generator(p.seed) for p in params]
        for _ in range(3):
            assert torch.equal(sample(logits, params, generators), logits.argmax(-1))


def test_seeded_samples_do_not_depend_on_batch_composition_or_order():
    vocab, steps = 64, 12
    params = [SamplingParams(temperature=0.8, top_k=10, seed=11), SamplingParams(),
              SamplingParams(temperature=1.3, top_p=0.9, seed=12), SamplingParams(temperature=1.0, seed=13),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.8, seed=14)]
    step_logits = [_logits(len(params), vocab, 100 + s) for s in range(steps)]

    def run(rows: list[int]) -> dict[int, list[int]]:
        generators = [make_generator(params[i].seed) for i in rows]
        out: dict[int, list[int]] = {i: [] for i in rows}
        for logits in step_logits:
            tokens = sample(logits[rows], [params[i] for i in rows], generators)
            for i, t in zip(rows, tokens.tolist()):
                out[i].append(t)
        return out

    full = run([0, 1, 2, 3, 4])
    assert full == run([4, 2, 0, 3, 1])  # another order
    for i in range(len(params)):
        assert full[i] == run([i])[i]  # alone
    assert full == run([0, 1, 2, 3, 4])  # reproducible
    assert len(set(full[3])) > 1  # it really samples
    other = SamplingParams(temperature=1.0, seed=99)
    assert run([3])[3] != [int(sample(lg[3:4], [other], [make_generator(99)])) for lg in step_logits]


def _nucleus(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference distribution in float64: top-k, renormalize, smallest prefix with mass >= top_p."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    k = top_k or len(z)
    p = np.exp(z[order[:k]] - z[order[0]])
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12)) + 1  # first prefix reaching top_p
    out = np.zeros(len(z))
    out[order[:n]] = p[:n] / p[:n].sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 0, 0.75), (1.4, 5, 0.85), (0.7, 4, 1.0), (1.0, 0, 1.0)])
def test_sampled_frequencies_match_the_truncated_distribution(temperature, top_k, top_p):
    vocab, draws = 9, 12000
    logits = _logits(1, vocab, 3)[0]
    expected = _nucleus(logits.double().numpy(), temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    g = make_generator(params.seed)
    tokens = sample(logits.expand(draws, vocab), [params] * draws, [g] * draws)
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"sampled outside the kept set: {counts} vs {expected.round(3)}"
    if top_p < 1:
        assert kept.sum() < (top_k or vocab)  # the nucleus cut something
    chi2 = float((((counts - draws * expected) ** 2)[kept] / (draws * expected[kept])).sum())
    df = int(kept.sum()) - 1
    assert chi2 < CHI2_999[df], f"chi2 {chi2:.1f} (df {df}); counts {counts}, expected {(draws * expected).round()}"


def test_top_p_always_keeps_the_top_token():
    logits = _logits(3, 200, 4)
    params = [SamplingParams(temperature=2.0, top_p=TOP_P_MIN, seed=s) for s in range(3)]
    params[1].top_p = 1e-50  # below validation (set afterwards): 0 in fp32, must still not crash
    params[2].top_k = 2**63  # ditto: past int64
    generators = [make_generator(s) for s in range(3)]
    for _ in range(5):
        out = sample(logits, params, generators)
        assert torch.equal(out[:2], logits.argmax(-1)[:2]) and 0 <= out[2] < 200


@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.75, 3), (0.74, 3), (0.76, 4), (0.25, 1)])
def test_the_nucleus_is_the_smallest_prefix_whose_mass_reaches_top_p(top_p, kept):
    """Four equal logits (each 1/4 exactly, prefix masses 0, 1/4, 1/2, 3/4 exactly): top_p = 1/2 keeps two tokens
    — a prefix that reaches top_p exactly ends the nucleus (Hugging Face's TopPLogitsWarper, `_nucleus` above)."""
    from dsv41.engine.sampling import sampling_probs

    probs = sampling_probs(torch.zeros(1, 4), [SamplingParams(temperature=1.0, top_p=top_p)])[0]
    assert torch.equal(probs, torch.tensor([1 / kept] * kept + [0.0] * (4 - kept)))


def test_a_draw_at_the_top_of_the_range_stays_in_the_kept_set(monkeypatch):
    """u · total can round up to the total (u just below 1, or a total that rounds down): the draw must still land
    on a kept token, not past the last one (the rounding guard), whatever the batch."""
    import dsv41.engine.sampling as sampling

    monkeypatch.setattr(sampling, "host_uniforms", lambda generator, n, dtype=torch.float32: [1.0] * n)
    logits = _logits(3, 50, 8)
    params = [SamplingParams(temperature=1.3, top_k=5, seed=1), SamplingParams(temperature=0.8, top_p=0.6, seed=2),
              SamplingParams(temperature=1.0, seed=3)]
    out = sample(logits, params, [make_generator(p.seed) for p in params])
    for row, (p, token) in enumerate(zip(params, out.tolist())):
        kept = sampling.sampling_probs(logits[row:row + 1], [p])[0] > 0
        assert kept[token], (row, token)


def test_make_generator_seeds():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    c, d = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(4, generator=c), torch.rand(4, generator=d))


def test_make_generator_is_a_host_generator():
    g = make_generator(5)
    assert g.device.type == "cpu"
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(5)))


class _DeviceOps(TorchDispatchMode):
    """Counts the ops whose output lives on `device` (what a GPU would launch)."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.count = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += any(isinstance(t, torch.Tensor) and t.device.type == self.device for t in tree_leaves(out))
        return out


def test_sampling_makes_the_same_device_ops_at_any_batch():
    """The per-row uniforms are drawn on the host and sent in one copy: the ops on the logits' device (meta
    here: shapes only) do not grow with the number of sampled rows (one draw per row on the device did)."""
    counts = {}
    for B in (2, 8, 64):
        params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i) for i in range(B)]
        generators = [make_generator(p.seed) for p in params]
        with _DeviceOps("meta") as ops:
            out = sample(torch.empty(B, 300, device="meta"), params, generators)
        assert out.shape == (B,)
        counts[B] = ops.count
    assert counts[2] == counts[8] == counts[64] and counts[2] < 60, counts


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"top_k": 2**63}, "top_k"), ({"top_k": MAX_INT + 1}, "top_k"), ({"top_p": 1.4e-45}, "top_p"),
    ({"top_p": TOP_P_MIN / 2}, "top_p"), ({"max_tokens": 2**63}, "max_tokens"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"), ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": 2.0}, "logprobs"),
])
def test_invalid_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sample_checks_its_arguments():
    with pytest.raises(ValueError, match="rows"):
        sample(_logits(2, 10, 0), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(torch.randn(10), [SamplingParams()], [None])


def test_finish_reasons_and_the_stop_token_accounting():
    params = SamplingParams(max_tokens=4, stop_token_ids=[9, 2])
    checker = StopChecker(params)
    assert [checker.update(t) for t in (5, 6)] == [None, None]
    assert checker.update(2) == "stop" and checker.finished
    assert checker.output_token_ids == [5, 6] and checker.num_generated == 3  # stop token counted, not shown
    with pytest.raises(RuntimeError, match="finished"):
        checker.update(1)

    checker = StopChecker(params)
    assert [checker.update(t) for t in (1, 1, 1, 1)] == [None, None, None, "length"]
    assert checker.output_token_ids == [1, 1, 1, 1]
    assert finish_reason(9, 4, params) == "stop"  # a stop id on the last allowed step is "stop"
    assert finish_reason(8, 3, params) is None and finish_reason(8, 4, params) == "length"


def test_check_vocab_bounds_top_k_and_stop_ids():
    SamplingParams(top_k=100, stop_token_ids=[99]).check_vocab(100)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=101).check_vocab(100)
    with pytest.raises(ValueError, match="stop token id 100"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)
    assert SamplingParams(logprobs=20).logprobs == 20 and SamplingParams(logprobs=0).logprobs == 0


def test_token_logprobs_match_an_fp64_reference():
    g = torch.Generator().manual_seed(31)
    B, V, k = 5, 333, 7
    logits = torch.randn(B, V, generator=g) * 4
    logits[2, [10, 50]] = logits[2].max() + 1.0  # a tie at the top: the lower id comes first
    tokens = torch.randint(0, V, (B,), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        lp, ids, top = token_logprobs(logits.to(dtype), tokens, k)
        ref = torch.log_softmax(logits.to(dtype).double(), dim=-1)  # fp64 over the same (rounded) inputs
        err = (lp.double() - ref[torch.arange(B), tokens]).abs().max().item()
        assert err < 1e-5, f"chosen logprob max error {err:.3g}"
        order = np.lexsort((np.arange(V)[None].repeat(B, 0), -ref.numpy()), axis=-1)[:, :k]  # desc, ties by id
        assert torch.equal(ids, torch.from_numpy(order)), (ids, order)
        err = (top.double() - ref.gather(1, ids)).abs().max().item()
        assert err < 1e-5, f"top logprob max error {err:.3g}"
    assert ids[2, 0] == 10 and ids[2, 1] == 50
    lp0, ids0, top0 = token_logprobs(logits, tokens, 0)
    assert ids0.shape == (B, 0) and top0.shape == (B, 0) and torch.equal(lp0, token_logprobs(logits, tokens, 3)[0])
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens, 21)
