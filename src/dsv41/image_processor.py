"""Image processor: bytes or pixels → ViT patches, the span layout, and prompt expansion (SPEC §5).

The release's policy (`inference/image_processor.py`, read for facts):
- an image smaller than `vision_min_pixels` is scaled up (aspect kept) to about that many pixels;
- each side is rounded up to a multiple of the patch size p; the backbone grid is
  (⌈(H/p)/r⌉, ⌈(W/p)/r⌉) with r = `vision_downsample_ratio`;
- if that grid's span h·(w + 1) + 2 exceeds `vision_max_n_token`, the size is solved down so the
  span fits (largest w with h·(w + 1) + 2 ≤ cap at the image's aspect ratio);
- the image is letterboxed into that size (aspect kept, centred) on grey (127, 127, 127), scaled to
  [−1, 1] by (x/255 − 0.5)/0.5 and cut into raster-order p × p patches, each flattened (C, p, p).

Layout of one image in the token sequence: IMAGE_START, then per row w IMAGE tokens and one
IMAGE_NEW_LINE, then IMAGE_END — h·(w + 1) + 2 positions, every one holding `image_token_id` (as in
the release; the embeddings come from the vision side, `model/vision.image_span`). A prompt carries
one `image_token_id` placeholder per image; `expand_placeholders` widens each to its span.

Decisions (named here, configurable by the caller): an image with transparency is composited on the
same grey as the padding (the release drops the alpha channel); `ImageLimits` bounds the encoded
size, the formats and the decoded pixel count, and every malformed input raises `ImageError`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dsv41.config import ModelConfig

IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)  # position types of a span (the release's values)
PAD_GREY = (127, 127, 127)


class ImageError(ValueError):
    """An image that cannot be used: malformed, too large, an unsupported format or a remote URL."""


class ImageTooLarge(ImageError):
    """An image over `ImageLimits` (encoded bytes or decoded pixels): the server answers 413."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 * 1024 * 1024  # encoded size
    max_pixels: int = 4096 * 4096  # decoded width × height (decompression bombs)
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageInput:
    """One image ready for the ViT."""

    patches: Tensor = field(repr=False)  # (vit_h·vit_w, 3·p²) fp32 in [−1, 1], raster order, each (C, p, p)
    vit_h: int  # patch grid
    vit_w: int
    llm_h: int  # backbone token grid (after the r × r unshuffle)
    llm_w: int
    sha256: str  # content hash (of the encoded bytes, or of the pixels): part of the prefix-cache key

    @property
    def n_positions(self) -> int:
        return num_image_positions(self.llm_h, self.llm_w)

    @property
    def grid(self) -> tuple[int, int]:
        return self.vit_h, self.vit_w


def num_image_positions(h: int, w: int) -> int:
    """Sequence positions of an image whose backbone grid is h × w: start, h rows of w + newline, end."""
    return h * (w + 1) + 2


