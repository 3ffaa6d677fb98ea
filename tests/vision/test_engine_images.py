"""Images through the engine (issue 20, Build 5): the vision stage's embeddings enter at prefill only.

References: the model's own training forward with `image_embeds` at the image positions (bias_vl
routing, Engram dead at image positions), recomputed in full for every generated token. The cache
formats are on (qat), so the engine and the forward round alike; tolerance = one FP4 flip."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import randomize_mixing

from dsv41 import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.prefix import PrefixCache
from dsv41.engine.prefix_store import InProcessSWAPool, PersistentStore
from dsv41.engine.sampling import SamplingParams
from dsv41.image_processor import ImageInput, expand_placeholders
from dsv41.model.transformer import Transformer
from dsv41.model.vision import encode_images

FLIP_RTOL = 2e-3  # one FP4 rounding flip between two computation orders (tests/engine/test_replay.py)
P = 14


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def vl_model(seed: int) -> Transformer:
    """tiny-vl with a 2-layer ViT, the cache formats on, and every vision / routing part O(1)-relevant:
    random ViT and aligner, span embeddings at token-embedding scale, a bias_vl unlike the text bias."""
    c = load_config("tiny-vl").replace(qat=True, vision_n_layers=2, vision_dim=32, vision_n_heads=2,
                                       vision_inter_dim=48)
    model = Transformer(c).init_weights(seed=seed).eval()
    randomize_mixing(model, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (model.vision, model.aligner):
            for name, p in module.named_parameters():
                if name.endswith("norm.weight") or "norm1" in name or "norm2" in name:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("bias") else p.shape[-1] ** -0.5))
        scale = model.embed.weight.norm(dim=-1).mean() / c.dim ** 0.5
        for p in (model.image_start, model.image_end, model.image_newline):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for moe in model.moe_layers():
            moe.gate.bias_vl.copy_(torch.randn(moe.gate.bias_vl.shape, generator=g))
    return model


def image(seed: int, h: int = 6, w: int = 9) -> ImageInput:
    """A processed image of an h × w patch grid (random patches) with its own content hash."""
    g = torch.Generator().manual_seed(seed)
    return ImageInput(torch.rand(h * w, 3 * P * P, generator=g) * 2 - 1, h, w, -(-h // 3), -(-w // 3), f"img{seed}")


def prompt_with(model: Transformer, images: list[ImageInput], seed: int, before: int = 5, after: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    c = model.config
    text = lambda n: torch.randint(7, c.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    ids = text(before)
    for _ in images:
        ids += [c.image_token_id] + text(after)
    return expand_placeholders(ids, images, c.image_token_id)


@torch.no_grad()
def forward_logits(model: Transformer, tokens: list[int], images: list[ImageInput] | None) -> torch.Tensor:
    """Last-position logits of the training forward (every layer over every token)."""
    t = torch.tensor([tokens])
    mask = t == model.config.image_token_id
    embeds = None
    if images:
        embeds = torch.cat(encode_images(model, [im.patches for im in images], [im.grid for im in images]))
    return model(t, image_mask=mask, image_embeds=embeds)[0, -1]


def engine_logits(engine: Engine, prompt: list[int], images, n: int = 1, **kw) -> tuple[list[torch.Tensor], object]:
    """The logits of the first n sampled positions (greedy) and the request."""
    seen: list[torch.Tensor] = []
    emit = engine._emit

    def capture(seqs, logits, *sampled):
        seen.append(logits[0].clone())
        return emit(seqs, logits, *sampled)

    engine._emit = capture
    req = engine.add_request(prompt, SamplingParams(max_tokens=n), images=images, **kw)
    while not req.finished:
        engine.step()
    engine._emit = emit
    return seen, req


@pytest.mark.parametrize("exact, chunk", [(True, 5), (False, 5), (False, 64)])
def test_an_image_prompt_through_the_engine_equals_the_training_forward(exact, chunk):
    """Prompt shorter than the window (encoder-only prefill is then exact too); pieces of 5 cut the spans."""
    model = vl_model(81)
    ims = [image(1), image(2, 3, 4)]
    prompt = prompt_with(model, ims, 81, before=3, after=4)
    assert len(prompt) < model.config.window_size
    want = forward_logits(model, prompt, ims)
    blind = forward_logits(model, prompt, None)  # the same ids with no image embeddings
    got, _ = engine_logits(Engine(model, prefill_chunk=chunk, max_batch=2), prompt, ims, exact_prefill=exact)
    err, gap = rel_err(got[0], want), rel_err(blind, want)
    print(f"exact={exact} chunk={chunk}: engine vs forward {err:.2e}; without the image {gap:.2e}")
    assert err <= FLIP_RTOL and gap > 20 * FLIP_RTOL


def test_decode_after_an_image_equals_the_full_forward_token_by_token():
    """`<bos> [span]`: the first decoded tokens' Engram n-grams reach back into the span (dead there)."""
    model = vl_model(82)
    ims = [image(3)]
    c = model.config
    prompt = expand_placeholders([1, c.image_token_id], ims, c.image_token_id)
    got, req = engine_logits(Engine(model, max_batch=2), prompt, ims, n=5)
    seq = list(prompt)
    for k, row in enumerate(got):
        want = forward_logits(model, seq, ims)
        err = rel_err(row, want)
        assert err <= FLIP_RTOL, f"step {k}: engine vs forward {err:.2e}"
        seq.append(int(row.argmax()))
    assert req.output == seq[len(prompt):len(prompt) + len(req.output)]


