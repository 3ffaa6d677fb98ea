"""DeepSeek-ViT and the aligner: image patches → embeddings at the backbone width (SPEC §5 "Vision").

Key ideas:
- The ViT embeds each 14 × 14 RGB patch with one linear map (no convolution), has no absolute
  positions — 2D RoPE on the patch (row, column) — so any grid works, and attends bidirectionally
  within one image only. Pre-norm blocks: RMSNorm → attention (fused `wqkv`, `wo`, both with bias)
  and RMSNorm → bias-free SwiGLU (`w1` emits [gate | up]); a final RMSNorm.
- 2D RoPE: of the head_dim/2 rotation angles of a head, the first head_dim/4 are the patch row times
  frequencies θ^(−4j/head_dim), the next head_dim/4 the column times the same frequencies; channel i
  is paired with channel i + head_dim/2 (the half-split convention) and the pair turns by angle i.
  SPEC's write-up says the h and w frequencies are "interleaved"; every public port of the release's
  code lays them out as [row block | column block], so we follow the code (SPEC §1a).
- The aligner pads the patch grid with zeros to a multiple of r = 3, gathers each r × r block into one
  vector, channel-major ((C, kh, kw), the order of `F.unfold`), then linear → exact GELU → linear.
- A batch of images of different sizes is padded to the longest; padded patches are masked out as
  keys and carry no angles, so an image's output does not depend on its batch neighbours.

Names and shapes are the release's (so its `vision.*` / `aligner.*` tensors load unchanged). Source:
public ports of the release's `inference/vision.py` — NVIDIA Megatron-LM
`megatron/core/models/deepseek_v41/vision.py`, vLLM's DeepSeek-V4 vision tower, timm's
`deepseek_vit` checkpoint filter — and the release's `inference/image_processor.py`:

    vision.patch_embed.proj.{weight, bias}        (D, 3·p²), (D,)
    vision.blocks.{i}.norm1.weight                (D,)
    vision.blocks.{i}.attn.wqkv.{weight, bias}    (3D, D), (3D,)
    vision.blocks.{i}.attn.wo.{weight, bias}      (D, D), (D,)
    vision.blocks.{i}.norm2.weight                (D,)
    vision.blocks.{i}.mlp.w1.weight               (2I, D)   [gate | up]
    vision.blocks.{i}.mlp.w2.weight               (D, I)
    vision.norm.weight                            (D,)
    aligner.w1.{weight, bias}                     (dim, r²·D), (dim,)
    aligner.w2.{weight, bias}                     (dim, dim), (dim,)
    image_start, image_end, image_newline         (dim,)    (the Transformer's: span embeddings)

The vision RMSNorm epsilon is 1e-6 in every port (the config has no key for it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ModelConfig
from dsv41.model.norm import RMSNorm

VISION_NORM_EPS = 1e-6  # the release's vision RMSNorm epsilon (not a config key)


# ---------------------------------------------------------------------- 2D RoPE
def vision_rope_angles(n_h: int, n_w: int, head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """Rotation angles of an n_h × n_w patch grid in raster order: (n_h·n_w, head_dim // 2) fp32,
    [row · f_j for j < head_dim/4] ++ [column · f_j], f_j = θ^(−4j / head_dim)."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dim divisible by 4, got {head_dim}")
    j = torch.arange(head_dim // 4, dtype=torch.float32, device=device)
    freqs = theta ** (-4.0 * j / head_dim)  # (head_dim/4,)
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()  # (N,) patch row
    cols = torch.arange(n_w, device=device).repeat(n_h).float()  # (N,) patch column
    return torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)  # (N, head_dim/2)


def apply_vision_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split rotation in fp32: x (..., N, H, hd), cos/sin (..., N, hd/2); pair (x_i, x_{i+hd/2})."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ---------------------------------------------------------------------- the ViT
class PatchEmbed(nn.Module):
    """One linear map per flattened (C, p, p) patch, with bias."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(3 * config.vision_patch_size ** 2, config.vision_dim)

    def forward(self, patches: Tensor) -> Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches with 2D RoPE on q and k."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.vision_n_heads
        self.head_dim = config.vision_dim // config.vision_n_heads
        self.wqkv = nn.Linear(config.vision_dim, 3 * config.vision_dim)
        self.wo = nn.Linear(config.vision_dim, config.vision_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """x (B, N, D); cos/sin (B, N, hd/2); key_mask (B, N) True = a real patch (None: all real)."""
        B, N, D = x.shape
        q, k, v = self.wqkv(x).view(B, N, 3, self.n_heads, self.head_dim).unbind(2)  # each (B, N, H, hd)
        q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
        bias = None
        if key_mask is not None:  # padded patches are never keys (their queries still see real keys)
            bias = torch.zeros(B, 1, 1, N, dtype=q.dtype, device=x.device).masked_fill(
                ~key_mask[:, None, None, :], float("-inf"))  # (B, 1, 1, N)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias)  # (B, H, N, hd)
        return self.wo(o.transpose(1, 2).reshape(B, N, D))  # (B, N, D)


class VisionMLP(nn.Module):
    """Bias-free SwiGLU: w2(silu(gate) · up), [gate | up] = w1(x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.vision_dim, 2 * config.vision_inter_dim, bias=False)
        self.w2 = nn.Linear(config.vision_inter_dim, config.vision_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.vision_dim, VISION_NORM_EPS)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.vision_dim, VISION_NORM_EPS)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, key_mask)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """DeepSeek-ViT: patches (B, N, 3·p²) of images with grids [(h, w), ...] → features (B, N, D)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.patch_size = config.vision_patch_size
        self.head_dim = config.vision_dim // config.vision_n_heads
        self.rope_theta = config.vision_rope_theta
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vision_n_layers))
        self.norm = RMSNorm(config.vision_dim, VISION_NORM_EPS)

    def rope(self, grids: list[tuple[int, int]], n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin (B, n, hd/2) of each image's grid; padded positions get angle 0."""
        angles = torch.zeros(len(grids), n, self.head_dim // 2, device=device)
        for b, (h, w) in enumerate(grids):
            angles[b, :h * w] = vision_rope_angles(h, w, self.head_dim, self.rope_theta, device)
        return angles.cos(), angles.sin()

    def forward(self, patches: Tensor, grids: list[tuple[int, int]]) -> Tensor:
        B, N, _ = patches.shape
        if len(grids) != B:
            raise ValueError(f"{B} images of patches but {len(grids)} grids")
        counts = [h * w for h, w in grids]
        if max(counts) > N:
            raise ValueError(f"a grid of {max(counts)} patches does not fit {N} patch rows")
        key_mask = None
        if min(counts) < N:
            key_mask = torch.arange(N, device=patches.device) < torch.tensor(counts, device=patches.device)[:, None]
        cos, sin = self.rope(grids, N, patches.device)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin, key_mask)
        return self.norm(x)


