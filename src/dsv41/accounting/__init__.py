"""Accounting: parameters, active parameters, KV-cache bytes and FLOPs, derived from a ModelConfig.

This is the report's summary table (SPEC §1, §6) recomputed from the config and the layer plan,
so a changed preset changes every number. Nothing here is a constant standing in for a result;
the only literals are storage-format facts (E2M1 is 4 bits, a scale is one byte, a BF16 value is
two bytes) and V4-Flash's published cache geometry (`V4FlashCache`), which is the baseline the
report compares against. Definitions and every assumption are in docs/accounting.md.

By concept: `params` (the inventory), `kv` (entry formats, global KV, the V4-Flash baseline),
`flops` (decode / prefill), `checkpoint_bytes` (the release-format size per component); this
module assembles them (`compute`) and prints the table (`format_report`).

Parameter structure = the official state dict (SPEC §1a): `Param` rows named as the checkpoint
names them; routed experts are one row standing for E tensors. No torch: `dsv41 accounting` and
`dsv41 plan` stay instant.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from dsv41.accounting.checkpoint_bytes import RELEASE_TOTAL_SIZE, checkpoint_bytes
from dsv41.accounting.flops import (
    _flops_over,
    _layer_costs,
    decode_contexts,
    decode_flops,
    prefill_flops,
    prefill_lengths,
    sum_visible,
)
from dsv41.accounting.kv import (
    V4FlashCache,
    _json_number,
    entry_bytes,
    fp4_entry_bytes,
    fp8_entry_bytes,
    global_kv_by_source,
)
from dsv41.accounting.params import (
    LINEAR,
    LOOKUP,
    VECTOR,
    Param,
    _active,
    _by_group,
    _producer,
    _total,
    block_params,
    dspark_params,
    engram_params,
    text_params,
    vision_params,
)
from dsv41.checkpoint.release_format import ReleaseFormatError
from dsv41.config import ModelConfig, load_config
from dsv41.plan import FULL, REINDEX, REUSE, WINDOW, decoder_kv_source, layer_plan

__all__ = [
    "LINEAR", "LOOKUP", "PERSISTENT_UNITS", "REPORT", "VECTOR", "Param", "V4FlashCache", "block_params",
    "checkpoint_bytes", "compute", "decode_flops", "dspark_params", "engram_params", "entry_bytes",
    "format_report", "fp4_entry_bytes", "fp8_entry_bytes", "global_kv_by_source", "prefill_flops",
    "sum_visible", "text_params", "vision_params",
]

# ---------------------------------------------------------------------- the table
REPORT = {  # the report's own figures (SPEC §1), printed beside ours for v41-flash only
    "backbone_params": 552e9,
    "engram_params": 196e9,
    "active_params_prefill": 8e9,
    "active_params_decode": 16e9,
    "global_kv_bytes_per_token": 890,
    "v4_global_kv_bytes_per_token": 3514,
    "v4_global_ratio": 4.0,  # "≈ ¼ of V4-Flash"
    "v4_persistent_ratio": 8.0,  # "≈ ⅛ of V4-Flash"
    "decode_flops_growth": 0.25,  # "4K → 1M raises decode FLOPs by only ≈ 25%"
}
PERSISTENT_UNITS = (512, 1024, 2048, 4096, 16384)  # saved-unit lengths for the persistent comparison


def compute(config: ModelConfig) -> dict[str, Any]:
    """Every accounting figure of a config as a JSON-safe dict (keys documented in docs/accounting.md)."""
    c = config
    plans = layer_plan(c)
    text = text_params(c)
    blocks = {p.layer_id: block_params(c, p) for p in plans}
    backbone_list = text + [q for ps in blocks.values() for q in ps]
    backbone = _total(backbone_list)

    engram_list = [q for i in c.engram_layer_ids for q in engram_params(c, i)]
    gathered = c.n_engram_hash_cols * c.engram_head_dim  # one row per hash id
    engram_active = sum(gathered + _total([q for q in engram_params(c, i) if q.kind != LOOKUP])
                        for i in c.engram_layer_ids)

    embed = _total([q for q in text if q.group == "embed"])
    head_norm = _total([q for q in text if q.group != "embed"])
    layers_active = {i: _active(ps) for i, ps in blocks.items()}
    decode_active = embed + sum(layers_active.values()) + head_norm
    encoder_active = sum(layers_active[p.layer_id] for p in plans if p.half == "encoder")
    src = decoder_kv_source(c)
    producer = _total(_producer(blocks[src])) if src is not None else 0
    prefill_active = embed + encoder_active + producer

    kv_sources = global_kv_by_source(c)
    global_kv = sum(kv_sources.values(), Fraction(0))
    e = entry_bytes(c)
    v4 = V4FlashCache()
    persistent = [
        {"unit_tokens": u, "v4_bytes_per_token": v4.persistent_bytes_per_token(u),
         "ours_bytes_per_token": _json_number(global_kv),
         "ratio": v4.persistent_bytes_per_token(u) / float(global_kv) if global_kv else None}
        for u in PERSISTENT_UNITS
    ]
    # unit length up to which V4's persistent bytes are ≥ 8× ours
    gap = 8 * float(global_kv) - v4.global_bytes_per_token
    units_8x = (2 * v4.window_snapshot_bytes / gap if gap > 0 else math.inf) if global_kv else None

    contexts = decode_contexts(c)
    decode = {str(n): decode_flops(c, n) for n in contexts}
    growth = decode[str(contexts[-1])]["total"] / decode[str(contexts[0])]["total"] - 1
    costs = _layer_costs(c)
    indexer_by_half = {
        str(n): {half: _flops_over(c, [lc for lc in costs if lc.plan.half == half], n - 1, n)["indexer"]
                 for half in ("encoder", "decoder")}
        for n in contexts
    }
    prefill = {str(n): prefill_flops(c, n) for n in prefill_lengths(c)}

    dspark = dspark_params(c)
    vision = vision_params(c)
    try:
        stored = checkpoint_bytes(backbone_list + engram_list + dspark + vision)
        stored["by_part"] = {part: checkpoint_bytes(ps)["total"] for part, ps in (
            ("backbone", backbone_list), ("engram", engram_list), ("dspark", dspark), ("vision", vision))}
    except ReleaseFormatError as err:  # e.g. an expert width the MXFP4 blocks of 32 cannot hold
        stored = {"total": None, "error": str(err)}
    return {
        "backbone_params": backbone,
        "backbone_breakdown": _by_group(backbone_list),
        "engram_params": _total(engram_list),
        "engram_breakdown": _by_group(engram_list),
        "engram_params_per_layer": {str(i): _total(engram_params(c, i)) for i in c.engram_layer_ids},
        "engram_active_params": engram_active,
        "active_params_decode": decode_active,
        "active_decode_breakdown": {"embed": embed, "layers": sum(layers_active.values()),
                                    "norm_and_head": head_norm},
        "active_params_prefill": prefill_active,
        "active_prefill_breakdown": {"embed": embed, "encoder_layers": encoder_active,
                                     "decoder_global_kv_producer": producer},
        "per_layer": [{"layer": p.layer_id, "half": p.half, "mode": p.mode,
                       "params": _total(blocks[p.layer_id]), "active_params": layers_active[p.layer_id]}
                      for p in plans],
        "dspark_params": _total(dspark),
        "dspark_breakdown": _by_group(dspark),
        "vision_params": _total(vision),
        "vision_breakdown": _by_group(vision),
        "entry_bytes": e,
        "global_kv_bytes_per_token": _json_number(global_kv),
        "global_kv_by_source": {str(i): _json_number(b) for i, b in kv_sources.items()},
        "window_kv_bytes_per_sequence": c.n_layers * c.window_size * e["window_slot"],
        "v4_flash": {
            "main_entry_bytes": v4.main_entry_bytes,
            "index_entry_bytes": v4.index_entry_bytes,
            "global_kv_bytes_per_token": v4.global_bytes_per_token,
            "window_snapshot_bytes": v4.window_snapshot_bytes,
            "global_ratio": v4.global_bytes_per_token / float(global_kv) if global_kv else None,
            "persistent": persistent,
            "unit_tokens_at_8x": units_8x,
        },
        "decode_flops": decode,
        "decode_flops_growth": growth,
        "decode_flops_growth_contexts": [contexts[0], contexts[-1]],
        "decode_indexer_flops_by_half": indexer_by_half,
        "prefill_flops": prefill,
        "checkpoint_bytes": stored,
    }


# ---------------------------------------------------------------------- printing
def _is_published(c: ModelConfig) -> bool:
    return c == load_config("v41-flash")


def _fmt_params(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:g}"


def _flop_unit(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0.0)
    for div, name in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "KFLOP")):
        if top >= div:
            return div, name
    return 1.0, "FLOP"


def _short(n: int) -> str:
    for div, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if j == 0 else cell.rjust(w)
                       for j, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_report(config: ModelConfig, published: bool | None = None) -> str:
    """The accounting as text; beside each figure the report's own when the config is v41-flash."""
    c = config
    r = compute(c)
    pub = _is_published(c) if published is None else published
    v4 = r["v4_flash"]
    ours_ratio_8x = r["v4_flash"]["persistent"]

    head = ("quantity", "ours", "report", "diff") if pub else ("quantity", "ours")
    rows: list[tuple[str, ...]] = [head]

    def row(label: str, ours: float, shown: str, key: str | None = None, fmt=None) -> None:
        if not pub:
            rows.append((label, shown))
            return
        ref = REPORT.get(key) if key else None
        if ref is None:
            rows.append((label, shown, "", ""))
        else:
            rows.append((label, shown, fmt(ref) if fmt else str(ref), f"{(ours - ref) / ref * 100:+.2f}%"))

    for label, key, in_report in (
        ("backbone params", "backbone_params", True),
        ("Engram params", "engram_params", True),
        ("active params / token, prefill", "active_params_prefill", True),
        ("active params / token, decode", "active_params_decode", True),
        ("Engram active params / token", "engram_active_params", False),
        ("DSpark params (not backbone)", "dspark_params", False),
        ("vision params (not backbone)", "vision_params", False),
    ):
        row(label, r[key], _fmt_params(r[key]), key if in_report else None, _fmt_params)
    g = r["global_kv_bytes_per_token"]
    row("global KV bytes / token", g, f"{g:g}", "global_kv_bytes_per_token", lambda x: f"{x:g}")
    row("V4-Flash global KV bytes / token", v4["global_kv_bytes_per_token"],
        f"{v4['global_kv_bytes_per_token']:.2f}", "v4_global_kv_bytes_per_token", lambda x: f"{x:g}")
    if v4["global_ratio"]:
        row("V4-Flash / ours, global KV", v4["global_ratio"], f"{v4['global_ratio']:.2f}x", "v4_global_ratio",
            lambda x: f"{x:g}x")
    for p in ours_ratio_8x:
        if p["ratio"]:
            row(f"V4-Flash / ours, persistent ({_short(p['unit_tokens'])}-token units)", p["ratio"],
                f"{p['ratio']:.2f}x", "v4_persistent_ratio", lambda x: f"{x:g}x")
    n0, n1 = r["decode_flops_growth_contexts"]
    growth = r["decode_flops_growth"]
    row(f"decode FLOPs growth {_short(n0)} -> {_short(n1)}", growth, f"{growth * 100:+.1f}%")
    if pub:  # the growth's "diff" is in percentage points, not relative
        rows[-1] = rows[-1][:2] + (f"{REPORT['decode_flops_growth'] * 100:+.0f}%",
                                   f"{(growth - REPORT['decode_flops_growth']) * 100:+.1f} pp")

    lines = [f"dsv41 accounting ({'v41-flash, with the report' if pub else 'custom config'})", ""]
    lines += _table(rows)
    u8 = v4["unit_tokens_at_8x"]
    if u8 is not None:
        lines.append("")
        lines.append(f"persistent KV: V4-Flash needs >= 8x ours for saved units up to {u8:,.0f} tokens"
                     if math.isfinite(u8) else
                     "persistent KV: V4-Flash needs >= 8x ours at every unit length")

    lines += ["", "entry bytes: " + ", ".join(f"{k} {v}" for k, v in r["entry_bytes"].items()),
              "global KV by kv-source layer (bytes/token): "
              + ", ".join(f"L{k} {v:g}" for k, v in r["global_kv_by_source"].items()),
              f"window KV per sequence: {r['window_kv_bytes_per_sequence']:,} bytes", ""]

    comp = ("matmul", "attention", "indexer", "compressor", "mixing", "engram")
    div, unit = _flop_unit([d["total"] for d in r["decode_flops"].values()])
    rows = [(f"decode {unit}/token @ context", *comp, "total")]
    for n, d in r["decode_flops"].items():
        rows.append((_short(int(n)), *(f"{d[k] / div:.3f}" for k in comp), f"{d['total'] / div:.3f}"))
    lines += _table(rows)
    halves = r["decode_indexer_flops_by_half"]
    lines += ["indexer by half (" + unit + "): " + "; ".join(
        f"{_short(int(n))} encoder {h['encoder'] / div:.3f}, decoder {h['decoder'] / div:.3f}"
        for n, h in halves.items()), ""]
    div, unit = _flop_unit([d["exact_per_token"] for d in r["prefill_flops"].values()])
    rows = [(f"prefill {unit}/token @ prompt", "exact (all layers)", "encoder-only", "ratio")]
    for n, d in r["prefill_flops"].items():
        rows.append((_short(int(n)), f"{d['exact_per_token'] / div:.3f}",
                     f"{d['encoder_only_per_token'] / div:.3f}", f"{d['ratio']:.2f}x"))
    lines += _table(rows) + [""]
    bd = r["backbone_breakdown"]
    lines.append("backbone by part: " + ", ".join(f"{k} {_fmt_params(v)}" for k, v in bd.items()))
    modes = {m: sum(1 for p in r["per_layer"] if p["mode"] == m) for m in (WINDOW, FULL, REINDEX, REUSE)}
    lines.append("layers by mode: " + ", ".join(f"{k} {v}" for k, v in modes.items()))
    lines += [""] + _checkpoint_lines(r["checkpoint_bytes"], pub)
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _checkpoint_lines(stored: dict[str, Any], published: bool) -> list[str]:
    """The checkpoint bytes in the release's format: total, by part, by storage form, by component."""
    total = stored["total"]
    if total is None:
        return [f"checkpoint in the release's format: not storable ({stored['error']})"]
    head = f"checkpoint in the release's format: {total:,} bytes ({total / 2**30:.2f} GiB)"
    if published:
        head += (f"; the release's index says {RELEASE_TOTAL_SIZE:,} "
                 f"({(total - RELEASE_TOTAL_SIZE) / RELEASE_TOTAL_SIZE * 100:+.4f}%)")
    order = sorted(stored["by_group"].items(), key=lambda kv: -kv[1])
    return [head,
            "  by part: " + ", ".join(f"{k} {_bytes(v)}" for k, v in stored["by_part"].items() if v),
            "  by form: " + ", ".join(f"{k} {_bytes(v)}" for k, v in stored["by_form"].items())
            + f" (scales {_bytes(stored['scales'])})",
            "  by component: " + ", ".join(f"{k} {_bytes(v)}" for k, v in order)]