def image_token_types(h: int, w: int) -> list[int]:
    return [IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * h + [IMAGE_END]


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _solve_size(height: int, width: int, p: int, r: int, cap: int) -> tuple[int, int]:
    """The largest (height, width), multiples of p, whose span fits `cap` at this aspect ratio."""
    aspect = height / width
    # h·(w + 1) + 2 ≤ cap with h = aspect·w  ⇒  w ≤ sqrt((cap − 2)/aspect + 1/4) − 1/2 (in cells of p·r)
    max_w = math.sqrt((cap - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    cell = p * r
    if max_w < 1.0:  # a very tall image: one column of cells
        return (cap - 2) // 2 * cell, cell
    if max_h < 1.0:  # a very wide image: one row of cells
        return cell, (cap - 3) * cell
    scale = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, config: ModelConfig) -> tuple[int, int, int, int]:
    """(llm_h, llm_w, padded height, padded width) of a width × height image under the release's policy."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image size must be positive, got {width}x{height}")
    p, r, cap = config.vision_patch_size, config.vision_downsample_ratio, config.vision_max_n_token
    if config.vision_max_wh_ratio is not None and max(width / height, height / width) > config.vision_max_wh_ratio:
        raise ImageError(f"aspect ratio of {width}x{height} exceeds {config.vision_max_wh_ratio}")
    if width * height < config.vision_min_pixels:
        up = math.sqrt(config.vision_min_pixels / (width * height))
        width, height = int(width * up), int(height * up)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    h, w = _llm_grid(best_h, best_w, p, r)
    if num_image_positions(h, w) > cap:
        best_h, best_w = _solve_size(height, width, p, r, cap)
        h, w = _llm_grid(best_h, best_w, p, r)
    return h, w, best_h, best_w


def _rgb(image):
    """RGB, with any transparency composited on the padding grey."""
    from PIL import Image

    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, PAD_GREY + (255,))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def patchify(pixels: np.ndarray | Tensor, p: int) -> Tensor:
    """uint8 (H, W, 3) with H, W multiples of p → (H/p · W/p, 3·p²) fp32 in [−1, 1], each patch (C, p, p)."""
    x = torch.from_numpy(np.array(pixels, dtype=np.float32)).permute(2, 0, 1) / 255  # (3, H, W)
    x = (x - 0.5) / 0.5
    C, H, W = x.shape
    x = x.view(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4)  # (H/p, W/p, C, p, p)
    return x.reshape((H // p) * (W // p), C * p * p)


def preprocess(image, config: ModelConfig, sha256: str | None = None) -> ImageInput:
    """A PIL image → ImageInput under the release's resize / pad policy (module docstring)."""
    from PIL import ImageOps

    image = _rgb(image)
    h, w, best_h, best_w = plan_grid(image.width, image.height, config)
    p = config.vision_patch_size
    boxed = ImageOps.pad(image, (best_w, best_h), color=PAD_GREY)  # aspect kept, centred, grey around
    pixels = np.asarray(boxed, dtype=np.uint8)
    digest = sha256 or hashlib.sha256(pixels.tobytes() + f"{best_w}x{best_h}".encode()).hexdigest()
    return ImageInput(patchify(pixels, p), best_h // p, best_w // p, h, w, digest)


def from_pixels(pixels: np.ndarray, config: ModelConfig) -> ImageInput:
    """uint8 (H, W, 3) or (H, W) pixels → ImageInput (the training data path; same policy)."""
    from PIL import Image

    arr = np.asarray(pixels, dtype=np.uint8)
    return preprocess(Image.fromarray(arr if arr.ndim == 3 else np.stack([arr] * 3, -1)), config)


def decode_image(data: bytes, config: ModelConfig, limits: ImageLimits | None = None) -> ImageInput:
    """Encoded image bytes → ImageInput; every bad input raises ImageError (never another exception)."""
    from PIL import Image, UnidentifiedImageError

    limits = limits or ImageLimits()
    if not data:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"the image has {len(data)} bytes, more than the limit of {limits.max_bytes}")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in limits.formats:
                raise ImageError(f"image format {im.format} is not accepted (accepted: {', '.join(limits.formats)})")
            if im.width * im.height > limits.max_pixels:
                raise ImageTooLarge(f"the image is {im.width}x{im.height} pixels, more than the limit of "
                                 f"{limits.max_pixels} pixels")
            im.load()
            return preprocess(im, config, hashlib.sha256(data).hexdigest())
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image cannot be decoded ({type(e).__name__}: {e})") from None


def data_url_bytes(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL. Remote URLs are refused: the server never fetches."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("http", "https", "ftp", "file"):
        raise ImageError(f"remote image URLs ({scheme}://) are not fetched; send the image inline as a "
                         f"data:image/...;base64 URL")
    header, sep, payload = url.partition(",")
    if scheme != "data" or not sep:
        raise ImageError("image_url.url must be a data:image/...;base64,... URL")
    if not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise ImageError("image data URLs must be data:image/<format>;base64,...")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL is not valid base64") from None


def expand_placeholders(tokens: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Each `image_token_id` placeholder (one per image, in order) widened to its image's span."""
    n = sum(t == image_token_id for t in tokens)
    if n != len(images):
        raise ImageError(f"the prompt has {n} image placeholders but {len(images)} images were given")
    out: list[int] = []
    pending = iter(images)
    for t in tokens:
        out += [t] * (next(pending).n_positions if t == image_token_id else 1)
    return out


def image_positions(tokens: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Start position of each image's span in an expanded prompt; raises ImageError if they do not fit."""
    starts, i = [], 0
    for im in images:
        while i < len(tokens) and tokens[i] != image_token_id:
            i += 1
        if tokens[i:i + im.n_positions] != [image_token_id] * im.n_positions:
            raise ImageError(f"image {len(starts)} needs {im.n_positions} consecutive image tokens at position {i}")
        starts.append(i)
        i += im.n_positions
    if any(t == image_token_id for t in tokens[i:]):
        raise ImageError("the prompt has image tokens that belong to no image")
    return starts


def chat_ids_with_images(tok, segments: list[tuple[str, bool]], image_token_id: int, marker: str) -> list[int]:
    """Token ids of chat-template `segments` ((text, is_control) pieces, `tokenizer.chat_segments`) where each
    `marker` inside message text is one `image_token_id` placeholder; markers are control text, message text
    stays literal (what the server and `dsv41 generate --chat --image` both build)."""
    ids: list[int] = []
    for text, control in segments:
        if control:
            ids += tok.encode(text, allow_special=True)
            continue
        for k, part in enumerate(text.split(marker)):
            ids += [image_token_id] * (k > 0) + (tok.encode(part) if part else [])
    return ids
