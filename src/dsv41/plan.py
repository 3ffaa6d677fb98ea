"""Layer plan: what each layer does and whom it reads, derived from a ModelConfig alone.

CSA2 shares work across layers (SPEC §3): a **Full** layer (a kv source) compresses its own KV,
derives index keys and runs its indexer; a **Reindex** layer reuses the latest Full layer's entries
and index keys but scores them with its own indexer query; a **Reuse** layer reuses both the
entries and the latest top-k. Layers with compression ratio 0 attend only to their sliding window.
The first half of the stack is the CED encoder; the decoder's only kv source is its first layer,
whose compressor reads the encoder output (SPEC §2). The decoder's first index source also picks
candidate blocks that later Reindex layers score inside (hierarchical indexer).

Nothing here touches torch: the model, the engine, the accounting and `dsv41 plan` all read this.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.config import ModelConfig

WINDOW, FULL, REINDEX, REUSE = "window", "full", "reindex", "reuse"


@dataclass(frozen=True)
class LayerPlan:
    layer_id: int
    half: str  # "encoder" | "decoder" | "dspark"
    mode: str  # WINDOW | FULL | REINDEX | REUSE
    ratio: int  # compression ratio m (0 = window only)
    kv_source: int | None  # layer whose compressed entries and index keys this layer reads
    topk_source: int | None  # layer whose top-k indices this layer uses (itself for Full/Reindex)
    candidate_source: bool  # picks candidate blocks for later Reindex layers
    uses_candidates: bool  # scores only inside the candidate source's blocks
    engram: bool  # an Engram module adds to the streams before this block
    rope: str  # "yarn" (compressed layers with YaRN) | "plain" (theta = compress_rope_theta) | "window"

    @property
    def owns_compressor(self) -> bool:
        return self.mode == FULL

    @property
    def owns_indexer(self) -> bool:
        return self.mode in (FULL, REINDEX)


def layer_plan(config: ModelConfig) -> list[LayerPlan]:
    """One LayerPlan per backbone layer (DSpark stages are window-only and listed by `dspark_plan`)."""
    c = config
    plans = []
    for i in range(c.n_layers):
        r = c.compress_ratios[i]
        half = "encoder" if i < c.encoder_layers else "decoder"
        lo, hi = (0, c.encoder_layers) if half == "encoder" else (c.encoder_layers, c.n_layers)
        engram = i in c.engram_layer_ids
        if r == 0:
            plans.append(LayerPlan(i, half, WINDOW, 0, None, None, False, False, engram, "window"))
            continue
        kv_source = max(j for j in c.kv_source_layers if lo <= j <= i)
        topk_source = max(j for j in c.index_source_layers if kv_source <= j <= i)
        if i == kv_source:
            mode = FULL
        elif i == topk_source:
            mode = REINDEX
        else:
            mode = REUSE
        cand = c.candidate_source_layer
        is_cand = cand >= 0 and i == cand
        uses_cand = cand >= 0 and mode in (FULL, REINDEX) and cand < i and half == _half(c, cand)
        rope = "yarn" if c.original_seq_len > 0 else "plain"
        plans.append(LayerPlan(i, half, mode, r, kv_source, topk_source, is_cand, uses_cand, engram, rope))
    return plans


def _half(c: ModelConfig, layer_id: int) -> str:
    return "encoder" if layer_id < c.encoder_layers else "decoder"


def decoder_kv_source(config: ModelConfig) -> int | None:
    """The decoder layer whose compressor turns the encoder output into the decoder's global KV."""
    srcs = [p.layer_id for p in layer_plan(config) if p.mode == FULL and p.half == "decoder"]
    return srcs[0] if srcs else None


# ---------------------------------------------------------------------- Engram bucket layout
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for n < 3.3e24 (the bases below)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(config: ModelConfig) -> list[list[list[int]]]:
    """Bucket moduli [engram layer][n-gram order - 2][head]: distinct primes drawn in order,
    each the smallest unused prime above the previous one (restarting from engram_vocab_size for
    every order). The tables' row counts are their sums."""
    c = config
    seen: set[int] = set()
    layers = []
    for _ in c.engram_layer_ids:
        orders = []
        for _ in range(c.engram_max_ngram_size - 1):
            current, heads = c.engram_vocab_size - 1, []
            for _ in range(c.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            orders.append(heads)
        layers.append(orders)
    return layers


def engram_table_rows(config: ModelConfig) -> list[int]:
    """Rows each Engram layer's table needs: the sum of its bucket primes."""
    return [sum(sum(order) for order in layer) for layer in engram_primes(config)]


# ---------------------------------------------------------------------- printing
def format_plan(config: ModelConfig) -> str:
    """The plan as a fixed-width table (what `dsv41 plan` prints)."""
    rows = [("layer", "half", "mode", "m", "kv<-", "topk<-", "candidates", "engram", "rope")]
    for p in layer_plan(config):
        cand = "source" if p.candidate_source else ("masked" if p.uses_candidates else "")
        rows.append((
            str(p.layer_id), p.half, p.mode, str(p.ratio) if p.ratio else "-",
            "" if p.kv_source is None else str(p.kv_source),
            "" if p.topk_source is None else str(p.topk_source),
            cand, "yes" if p.engram else "", p.rope,
        ))
    for k in range(config.n_mtp_layers if config.dspark_block_size else 0):
        rows.append((str(config.n_layers + k), "dspark", WINDOW, "-", "", "", "", "", "window"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    plans = layer_plan(config)
    summary = {
        "full": [p.layer_id for p in plans if p.mode == FULL],
        "reindex": [p.layer_id for p in plans if p.mode == REINDEX],
        "window-only": [p.layer_id for p in plans if p.mode == WINDOW],
        "encoder": f"0-{config.encoder_layers - 1}",
        "decoder": f"{config.encoder_layers}-{config.n_layers - 1}",
        "candidate source": config.candidate_source_layer if config.candidate_source_layer >= 0 else "off",
    }
    if config.dspark_block_size:
        routed, active = config.moe_config(config.n_layers)
        last = config.n_mtp_layers - 1
        summary["dspark"] = (f"{config.n_mtp_layers} draft stages mtp.0-{last} (layers {config.n_layers}-"
                             f"{config.n_layers + last}), block {config.dspark_block_size} (anchor + "
                             f"{config.dspark_block_size - 1} noise id {config.dspark_noise_token_id}; proposes "
                             f"{config.dspark_block_size}), window {config.window_size} over the features of layers "
                             f"{list(config.dspark_target_layer_ids)}, {routed} experts top-{active}, Markov rank "
                             f"{config.dspark_markov_rank}, confidence head")
    lines.append("")
    lines += [f"{k}: {v}" for k, v in summary.items()]
    return "\n".join(lines)
