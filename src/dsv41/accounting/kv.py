"""KV-cache bytes: entry formats, global KV per token by kv-source layer, the V4-Flash baseline.

Storage-format facts only (E2M1 is 4 bits, a scale is one byte): `fp4_entry_bytes` /
`fp8_entry_bytes` are torch-free twins of `dsv41.quant`'s (a test checks they agree). SPEC §1, §4, §6.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from dsv41.config import ModelConfig
from dsv41.plan import FULL, layer_plan

# ---------------------------------------------------------------------- storage formats
SCALE_BYTES = 1  # E4M3 and E8M0 scales are one byte each
BF16_BYTES = 2
KV_SCALE_BLOCK = 16  # main KV entry: one E4M3 scale per 16 channels (SPEC §1a)
INDEX_SCALE_BLOCK = 32  # index key: one E8M0 scale per 32 channels
WINDOW_SCALE_BLOCK = 32  # window slot: FP8 E4M3 values, one power-of-two scale per 32 channels


def fp4_entry_bytes(dim: int, block: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of an E2M1 row: half a byte per channel + one scale per block. A torch-free twin of
    `dsv41.quant.fp4.fp4_entry_bytes` (tests check they agree), so accounting needs no torch."""
    if dim % 2 or dim % block:
        raise ValueError(f"fp4_entry_bytes: dim={dim} must be even and divisible by block={block}")
    return dim // 2 + dim // block * scale_bytes


def fp8_entry_bytes(dim: int, block: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes of an E4M3 row: one byte per channel + one scale per block (twin of quant.fp8's)."""
    if dim % block:
        raise ValueError(f"fp8_entry_bytes: dim={dim} must be divisible by block={block}")
    return dim + dim // block * scale_bytes


# ---------------------------------------------------------------------- KV cache
@dataclass(frozen=True)
class V4FlashCache:
    """DeepSeek-V4-Flash's cache geometry, from its public config.json and inference code — the
    baseline the report compares against (SPEC §6). Not derived from our config."""

    n_layers: int = 43
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)  # 21 layers at m=4, 20 at m=128
    indexed_ratios: tuple[int, ...] = (4,)  # CSA layers (m=4) own a lightning indexer; HCA (m=128) do not
    nope_dims: int = 448  # FP8 E4M3 channels
    nope_scale_bytes: int = 8  # 7 E8M0 scales (one per 64 channels) padded to 8 bytes
    rope_dims: int = 64  # kept in BF16
    index_head_dim: int = 128  # FP4 index keys, E8M0 scale per 32
    window_size: int = 128  # SWA slots in every layer, same entry format as the main KV

    @property
    def main_entry_bytes(self) -> int:
        return self.nope_dims + self.nope_scale_bytes + self.rope_dims * BF16_BYTES

    @property
    def index_entry_bytes(self) -> int:
        return fp4_entry_bytes(self.index_head_dim, INDEX_SCALE_BLOCK)

    @property
    def global_bytes_per_token(self) -> float:
        total = Fraction(0)
        for m in self.compress_ratios:
            if m:
                idx = self.index_entry_bytes if m in self.indexed_ratios else 0
                total += Fraction(self.main_entry_bytes + idx, m)
        return float(total)

    @property
    def window_snapshot_bytes(self) -> int:
        """One saved SWA state: every layer's window."""
        return self.n_layers * self.window_size * self.main_entry_bytes

    def persistent_bytes_per_token(self, unit_tokens: int) -> float:
        """Global KV + two window snapshots (end of prompt, end of output) per saved unit."""
        return self.global_bytes_per_token + 2 * self.window_snapshot_bytes / unit_tokens


def entry_bytes(c: ModelConfig) -> dict[str, int]:
    return {
        "main": fp4_entry_bytes(c.head_dim, KV_SCALE_BLOCK),
        "index_key": fp4_entry_bytes(c.index_head_dim, INDEX_SCALE_BLOCK),
        "window_slot": fp8_entry_bytes(c.head_dim, WINDOW_SCALE_BLOCK),
    }


def _json_number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def global_kv_by_source(c: ModelConfig) -> dict[int, Fraction]:
    """Bytes per token each kv-source (Full) layer keeps: (main + index-key entry) / m."""
    e = entry_bytes(c)
    entry = e["main"] + e["index_key"]
    return {p.layer_id: Fraction(entry, p.ratio) for p in layer_plan(c) if p.mode == FULL}

