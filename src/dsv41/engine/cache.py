"""Per-sequence KV cache in the report's storage formats: packed FP4 global KV, FP8 window rings.

What one sequence keeps (SPEC §1a, §4):
  * for each kv-source (Full) layer, its compressed entries — main KV as FP4 E2M1 with an E4M3
    scale per 16 channels (256 + 32 = 288 B for 512 dims) and index keys as FP4 with an E8M0
    scale per 32 (64 + 4 = 68 B for 128 dims) — in pages that grow with the sequence (nothing is
    preallocated for a maximum length);
  * the compressor's partial group (fp32 projections and gate scores of tokens whose group of m
    has not completed yet);
  * for every layer, a ring of `window_size` slots of window KV in FP8 E4M3 with a power-of-two
    scale per 32 channels (512 + 16 = 528 B per slot);
  * the last few token ids (Engram's n-gram history).

Bytes per token are measured from the stored rows: Σ over kv sources of row bytes / ratio — 890
for the v41-flash shapes. Reads dequantize exactly to the model's fake-quant values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.config import ModelConfig
from dsv41.plan import FULL, layer_plan
from dsv41.quant.fp4 import INDEX_BLOCK, KV_BLOCK, dequantize_fp4, quantize_fp4
from dsv41.quant.fp8 import dequantize_fp8, quantize_fp8

PAGE_ROWS = 256  # entries per page of the paged global-KV store


class PagedRows:
    """Append-only uint8 rows stored in fixed-size pages (a page is allocated when the last fills)."""

    def __init__(self, row_bytes: int, device: torch.device, page_rows: int = PAGE_ROWS):
        self.row_bytes, self.page_rows, self.device = row_bytes, page_rows, device
        self.pages: list[Tensor] = []
        self.n_rows = 0

    def append(self, rows: Tensor) -> None:
        """rows: (n, row_bytes) uint8."""
        done = 0
        while done < rows.size(0):
            if self.n_rows == len(self.pages) * self.page_rows:
                self.pages.append(torch.empty(self.page_rows, self.row_bytes, dtype=torch.uint8, device=self.device))
            page, offset = divmod(self.n_rows, self.page_rows)
            take = min(self.page_rows - offset, rows.size(0) - done)
            self.pages[page][offset:offset + take] = rows[done:done + take]
            self.n_rows += take
            done += take

    def read(self, start: int = 0, end: int | None = None) -> Tensor:
        """Rows [start, end) as one (n, row_bytes) tensor."""
        end = self.n_rows if end is None else end
        if end <= start:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
        first, last = start // self.page_rows, (end - 1) // self.page_rows
        joined = torch.cat(self.pages[first:last + 1]) if last > first else self.pages[first]
        base = first * self.page_rows
        return joined[start - base:end - base]

    def gather(self, index: Tensor) -> Tensor:
        """Rows at arbitrary indices (any shape, all valid) → index.shape + (row_bytes,)."""
        flat = index.reshape(-1)
        page, offset = flat // self.page_rows, flat % self.page_rows
        stacked = torch.stack(self.pages) if len(self.pages) > 1 else self.pages[0].unsqueeze(0)
        return stacked[page, offset].view(*index.shape, self.row_bytes)



def _split(rows: Tensor, packed_bytes: int) -> tuple[Tensor, Tensor]:
    return rows[..., :packed_bytes], rows[..., packed_bytes:]


@dataclass
class EntryStore:
    """The packed compressed entries and index keys of one kv-source layer."""

    ratio: int
    head_dim: int
    index_head_dim: int
    device: torch.device
    kv: PagedRows = field(init=False)
    index_k: PagedRows = field(init=False)

    def __post_init__(self) -> None:
        self.kv_bytes = self.head_dim // 2 + self.head_dim // KV_BLOCK
        self.index_bytes = self.index_head_dim // 2 + self.index_head_dim // INDEX_BLOCK
        self.kv = PagedRows(self.kv_bytes, self.device)
        self.index_k = PagedRows(self.index_bytes, self.device)

    @property
    def n_entries(self) -> int:
        return self.kv.n_rows

    def append(self, entries: Tensor, index_keys: Tensor) -> None:
        """entries (n, head_dim), index_keys (n, index_head_dim) in float → packed rows."""
        packed, scales = quantize_fp4(entries, KV_BLOCK, "e4m3")
        self.kv.append(torch.cat((packed, scales), dim=-1))
        packed, scales = quantize_fp4(index_keys, INDEX_BLOCK, "e8m0")
        self.index_k.append(torch.cat((packed, scales), dim=-1))

    def entries(self, index: Tensor | None = None) -> Tensor:
        rows = self.kv.read() if index is None else self.kv.gather(index)
        return dequantize_fp4(*_split(rows, self.head_dim // 2), KV_BLOCK, "e4m3")

    def index_keys(self) -> Tensor:
        return dequantize_fp4(*_split(self.index_k.read(), self.index_head_dim // 2), INDEX_BLOCK, "e8m0")

    @property
    def bytes_per_entry(self) -> int:
        return self.kv.row_bytes + self.index_k.row_bytes


class WindowRing:
    """`window` slots of FP8 window KV; slot = position % window."""

    def __init__(self, window: int, head_dim: int, device: torch.device):
        self.window, self.head_dim = window, head_dim
        self.values = torch.zeros(window, head_dim, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(window, head_dim // 32, dtype=torch.uint8, device=device)
        self.positions = torch.full((window,), -1, dtype=torch.long, device=device)  # -1 = empty

    def write(self, kv: Tensor, positions: Tensor) -> None:
        """kv (n, head_dim) float at absolute positions (n,); only the last `window` matter."""
        kv, positions = kv[-self.window:], positions[-self.window:]
        values, scales = quantize_fp8(kv)
        slots = positions % self.window
        self.values[slots], self.scales[slots], self.positions[slots] = values, scales, positions

    def read(self) -> tuple[Tensor, Tensor]:
        """(window, head_dim) float KV and (window,) positions (-1 = empty)."""
        return dequantize_fp8(self.values, self.scales), self.positions

    def clear(self) -> None:
        self.positions.fill_(-1)

    @property
    def slot_bytes(self) -> int:
        return self.values.size(1) + self.scales.size(1)

    def state(self) -> dict[str, Tensor]:
        return {"values": self.values, "scales": self.scales, "positions": self.positions}

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.values.copy_(state["values"])
        self.scales.copy_(state["scales"])
        self.positions.copy_(state["positions"])


class SequenceCache:
    """Everything one sequence needs to continue decoding."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.config = c = config
        self.device = torch.device(device)
        self.plans = layer_plan(c)
        self.entry_stores: dict[int, EntryStore] = {
            p.layer_id: EntryStore(p.ratio, c.head_dim, c.index_head_dim, self.device)
            for p in self.plans if p.mode == FULL
        }
        self.windows = [WindowRing(c.window_size, c.head_dim, self.device) for _ in range(c.n_layers)]
        # compressor partial groups of m > 1 sources: fp32 projections / gate scores, oldest first
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}
        self.tokens: list[int] = []  # every token id the caches cover (prompt + generated)
        self.persisted: tuple[int, bytes | None] = (0, None)  # prefix units stored: (end, key of the last)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def bytes_per_token(self) -> float:
        """Global KV bytes per token measured from the stored row sizes: Σ row bytes / ratio."""
        return sum(s.bytes_per_entry / s.ratio for s in self.entry_stores.values())

    def global_kv_bytes(self) -> int:
        """Bytes of global KV actually held (used rows)."""
        return sum(s.n_entries * s.bytes_per_entry for s in self.entry_stores.values())

    def window_bytes(self) -> int:
        return sum(w.window * w.slot_bytes for w in self.windows)


    def clear_windows(self, layers: range | None = None) -> None:
        for i in layers if layers is not None else range(len(self.windows)):
            self.windows[i].clear()
