"""mHC against the formulas of SPEC §1a / §5, restated here in float64: the Sinkhorn split (pre, post, comb),
the RMS-normalized projection, hc_pre / hc_post, and the single-pass schedule of `Block.forward`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv41 import load_config
from dsv41.model.mhc import hc_post, hc_pre, hc_project, hc_split_sinkhorn
from dsv41.model.transformer import Block, Transformer

FP64_TOL = 1e-15  # float64 Sinkhorn split vs the float64 formulas: measured ≤ 2.2e-16
SPLIT32_TOL = 6e-7  # float32 Block.split vs float64: measured ≤ 1.8e-7
FP32_RTOL = 1e-6  # float32 projection / hc_pre / hc_post vs float64: measured ≤ 2.3e-7 relative to max |y|
BLOCK_RTOL = 1.5e-6  # float32 Block.forward vs float64 formulas: measured ≤ 3.4e-7 relative to max |h|


def split_formula(m: torch.Tensor, s: torch.Tensor, b: torch.Tensor, n: int, iters: int, eps: float):
    """pre = σ(m·s0 + b) + eps, post = 2σ(m·s1 + b), comb = row-softmax(m·s2 + b) + eps, then a column
    normalization and iters − 1 more (row, column) rounds; every normalization divides by (sum + eps)."""
    sig = lambda z: 1 / (1 + torch.exp(-z))
    pre = sig(m[..., :n] * s[0] + b[:n]) + eps
    post = 2 * sig(m[..., n:2 * n] * s[1] + b[n:2 * n])
    z = (m[..., 2 * n:] * s[2] + b[2 * n:]).reshape(*m.shape[:-1], n, n)  # (..., n, n), row i = source i
    e = torch.exp(z - z.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    rounds = 0
    while rounds < iters - 1:
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        rounds += 1
    return pre, post, comb


def _split_inputs(g, n: int, spread: float):
    m = torch.randn(3, 5, (2 + n) * n, generator=g, dtype=torch.float64) * spread
    s = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn((2 + n) * n, generator=g, dtype=torch.float64)
    return m, s, b


@pytest.mark.parametrize("spread", [0.5, 6.0])  # 6: far from doubly stochastic, Sinkhorn converges slowly
def test_split_matches_formula(spread):
    c = load_config("v41-flash")
    n, iters, eps = c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps
    g = torch.Generator().manual_seed(41)
    m, s, b = _split_inputs(g, n, spread)
    got = hc_split_sinkhorn(m, s, b, n, iters, eps)
    want = split_formula(m, s, b, n, iters, eps)
    for name, x, y in zip(("pre", "post", "comb"), got, want):
        err = (x - y).abs().max().item()
        assert err <= FP64_TOL, f"{name}: max err {err:.2e}"
    if spread > 1:  # one Sinkhorn round more or less must show at this tolerance
        other = split_formula(m, s, b, n, iters - 1, eps)[2]
        assert (other - want[2]).abs().max().item() > 1e-9
    # comb is (nearly) doubly stochastic after the last column step
    assert (got[2].sum(-2) - 1).abs().max().item() <= 2 * eps  # columns sum to 1/(1 + eps)


def test_block_split_uses_the_config():
    """Block.split = the formula with hc_sinkhorn_iters and hc_eps of the config, and its own scale/base."""
    c = load_config("tiny")
    block = Block(c, Transformer(c).plan[0])
    g = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for which in ("attn", "ffn"):
            getattr(block, f"hc_{which}_base").normal_(0, 1, generator=g)
            getattr(block, f"hc_{which}_scale").uniform_(0.5, 4.0, generator=g)
    mixes = torch.randn(2, 4, (2 + c.hc_mult) * c.hc_mult, generator=g) * 3
    for which in ("attn", "ffn"):
        got = block.split(mixes, which)
        want = split_formula(mixes.double(), getattr(block, f"hc_{which}_scale").detach().double(),
                             getattr(block, f"hc_{which}_base").detach().double(), c.hc_mult,
                             c.hc_sinkhorn_iters, c.hc_eps)
        for name, x, y in zip(("pre", "post", "comb"), got, want):
            err = (x.double() - y).abs().max().item()
            assert err <= SPLIT32_TOL, f"{which} {name}: max err {err:.2e}"


def test_project_pre_and_post_match_formulas():
    """These three compute in float32 (as the kernels do): float32 inputs vs float64 formulas."""
    g = torch.Generator().manual_seed(43)
    n, dim, eps = 4, 24, 1e-20
    h = torch.randn(2, 3, n, dim, generator=g) * 2
    fn = torch.randn((2 + n) * n, n * dim, generator=g)

    def check(name, got, want):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= FP32_RTOL, f"{name}: max rel err {err:.2e}"

    H, flat = h.double(), h.double().reshape(2, 3, n * dim)  # (B, T, n·d)
    check("projection", hc_project(h, fn, eps),
          flat @ fn.double().T / torch.sqrt(flat.square().mean(-1, keepdim=True) + eps))
    pre = torch.rand(2, 3, n, generator=g)
    check("hc_pre", hc_pre(h, pre), sum(pre[..., i, None].double() * H[..., i, :] for i in range(n)))  # Σ_i pre_i x_i
    f = torch.randn(2, 3, dim, generator=g)
    post = torch.rand(2, 3, n, generator=g) * 2
    comb = torch.rand(2, 3, n, n, generator=g)
    got = hc_post(f, h, post, comb)
    P, C = post.double(), comb.double()
    for j in range(n):  # y_j = post_j·F + Σ_i comb_ij x_i
        check(f"hc_post stream {j}", got[..., j, :],
              P[..., j, None] * f.double() + sum(C[..., i, j, None] * H[..., i, :] for i in range(n)))


class _Smooth(nn.Module):
    """A stand-in FFN (routing is discrete; a float64 reference must not hinge on a tie)."""

    def __init__(self, dim: int, g: torch.Generator):
        super().__init__()
        self.w = torch.randn(dim, dim, generator=g) / dim ** 0.5

    def forward(self, x, **_):
        return torch.tanh(x @ self.w.to(x.dtype))


@pytest.mark.parametrize("single_pass", [True, False])
def test_block_forward_follows_the_single_pass_schedule(single_pass):
    """X ← B·X + C·F(A'·X) per sublayer, where A' is the pre-mix the *previous* sublayer made (single
    pass: attention uses the one passed in, the FFN the attention's) or the sublayer's own (classic)."""
    c = load_config("tiny").replace(single_pass_mhc=single_pass)
    g = torch.Generator().manual_seed(44 + single_pass)
    block = Block(c, Transformer(c).plan[0])
    with torch.no_grad():
        for which in ("attn", "ffn"):
            getattr(block, f"hc_{which}_fn").normal_(0, 0.05, generator=g)
            getattr(block, f"hc_{which}_base").normal_(0, 0.5, generator=g)
        block.attn_norm.weight.uniform_(0.5, 1.5, generator=g)
        block.ffn_norm.weight.uniform_(0.5, 1.5, generator=g)
    block.ffn = _Smooth(c.dim, g)
    A = torch.randn(c.dim, c.dim, generator=g) / c.dim ** 0.5
    attention = lambda x: torch.sin(x @ A.to(x.dtype))
    n, eps = c.hc_mult, c.norm_eps
    h = torch.randn(2, 5, n, c.dim, generator=g)
    pre_in = torch.softmax(torch.randn(2, 5, n, generator=g), -1)
    with torch.no_grad():
        h_out, pre_out, (x_out, mixes_out) = block(h, pre_in, attention)

    def rms(x, w):
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w.detach().double()

    def coefficients(x, which):
        flat = x.flatten(-2)  # (B, T, n·d)
        fn = getattr(block, f"hc_{which}_fn").detach().double()
        m = flat @ fn.T / torch.sqrt(flat.square().mean(-1, keepdim=True) + eps)
        return split_formula(m, getattr(block, f"hc_{which}_scale").detach().double(),
                             getattr(block, f"hc_{which}_base").detach().double(), n, c.hc_sinkhorn_iters, c.hc_eps)

    mix = lambda x, w: (w.unsqueeze(-1) * x).sum(-2)  # Σ_i w_i x_i
    update = lambda x, f, post, comb: post.unsqueeze(-1) * f.unsqueeze(-2) + torch.einsum("btij,btid->btjd", comb, x)
    x0 = h.double()
    a_pre, a_post, a_comb = coefficients(x0, "attn")
    x1 = update(x0, attention(rms(mix(x0, pre_in.double() if single_pass else a_pre), block.attn_norm.weight)),
                a_post, a_comb)
    f_pre, f_post, f_comb = coefficients(x1, "ffn")
    x2 = update(x1, block.ffn(rms(mix(x1, a_pre if single_pass else f_pre), block.ffn_norm.weight)), f_post, f_comb)
    scale = x2.abs().max()
    for name, got, want in (("h", h_out, x2), ("pre-mix", pre_out, f_pre), ("collapsed", x_out, mix(x2, f_pre))):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= BLOCK_RTOL, f"{name}: max rel err {err:.2e} (|h| ≤ {scale:.2f})"
    assert mixes_out is None  # no next projection asked for


def test_training_init_mixes_near_identity_in_every_block_and_draft_stage():
    """init_weights (backbone blocks and DSpark stages, one `Block.init_mixing`): with no dynamic signal the
    split gives pre = 1/n per stream, post = 1 and a comb close to the identity (doubly stochastic, diagonal
    = the Sinkhorn fixed point of softmax(4·I)); the dynamic weights are small and the sinks zero."""
    from dsv41.config import with_dspark
    from dsv41.model.dspark import DSpark

    c = with_dspark(load_config("tiny"))
    n = c.hc_mult
    blocks = list(Transformer(c).init_weights(seed=0).layers) + list(DSpark(c).init_weights(seed=1).mtp)
    zero = torch.zeros(1, 1, (2 + n) * n)
    diag = torch.e ** 4 / (torch.e ** 4 + n - 1)  # softmax(4·I) is already doubly stochastic
    for i, block in enumerate(blocks):
        assert float(block.attn.attn_sink.abs().max()) == 0.0, i
        for which in ("attn", "ffn"):
            pre, post, comb = (t.double() for t in block.split(zero, which))
            assert torch.allclose(pre, torch.full_like(pre, 1 / n), atol=1e-5), (i, which, pre)
            assert torch.allclose(post, torch.ones_like(post), atol=1e-6), (i, which, post)
            want = torch.full((n, n), (1 - diag) / (n - 1), dtype=torch.float64).fill_diagonal_(diag)
            assert torch.allclose(comb[0, 0], want, atol=1e-5), (i, which, comb)
            std = float(getattr(block, f"hc_{which}_fn").detach().std())
            assert 5e-4 < std < 2e-3, (i, which, std)