# ---------------------------------------------------------------------- the aligner
def pixel_unshuffle(x: Tensor, r: int) -> Tensor:
    """(h, w, C) features → (⌈h/r⌉·⌈w/r⌉, C·r²): zero-pad to multiples of r, gather every r × r block,
    channel-major within a block (C, kh, kw); blocks in raster order."""
    h, w, C = x.shape
    x = F.pad(x, (0, 0, 0, -w % r, 0, -h % r))  # (H', W', C), zeros at the bottom / right
    hb, wb = x.shape[0] // r, x.shape[1] // r
    x = x.view(hb, r, wb, r, C).permute(0, 2, 4, 1, 3)  # (hb, wb, C, r, r)
    return x.reshape(hb * wb, C * r * r)


class Aligner(nn.Module):
    """3 × 3 pixel-unshuffle, then w2(gelu(w1(x))) to the backbone width (the release's projector)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ratio = config.vision_downsample_ratio
        self.w1 = nn.Linear(config.vision_dim * self.ratio ** 2, config.dim)
        self.w2 = nn.Linear(config.dim, config.dim)

    def grid(self, h: int, w: int) -> tuple[int, int]:
        """The token grid (⌈h/r⌉, ⌈w/r⌉) of an h × w patch grid."""
        return math.ceil(h / self.ratio), math.ceil(w / self.ratio)

    def forward(self, features: Tensor, grids: list[tuple[int, int]]) -> list[Tensor]:
        """features (B, N, D) of images with patch grids [(h, w)] → [(⌈h/r⌉·⌈w/r⌉, dim)] per image."""
        rows = [pixel_unshuffle(features[b, :h * w].view(h, w, -1), self.ratio) for b, (h, w) in enumerate(grids)]
        sizes = [r.shape[0] for r in rows]
        out = self.w2(F.gelu(self.w1(torch.cat(rows))))  # exact (erf) GELU, one matmul for the batch
        return list(out.split(sizes))


# ---------------------------------------------------------------------- image spans in the token sequence
def image_span(tokens: Tensor, h: int, w: int, start: Tensor, newline: Tensor, end: Tensor) -> Tensor:
    """The embeddings of one image's positions: start, then per row w tokens + newline, then end.
    tokens (h·w, dim) → (h·(w + 1) + 2, dim)."""
    dim = tokens.shape[-1]
    body = torch.cat([tokens.view(h, w, dim), newline.to(tokens.dtype).expand(h, 1, dim)], dim=1)  # (h, w+1, dim)
    return torch.cat([start.to(tokens.dtype)[None], body.reshape(h * (w + 1), dim), end.to(tokens.dtype)[None]])


def encode_images(model: nn.Module, patches: list[Tensor], grids: list[tuple[int, int]]) -> list[Tensor]:
    """The vision-encoding stage: each image's patches (h·w, 3·p²) and patch grid (h, w) → its span
    embeddings (⌈h/3⌉·(⌈w/3⌉ + 1) + 2, dim), through `model.vision`, `model.aligner` and the span
    embeddings `model.image_start / image_newline / image_end`. Runs as one padded ViT batch; it
    needs nothing but the weights, so it can run on its own workers (EPD)."""
    if not patches:
        return []
    n = max(p.shape[0] for p in patches)
    dtype = model.aligner.w1.weight.dtype
    batch = torch.stack([F.pad(p.to(dtype), (0, 0, 0, n - p.shape[0])) for p in patches])  # (B, n, 3·p²)
    tokens = model.aligner(model.vision(batch, grids), grids)
    out = []
    for t, (h, w) in zip(tokens, grids):
        th, tw = model.aligner.grid(h, w)
        out.append(image_span(t, th, tw, model.image_start, model.image_newline, model.image_end))
    return out


@torch.no_grad()
def init_vision(model: nn.Module, std: float = 0.02) -> None:
    """Training init of the vision parts (after the Transformer's normal(std) of every matrix): zero
    biases, normal(std) span embeddings (their norm stays comparable to a token embedding's)."""
    for module in (model.vision, model.aligner):
        for name, p in module.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    for p in (model.image_start, model.image_end, model.image_newline):
        nn.init.normal_(p, std=std)