def test_the_prefix_cache_keys_images_by_content(tmp_path):
    """A conversation's second turn with the same image resumes exactly from the first turn's output-end
    snapshot and equals a cold run; the same ids with another image never hit and give other logits."""
    model = vl_model(83)
    W = model.config.window_size
    cache = PrefixCache(model.config, PersistentStore(tmp_path), InProcessSWAPool(), stride=16)
    engine = Engine(model, prefix_cache=cache, max_batch=2)
    a, b = image(4), image(5)
    first = prompt_with(model, [a], 83, before=40, after=30)  # longer than the window: units are cut
    out1 = engine_logits(engine, first, [a], n=3)[1].output
    follow = torch.randint(7, model.config.vocab_size, (W + 9,), generator=torch.Generator().manual_seed(83)).tolist()
    turn2 = first + out1 + follow
    cold = engine_logits(Engine(model, max_batch=2), turn2, [a])[0][0]
    warm, req = engine_logits(engine, turn2, [a])
    assert req.cached_tokens >= len(first) + len(out1) - 1 - cache.lcm, "the same image and ids must hit"
    err = rel_err(warm[0], cold)
    other, req_b = engine_logits(engine, turn2, [b])
    gap = rel_err(other[0], cold)
    print(f"warm vs cold with the same image: {err:.2e}; another image: {gap:.2e}")
    assert err <= FLIP_RTOL
    assert req_b.cached_tokens == 0, "another image must never hit"
    assert gap > 5 * FLIP_RTOL


def test_bad_image_requests_are_refused():
    model = vl_model(84)
    c = model.config
    engine = Engine(model, max_batch=2)
    im = image(6)
    ok = expand_placeholders([1, c.image_token_id, 9], [im], c.image_token_id)
    with pytest.raises(ValueError, match="image tokens"):
        engine.add_request(ok)  # spans without images
    with pytest.raises(ValueError, match="consecutive"):
        engine.add_request(ok[:-3] + [9, 9, 9], images=[im])  # a span cut short
    with pytest.raises(ValueError, match="no image"):
        engine.add_request(ok + [c.image_token_id], images=[im])  # a stray image token
    text = Transformer(load_config("tiny")).init_weights(seed=1).eval()
    with pytest.raises(ValueError, match="no vision"):
        Engine(text, max_batch=2).add_request([1, 9], images=[im])
    assert not engine.has_work()
