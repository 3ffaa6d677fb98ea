"""DeepSeek-ViT and the aligner (model/vision.py) against references written here from SPEC §5 and the
release's layout: a complex-number 2D RoPE, an fp64 ViT forward, torch's own pixel_unshuffle / unfold."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tests.conftest import assert_close

from dsv41 import load_config
from dsv41.model.vision import (
    VISION_NORM_EPS,
    ViT,
    apply_vision_rope,
    encode_images,
    pixel_unshuffle,
    vision_rope_angles,
)


def _config(**changes):
    base = dict(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48)
    return load_config("tiny-vl").replace(**{**base, **changes})


def _vit(seed: int, **changes) -> ViT:
    torch.manual_seed(seed)
    vit = ViT(_config(**changes))
    with torch.no_grad():  # every parameter random and O(1)-relevant (norm gains and biases included)
        for name, p in vit.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return vit


# ---------------------------------------------------------------------- 2D RoPE
def _rope_formula(x: torch.Tensor, n_h: int, n_w: int, theta: float) -> torch.Tensor:
    """x (N, H, hd) fp64 → rotated, patch by patch, pair by pair, as complex numbers: the pair
    (x_i, x_{i + hd/2}) turns by row·θ^(−4i/hd) for i < hd/4 and by col·θ^(−4(i − hd/4)/hd) after."""
    N, H, hd = x.shape
    out = torch.empty_like(x)
    for n in range(N):
        row, col = divmod(n, n_w)
        for i in range(hd // 2):
            j, pos = (i, row) if i < hd // 4 else (i - hd // 4, col)
            angle = pos * theta ** (-4.0 * j / hd)
            z = torch.complex(x[n, :, i], x[n, :, i + hd // 2]) * complex(math.cos(angle), math.sin(angle))
            out[n, :, i], out[n, :, i + hd // 2] = z.real, z.imag
    return out


def test_2d_rope_equals_the_complex_number_formula():
    torch.manual_seed(1)
    n_h, n_w, H, hd, theta = 3, 5, 2, 16, 10000.0
    x = torch.randn(n_h * n_w, H, hd, dtype=torch.float64)
    angles = vision_rope_angles(n_h, n_w, hd, theta).double()
    got = apply_vision_rope(x, angles.cos(), angles.sin())
    assert_close(got, _rope_formula(x, n_h, n_w, theta), rtol=1e-6, atol=1e-6, what="2D RoPE")


def test_2d_rope_scores_depend_on_the_relative_offset_only():
    """q·k after RoPE is a function of (Δrow, Δcol): the same two vectors at two placements with
    equal offsets score alike; a different offset scores differently."""
    torch.manual_seed(2)
    hd, n_h, n_w = 32, 6, 7
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    angles = vision_rope_angles(n_h, n_w, hd, 10000.0).double()
    cos, sin = angles.cos(), angles.sin()

    def score(pq, pk):
        iq, ik = pq[0] * n_w + pq[1], pk[0] * n_w + pk[1]
        rq = apply_vision_rope(q.view(1, 1, hd), cos[iq:iq + 1], sin[iq:iq + 1])
        rk = apply_vision_rope(k.view(1, 1, hd), cos[ik:ik + 1], sin[ik:ik + 1])
        return float((rq * rk).sum())

    a, b = score((1, 2), (3, 1)), score((2, 5), (4, 4))  # both offsets (+2, −1)
    assert abs(a - b) < 1e-6, (a, b)  # the angles are fp32: measured 4e-9
    assert abs(a - score((1, 2), (1, 3))) > 1e-3  # another offset


# ---------------------------------------------------------------------- the ViT against an fp64 reference
def _rms(x, w, eps=VISION_NORM_EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _vit_reference(vit: ViT, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """One image, fp64, from SPEC §5: linear patch embedding with bias; per block pre-RMSNorm,
    fused qkv with bias, 2D RoPE (formula above), softmax attention over every patch, output with
    bias; pre-RMSNorm, SwiGLU with [gate | up] = w1 x, no biases; a final RMSNorm."""
    sd = {k: v.double() for k, v in vit.state_dict().items()}
    D = sd["patch_embed.proj.weight"].shape[0]
    H = vit.blocks[0].attn.n_heads
    hd = D // H
    x = patches.double() @ sd["patch_embed.proj.weight"].T + sd["patch_embed.proj.bias"]
    for i in range(len(vit.blocks)):
        p = f"blocks.{i}."
        y = _rms(x, sd[p + "norm1.weight"])
        qkv = y @ sd[p + "attn.wqkv.weight"].T + sd[p + "attn.wqkv.bias"]
        q, k, v = (t.reshape(-1, H, hd) for t in qkv.split(D, dim=-1))
        q, k = _rope_formula(q, n_h, n_w, vit.rope_theta), _rope_formula(k, n_h, n_w, vit.rope_theta)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(-1, D)
        x = x + o @ sd[p + "attn.wo.weight"].T + sd[p + "attn.wo.bias"]
        y = _rms(x, sd[p + "norm2.weight"])
        gate, up = (y @ sd[p + "mlp.w1.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.w2.weight"].T
    return _rms(x, sd["norm.weight"])


def test_vit_equals_the_fp64_reference():
    vit = _vit(3)
    n_h, n_w = 3, 4
    patches = torch.randn(n_h * n_w, 3 * 14 * 14)
    got = vit(patches[None], [(n_h, n_w)])[0]
    want = _vit_reference(vit, patches, n_h, n_w)
    assert_close(got, want, rtol=1e-4, atol=1e-4, what="ViT vs fp64 reference")  # measured max 1.2e-5


def test_vit_output_is_invariant_to_the_image_placement_in_the_batch():
    vit = _vit(4)
    grids = [(3, 4), (2, 2), (4, 4), (1, 3)]
    imgs = [torch.randn(h * w, 3 * 14 * 14) for h, w in grids]
    alone = [vit(p[None], [g])[0] for p, g in zip(imgs, grids)]
    for order in ([0, 1, 2, 3], [2, 3, 0, 1], [3, 1, 0, 2]):
        n = 20  # more rows than any image: every image is padded
        batch = torch.stack([F.pad(imgs[i], (0, 0, 0, n - imgs[i].shape[0])) for i in order])
        out = vit(batch, [grids[i] for i in order])
        for slot, i in enumerate(order):
            h, w = grids[i]
            assert_close(out[slot, :h * w], alone[i], rtol=1e-5, atol=2e-5, what=f"image {i} at slot {slot}")


def test_vit_attention_is_bidirectional_within_an_image():
    vit = _vit(5)
    x = torch.randn(1, 6, 3 * 14 * 14)
    base = vit(x, [(2, 3)])
    x2 = x.clone()
    x2[0, -1] += 1.0  # the last patch changes the first one's output: no causal mask
    assert (vit(x2, [(2, 3)])[0, 0] - base[0, 0]).abs().max() > 1e-3


# ---------------------------------------------------------------------- pixel-unshuffle
def test_pixel_unshuffle_equals_torch_pixel_unshuffle_and_unfold():
    torch.manual_seed(6)
    for h, w in ((6, 9), (4, 5), (1, 1), (7, 3)):
        C, r = 5, 3
        x = torch.randn(h, w, C)
        got = pixel_unshuffle(x, r)
        padded = F.pad(x.permute(2, 0, 1), (0, -w % r, 0, -h % r))  # (C, H', W') zeros bottom / right
        ref = F.pixel_unshuffle(padded[None], r)[0]  # (C·r², H'/r, W'/r), channel-major (c, kh, kw)
        assert torch.equal(got, ref.flatten(1).T), (h, w)
        unfold = F.unfold(padded[None], r, stride=r)[0].T  # (blocks, C·r²): the release's F.unfold
        assert torch.equal(got, unfold), (h, w)


def test_aligner_and_span_layout():
    """encode_images: ⌈h/3⌉·(⌈w/3⌉ + 1) + 2 rows per image — start, rows of aligner tokens each
    followed by newline, end — and the aligner tokens are w2(gelu(w1(unshuffled features)))."""
    from dsv41.model.transformer import Transformer

    torch.manual_seed(7)
    c = _config()
    model = Transformer(c).init_weights(seed=7)
    grids = [(4, 5), (3, 3), (1, 7)]
    patches = [torch.randn(h * w, 3 * 14 * 14) for h, w in grids]
    spans = encode_images(model, patches, grids)
    for (h, w), p, span in zip(grids, patches, spans):
        th, tw = math.ceil(h / 3), math.ceil(w / 3)
        assert span.shape == (th * (tw + 1) + 2, c.dim)
        assert torch.equal(span[0], model.image_start) and torch.equal(span[-1], model.image_end)
        body = span[1:-1].view(th, tw + 1, c.dim)
        assert torch.equal(body[:, -1], model.image_newline.expand(th, c.dim))
        feats = model.vision(p[None], [(h, w)])[0]
        u = pixel_unshuffle(feats.view(h, w, -1), 3)
        tokens = F.linear(F.gelu(F.linear(u, model.aligner.w1.weight, model.aligner.w1.bias), approximate="none"),
                          model.aligner.w2.weight, model.aligner.w2.bias)
        assert_close(body[:, :-1].reshape(-1, c.dim), tokens, rtol=1e-5, atol=1e-5, what="aligner tokens")
