"""`image_processor`: the release's pixel policy from SPEC §5 — padding grey 127, (x/255 − 0.5)/0.5, patches
flattened (C, p, p) as `Linear(3·14² → d)` reads a conv kernel — checked against loops over the pixels, and the
content hash that keys a request's prefix units (engine/prefix.image_namespace)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41 import load_config
from dsv41.image_processor import ImageError, from_pixels, patchify, plan_grid


def test_patches_are_normalized_channel_major_pixel_blocks_in_raster_order():
    p = 14
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (2 * p, 3 * p, 3), dtype=np.uint8)
    out = patchify(pixels, p).numpy()
    assert out.shape == (6, 3 * p * p)
    for i in range(2):
        for j in range(3):
            want = []
            for c in range(3):
                for y in range(p):
                    for x in range(p):
                        want.append((pixels[i * p + y, j * p + x, c] / 255 - 0.5) / 0.5)
            np.testing.assert_allclose(out[i * 3 + j], np.array(want, np.float32), rtol=0, atol=1e-6)


def test_an_image_is_padded_with_grey_127_around_its_centre():
    """A wide red image padded to its grid: rows above and below it are grey 127 (normalized), its middle red."""
    c = load_config("tiny-vl")
    img = np.zeros((60, 300, 3), np.uint8)
    img[..., 0] = 255
    im = from_pixels(img, c)
    p = c.vision_patch_size
    patches = im.patches.numpy().reshape(im.vit_h, im.vit_w, 3, p, p)
    grey = (127 / 255 - 0.5) / 0.5
    np.testing.assert_allclose(patches[0, im.vit_w // 2, :, 0, :], grey, atol=1e-6)  # the top row: padding
    np.testing.assert_allclose(patches[-1, im.vit_w // 2, :, -1, :], grey, atol=1e-6)  # the bottom row too
    middle = patches[im.vit_h // 2, im.vit_w // 2, :, p // 2, p // 2]
    np.testing.assert_allclose(middle, [1.0, -1.0, -1.0], atol=1e-6)  # the image itself: pure red


def test_an_aspect_ratio_past_the_configured_limit_is_refused():
    c = load_config("tiny-vl").replace(vision_max_wh_ratio=4.0)
    plan_grid(400, 100, c)  # exactly 4: allowed
    with pytest.raises(ImageError, match="aspect ratio"):
        plan_grid(401, 100, c)
    with pytest.raises(ImageError, match="aspect ratio"):
        plan_grid(100, 401, c)
    plan_grid(1000, 10, load_config("tiny-vl"))  # no limit configured (the presets): any aspect


def test_the_content_hash_tells_apart_images_with_the_same_pixel_bytes_in_another_shape():
    """Two images whose pixel bytes are identical but laid out as 84 × 168 and 168 × 84 are different images: their
    hashes (the prefix-cache key of their spans) differ; the same image hashes the same."""
    c = load_config("tiny-vl")
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 256, (84, 168, 3), dtype=np.uint8)
    tall = wide.reshape(168, 84, 3)
    a, b = from_pixels(wide, c), from_pixels(tall, c)
    assert a.sha256 == from_pixels(wide.copy(), c).sha256
    assert a.sha256 != b.sha256
