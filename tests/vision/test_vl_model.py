"""Image tokens in the backbone (issue 20, acceptance 1): the span count, packed image+text documents,
bias_vl routing and its own update, and the release's vision / aligner names in a meta-device v41-flash."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.conftest import assert_close
from tests.vision.test_engine_images import image, vl_model

from dsv41 import load_config
from dsv41.accounting import compute
from dsv41.image_processor import from_pixels, num_image_positions, plan_grid
from dsv41.model.moe import update_moe_biases
from dsv41.model.transformer import Transformer
from dsv41.model.vision import encode_images


# ---------------------------------------------------------------------- the processor's span
def test_a_28px_image_is_scaled_to_min_pixels_and_spans_8_positions():
    """Hand computation for tiny-vl (min 3136 px = 56², patch 14, r = 3): 28² → 56² → 4 × 4 patches →
    ⌈4/3⌉ × ⌈4/3⌉ = 2 × 2 tokens → 2·(2 + 1) + 2 = 8 positions."""
    c = load_config("tiny-vl")
    im = from_pixels(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8), c)
    assert (im.vit_h, im.vit_w, im.llm_h, im.llm_w, im.n_positions) == (4, 4, 2, 2, 8)
    assert im.patches.shape == (16, 3 * 14 * 14)


def test_image_positions_count_h_times_w_plus_1_plus_2_and_fit_the_cap():
    c = load_config("tiny-vl")
    rng = np.random.default_rng(1)
    for _ in range(40):
        W, H = (int(v) for v in rng.integers(5, 2000, 2))
        h, w, ph, pw = plan_grid(W, H, c)
        n = num_image_positions(h, w)
        assert n == h * (w + 1) + 2 <= c.vision_max_n_token, (W, H, h, w)
        assert (h, w) == (math.ceil(ph / 14 / 3), math.ceil(pw / 14 / 3)) and ph % 14 == pw % 14 == 0
    # the span the model builds has exactly that many rows
    model = vl_model(1)
    im = image(7, 5, 8)
    span = encode_images(model, [im.patches], [im.grid])[0]
    assert span.shape[0] == num_image_positions(2, 3) == im.n_positions == 10


# ---------------------------------------------------------------------- packed documents
def test_packed_image_and_text_documents_equal_each_alone():
    model = vl_model(11)
    c = model.config
    g = torch.Generator().manual_seed(11)
    ims = [image(11), image(12, 3, 6)]

    def doc(im, n_text):
        text = torch.randint(7, c.vocab_size, (n_text,), generator=g).tolist()
        return [1] + [c.image_token_id] * (im.n_positions if im else 0) + text

    docs = [(doc(ims[0], 6), [ims[0]]), (doc(None, 9), []), (doc(ims[1], 5), [ims[1]])]
    tokens = torch.tensor([sum((d for d, _ in docs), [])])
    doc_ids = torch.tensor([sum(([k + 1] * len(d) for k, (d, _) in enumerate(docs)), [])])
    all_ims = [im for _, i in docs for im in i]
    with torch.no_grad():
        embeds = torch.cat(encode_images(model, [im.patches for im in all_ims], [im.grid for im in all_ims]))
        packed = model(tokens, doc_ids, image_mask=tokens == c.image_token_id, image_embeds=embeds)[0]
        lo = 0
        for d, i in docs:
            t = torch.tensor([d])
            e = torch.cat(encode_images(model, [im.patches for im in i], [im.grid for im in i])) if i else None
            alone = model(t, image_mask=t == c.image_token_id if i else None, image_embeds=e)[0]
            assert_close(packed[lo:lo + len(d)], alone, rtol=1e-4, atol=1e-4, what=f"document at {lo}")
            lo += len(d)


# ---------------------------------------------------------------------- bias_vl
def test_image_tokens_route_with_bias_vl_and_update_only_the_image_bias():
    """One expert's bias_vl at +100 in every MoE: every image token picks it, no text token is forced to;
    the update moves bias by the text loads and bias_vl by the image loads, each sign(mean − load)."""
    model = vl_model(12).train()
    c = model.config
    E, k = c.n_routed_experts, c.n_activated_experts
    ims = [image(13)]
    tokens = torch.tensor([[1] + [c.image_token_id] * ims[0].n_positions + list(range(20, 40))])
    mask = tokens == c.image_token_id
    moes = list(model.moe_layers())
    hot = [int(i) % E for i in range(len(moes))]
    with torch.no_grad():
        for moe, e in zip(moes, hot):
            moe.gate.bias.normal_(0, 0.01)
            moe.gate.bias_vl.normal_(0, 0.01)
            moe.gate.bias_vl[e] = 100.0
    before = [(m.gate.bias.clone(), m.gate.bias_vl.clone()) for m in moes]
    embeds = torch.cat(encode_images(model, [im.patches for im in ims], [im.grid for im in ims]))
    model.losses(tokens[:, :-1], tokens[:, 1:], image_mask=mask[:, :-1], image_embeds=embeds[:-1] if mask[0, -1]
                 else embeds, token_mask=torch.ones_like(tokens[:, :-1], dtype=torch.bool))
    n_img, n_txt = int(mask[:, :-1].sum()), tokens.shape[1] - 1 - int(mask[:, :-1].sum())
    for moe, e in zip(moes, hot):
        load = moe.last_load
        assert int(load["image"][e]) == n_img and int(load["image"].sum()) == n_img * k
        assert int(load["text"].sum()) == n_txt * k and int(load["text"][e]) < n_txt
    update_moe_biases(model)
    for moe, (b, bvl) in zip(moes, before):
        speed = moe.bias_update_speed
        for name, old, new in (("text", b, moe.gate.bias), ("image", bvl, moe.gate.bias_vl)):
            n = moe.last_load[name].float()
            assert_close(new, old + speed * torch.sign(n.mean() - n), rtol=0, atol=1e-6, what=f"{name} bias step")
    # a text-only step leaves bias_vl exactly where it is
    frozen = [m.gate.bias_vl.clone() for m in moes]
    model.losses(tokens[:, 20:-1], tokens[:, 21:])
    update_moe_biases(model)
    assert all(torch.equal(m.gate.bias_vl, f) for m, f in zip(moes, frozen))


# ---------------------------------------------------------------------- the release's names
RELEASE_VISION = {  # name → shape, from SPEC §5 and the public ports of the release's vision.py (written out here)
    "vision.patch_embed.proj.weight": (1024, 588), "vision.patch_embed.proj.bias": (1024,),
    "vision.blocks.{i}.norm1.weight": (1024,), "vision.blocks.{i}.norm2.weight": (1024,),
    "vision.blocks.{i}.attn.wqkv.weight": (3072, 1024), "vision.blocks.{i}.attn.wqkv.bias": (3072,),
    "vision.blocks.{i}.attn.wo.weight": (1024, 1024), "vision.blocks.{i}.attn.wo.bias": (1024,),
    "vision.blocks.{i}.mlp.w1.weight": (2 * 2816, 1024), "vision.blocks.{i}.mlp.w2.weight": (1024, 2816),
    "vision.norm.weight": (1024,),
}


@pytest.mark.slow  # the whole v41-flash on the meta device (~15 s alone, as tests/model/test_transformer.py's)
def test_a_meta_v41_flash_build_holds_the_release_vision_names_and_the_accounting_counts_them():
    config = load_config("v41-flash")
    assert (config.vision_n_layers, config.vision_dim, config.vision_n_heads, config.vision_patch_size) == \
        (32, 1024, 16, 14)
    text = config.replace(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
                          compress_ratios=config.compress_ratios[:config.n_layers])  # vision kept on
    with torch.device("meta"):
        model = Transformer(text)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    want = {}
    for name, shape in RELEASE_VISION.items():
        for i in range(32) if "{i}" in name else [None]:
            want[name.format(i=i)] = shape
    assert config.vision_inter_dim == 2816  # SPEC §5: the SwiGLU intermediate
    d9 = 9 * 1024  # the 3 × 3 unfold of 1024-wide features
    want |= {"aligner.w1.weight": (config.dim, d9), "aligner.w1.bias": (config.dim,),
             "aligner.w2.weight": (config.dim, config.dim), "aligner.w2.bias": (config.dim,),
             "image_start": (config.dim,), "image_end": (config.dim,), "image_newline": (config.dim,)}
    vision_names = {n: s for n, s in shapes.items() if n.startswith(("vision.", "aligner.", "image_"))}
    assert vision_names == want
    acc = compute(config)
    n = sum(math.prod(s) for s in want.values())
    assert acc["vision_params"] == n, (acc["vision_params"], n)
