"""Rotary position embedding on the last `rope_head_dim` channels, with YaRN for compressed layers.

Adjacent channel pairs of the rotary tail are complex numbers rotated by position·frequency
(SPEC §1a). Layers with compression ratio > 0 use `compress_rope_theta` and, when
`original_seq_len > 0`, YaRN's frequency interpolation: dimensions whose wavelength already fits in
the original context keep their frequency, the slowest ones are divided by `rope_factor`, and a
linear ramp between `beta_fast` and `beta_slow` rotations blends the two. Window-only layers use
plain RoPE at `rope_theta`. Positions are explicit tensors, so packed documents restart at 0 and a
compressed entry can be rotated at its group's first position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv41.config import ModelConfig


def rope_frequencies(rope_dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> Tensor:
    """Angular frequency of each rotary pair, (rope_dim // 2,) fp32; YaRN when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:  # the dim completing `rotations` turns in the context
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def layer_frequencies(config: ModelConfig, ratio: int) -> Tensor:
    """The frequencies a layer with this compression ratio uses (window-only: plain rope_theta)."""
    if ratio:
        return rope_frequencies(config.rope_head_dim, config.compress_rope_theta, config.original_seq_len,
                                config.rope_factor, config.beta_fast, config.beta_slow)
    return rope_frequencies(config.rope_head_dim, config.rope_theta)


def rope_angles(freqs: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin of shape positions.shape + (rope_dim // 2,), fp32."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last 2·cos.size(-1) channels of x (out of place, computed in fp32).

    x: (..., T, [H,] D); cos/sin: (..., T, R/2) — a head axis in x is broadcast over."""
    rd = 2 * cos.size(-1)
    if x.dim() == cos.dim() + 1:  # x has a head axis between T and D
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rd], x[..., -rd:].float()
    pairs = rot.unflatten(-1, (-1, 2))  # (..., R/2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
