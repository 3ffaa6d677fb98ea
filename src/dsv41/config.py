"""ModelConfig: the model's shape, with the official reference's `ModelArgs` field names.

Field names are exactly the keys of DeepSeek's `inference/model.py` `ModelArgs` (SPEC §1a), so a
reader can hold the reference side by side and the flat JSON presets read like its configs. The
few fields the reference does not have (training switches, the CED split) come last and are marked
"dsv41". Presets ship as flat JSON in `dsv41/presets/`; the release's Hugging Face `config.json`
(nested `text_config` / `vision_config` / `quantization_config`) is read by `from_hf_config`.

Every mistake is reported as one `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A malformed preset or config.json; the message names the offending field."""


DTYPES = ("auto", "bf16", "fp32")  # the --dtype of the commands that run the model (generate, serve, post-training)


def resolve_dtype(name: str, device) -> str:
    """"auto" → "bf16" on CUDA, "fp32" elsewhere; "bf16" / "fp32" as given (a ConfigError otherwise)."""
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}' (dtypes: {', '.join(DTYPES)})")
    if name == "auto":
        return "bf16" if str(getattr(device, "type", device)).startswith("cuda") else "fp32"
    return name


@dataclass
class ModelConfig:
    # --- runtime limits (the reference sizes its caches with these; we size RoPE tables) ---
    max_batch_size: int = 4  # largest batch the reference preallocates for; informational here
    max_seq_len: int = 4096  # longest sequence the RoPE tables cover (grown on demand)
    temperature: float = 1.0  # sampling temperature the reference's DSpark drafter uses
    dtype: str = "bf16"  # non-expert linear weights in a checkpoint: "bf16" or "fp8" (32x32 blocks)
    expert_dtype: str | None = None  # routed expert weights in a checkpoint: None (float) or "fp4" (MXFP4)
    # --- widths ---
    vocab_size: int = 129280  # token vocabulary (DeepSeek-V3's; SPEC §1 decision)
    dim: int = 5120  # hidden size d
    moe_inter_dim: int = 2304  # hidden size of every routed and shared expert
    n_layers: int = 40  # backbone layers: encoder = first half, decoder = second half (CED)
    n_mtp_layers: int = 0  # DSpark draft stages appended after the backbone (checkpoint `mtp.*`)
    n_heads: int = 64  # query heads of the main attention
    # --- MoE ---
    n_routed_experts: int = 384  # routed experts per layer
    n_shared_experts: int = 1  # shared experts per layer (the reference supports exactly 1)
    n_activated_experts: int = 6  # routed experts chosen per token
    score_func: str = "sqrtsoftplus"  # gate score: "sqrtsoftplus" | "sigmoid" | "softmax"
    gate_temp: float = 1.0  # gate logits are divided by this
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to 1
    route_scale: float = 1.5  # routed weights are multiplied by this after normalization
    swiglu_limit: float = 10.0  # SwiGLU clamp: up in [-limit, limit], gate <= limit (0 = off)
    # --- attention ---
    q_lora_rank: int = 1280  # low-rank query bottleneck (wq_a: dim -> q_lora_rank)
    head_dim: int = 512  # width of each query head and of the shared KV latent (MQA over the latent)
    rope_head_dim: int = 64  # rotary channels = the LAST rope_head_dim dims of a head
    norm_eps: float = 1e-20  # RMSNorm epsilon (also mHC's RMS)
    o_groups: int = 8  # grouped output projection: heads split into this many groups
    o_lora_rank: int = 1024  # each output group projects to this width (wo_a), then wo_b -> dim
    window_size: int = 128  # sliding-window KV slots per layer (n_win)
    # compression ratio per layer (MTP layers included, or backbone only): 0 = window only,
    # m = m tokens pooled into one compressed entry
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20)
    kv_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20])  # Full layers: own compressor
    # Full + Reindex layers: own indexer query, produce a fresh top-k
    index_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    compress_rope_theta: float = 160000.0  # RoPE base of layers with ratio > 0 (YaRN applies there)
    original_seq_len: int = 65536  # YaRN's pre-extension context; 0 turns YaRN off
    rope_theta: float = 10000.0  # RoPE base of window-only layers (never YaRN)
    rope_factor: float = 16.0  # YaRN extension factor
    beta_fast: int = 32  # YaRN ramp: dims with more than this many rotations keep their frequency
    beta_slow: int = 1  # YaRN ramp: dims with fewer than this many rotations are fully interpolated
    # --- lightning indexer ---
    index_n_heads: int = 32  # indexer query heads
    index_head_dim: int = 128  # indexer head width (index keys are 512 -> 128 from the latent)
    index_topk: int = 512  # compressed entries each query attends to
    # --- hierarchical indexer (decoder): candidate_source_layer < 0 turns it off ---
    candidate_source_layer: int = 20  # layer that picks candidate blocks for later Reindex layers
    candidate_topk_blocks: int = 2048  # candidate blocks kept per query
    candidate_block_size: int = 8  # compressed positions per candidate block
    # --- manifold-constrained hyper-connections ---
    hc_mult: int = 4  # residual streams
    hc_sinkhorn_iters: int = 20  # Sinkhorn-Knopp rounds making the residual mix doubly stochastic
    hc_eps: float = 1e-6  # epsilon added to pre / comb coefficients
    # --- Engram conditional memory ---
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])  # applied before these blocks
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])  # table rows
    engram_max_ngram_size: int = 4  # n-gram orders 2..max
    engram_vocab_size: int = 16000000  # each (order, head) bucket prime is searched upward from here
    engram_n_heads: int = 8  # hash heads per order
    engram_head_dim: int = 256  # width of one table row
    engram_pad_id: int = 2  # token id filling n-gram slots that have no history
    engram_compressed_vocab_size: int = 99092  # size of the normalized token vocabulary (0 = vocab_size)
    # --- vision (0 layers = text only) ---
    vision_n_layers: int = 0  # DeepSeek-ViT depth
    vision_dim: int = 1024  # ViT width
    vision_n_heads: int = 16  # ViT heads
    vision_inter_dim: int = 2816  # ViT SwiGLU hidden size
    vision_patch_size: int = 14  # pixels per patch side
    vision_rope_theta: float = 10000.0  # 2D-RoPE base
    vision_downsample_ratio: int = 3  # pixel-unshuffle factor (3x3 patches -> one token)
    vision_max_n_token: int = 1024  # most image tokens per image
    vision_min_pixels: int = 544 * 544  # images are resized up to at least this many pixels
    vision_max_wh_ratio: int | None = None  # largest aspect ratio accepted (None = unlimited)
    image_token_id: int = 129264  # id of the image placeholder token
    # --- DSpark speculative drafter (0 = none) ---
    dspark_block_size: int = 0  # drafted block: the last token + (block - 1) noise tokens
    dspark_noise_token_id: int = 0  # id of the noise token
    dspark_target_layer_ids: list[int] = field(default_factory=list)  # backbone layers feeding the drafter
    dspark_markov_rank: int = 256  # rank of the Markov head's token bias
    dspark_n_routed_experts: int = 0  # routed experts in draft stages (0 = backbone's)
    dspark_n_activated_experts: int = 0  # experts per token in draft stages (0 = backbone's)
    # --- dsv41 extensions (not in the reference's ModelArgs) ---
    n_encoder_layers: int = 0  # dsv41: CED encoder depth; 0 = n_layers // 2
    single_pass_mhc: bool = True  # dsv41: pre-mix from the previous sublayer (report); False = classic mHC
    qat: bool = False  # dsv41: fake-quantize KV (FP4 entries, FP4 index keys/queries, FP8 window) in training
    indexer_loss_weight: float = 1.0  # dsv41: weight of the indexer's KL auxiliary loss (SPEC §3 decision)
    # dsv41: the entries the indexer KL runs over: "topk" = the layer's own selected top-k (DeepSeek-V3.2's
    # sparse stage, issue 18; needs no (B, T, N) logits), "allowed" = every entry the layer may select
    indexer_kl_set: str = "topk"
    balance_loss_weight: float = 1e-4  # dsv41: sequence-level expert balance loss weight (SPEC §5)
    bias_update_speed: float = 1e-3  # dsv41: aux-loss-free gate bias step per update (SPEC §5)

    # ------------------------------------------------------------------ derived
    @property
    def encoder_layers(self) -> int:
        """Number of CED encoder layers (the decoder is the rest)."""
        return self.n_encoder_layers or self.n_layers // 2

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def n_engram_hash_cols(self) -> int:
        """Hash ids per position and Engram layer: (orders) x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def moe_config(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, experts per token) of a backbone layer or a DSpark stage."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def truncated(self, n_layers: int) -> ModelConfig:
        """This config cut to `n_layers` of its own layers at their real widths, keeping every
        layer role (`truncate_config`): for running the release's shapes on one GPU."""
        return truncate_config(self, n_layers)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed (unknown names raise ConfigError)."""
        return from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __post_init__(self) -> None:
        validate(self)


# ---------------------------------------------------------------------- validation
_INT_POSITIVE = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_activated_experts",
    "q_lora_rank", "head_dim", "rope_head_dim", "o_groups", "o_lora_rank", "window_size", "index_n_heads",
    "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_seq_len",
)


def _fail(name: str, why: str) -> None:
    raise ConfigError(f"config field '{name}': {why}")


def validate(c: ModelConfig) -> None:
    """Check shapes and the layer-sharing plan; raise ConfigError naming the first bad field."""
    for name in _INT_POSITIVE:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(name, f"must be a positive integer, got {value!r}")
    for name in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "route_scale", "gate_temp"):
        value = getattr(c, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            _fail(name, f"must be a positive number, got {value!r}")
    if c.n_shared_experts != 1:
        _fail("n_shared_experts", f"exactly 1 shared expert is supported, got {c.n_shared_experts}")
    if c.n_activated_experts > c.n_routed_experts:
        _fail("n_activated_experts", f"{c.n_activated_experts} > n_routed_experts {c.n_routed_experts}")
    if c.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        _fail("score_func", f"unknown score function {c.score_func!r}")
    if c.dtype not in ("bf16", "fp8"):
        _fail("dtype", f"must be 'bf16' or 'fp8', got {c.dtype!r}")
    if c.indexer_kl_set not in ("topk", "allowed"):
        _fail("indexer_kl_set", f"must be 'topk' or 'allowed', got {c.indexer_kl_set!r}")
    if c.expert_dtype not in (None, "fp4"):
        _fail("expert_dtype", f"must be null or 'fp4', got {c.expert_dtype!r}")
    if c.rope_head_dim > c.head_dim or c.rope_head_dim % 2:
        _fail("rope_head_dim", f"must be even and <= head_dim ({c.head_dim}), got {c.rope_head_dim}")
    if c.rope_head_dim > c.index_head_dim:
        _fail("rope_head_dim", f"must be <= index_head_dim ({c.index_head_dim}), got {c.rope_head_dim}")
    if c.n_heads % c.o_groups:
        _fail("o_groups", f"n_heads ({c.n_heads}) is not divisible by o_groups ({c.o_groups})")
    if c.head_dim % 32:
        _fail("head_dim", f"must be a multiple of 32 (FP4 scale per 16, FP8 scale per 32), got {c.head_dim}")
    if c.index_head_dim % 32:
        _fail("index_head_dim", f"must be a multiple of 32 (FP4 E8M0 scale per 32), got {c.index_head_dim}")
    if not 0 < c.encoder_layers < c.n_layers:
        _fail("n_encoder_layers", f"encoder depth {c.encoder_layers} must lie in 1..n_layers-1")

    n_all = c.n_layers + c.n_mtp_layers
    if not isinstance(c.compress_ratios, (list, tuple)):
        _fail("compress_ratios", f"must be a list of per-layer ratios, got {c.compress_ratios!r}")
    if len(c.compress_ratios) not in (c.n_layers, n_all):
        _fail("compress_ratios", f"needs {c.n_layers} (or {n_all} with MTP) entries, got {len(c.compress_ratios)}")
    for i, r in enumerate(c.compress_ratios):
        if not isinstance(r, int) or r < 0:
            _fail("compress_ratios", f"entry {i} must be an integer >= 0, got {r!r}")
    for i in range(c.n_layers, len(c.compress_ratios)):
        if c.compress_ratios[i]:
            _fail("compress_ratios", f"DSpark layer {i} must be window-only (ratio 0)")

    def _layer_list(name: str) -> list[int]:
        ids = getattr(c, name)
        if not isinstance(ids, (list, tuple)):
            _fail(name, f"must be a list of layer ids, got {ids!r}")
        if list(ids) != sorted(set(ids)):
            _fail(name, f"must be strictly increasing, got {ids}")
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < c.n_layers:
                _fail(name, f"layer {i!r} is not a backbone layer (0..{c.n_layers - 1})")
        return list(ids)

    kv_sources = _layer_list("kv_source_layers")
    index_sources = _layer_list("index_source_layers")
    for i in kv_sources:
        if c.compress_ratios[i] == 0:
            _fail("kv_source_layers", f"layer {i} has compress ratio 0 and cannot produce compressed KV")
        if i not in index_sources:
            _fail("index_source_layers", f"kv-source layer {i} must also be an index source (it owns index keys)")
    for i in index_sources:
        if c.compress_ratios[i] == 0:
            _fail("index_source_layers", f"layer {i} has compress ratio 0 and has no compressed entries to index")
    # Every compressed layer reads KV from the latest kv source of its ratio, in its own half (CED),
    # and top-k from the latest index source before it.
    for i in range(c.n_layers):
        r = c.compress_ratios[i]
        if r == 0:
            continue
        half = range(0, c.encoder_layers) if i < c.encoder_layers else range(c.encoder_layers, c.n_layers)
        src = [j for j in kv_sources if j <= i and j in half]
        if not src:
            _fail("kv_source_layers", f"layer {i} (ratio {r}) has no earlier kv source in its half")
        if c.compress_ratios[src[-1]] != r:
            _fail("compress_ratios", f"layer {i} has ratio {r} but its kv source {src[-1]} has ratio "
                                     f"{c.compress_ratios[src[-1]]}")
        if not [j for j in index_sources if src[-1] <= j <= i]:
            _fail("index_source_layers", f"layer {i} has no index source at or after its kv source {src[-1]}")
    if c.candidate_source_layer >= 0:
        cs = c.candidate_source_layer
        if cs not in index_sources:
            _fail("candidate_source_layer", f"layer {cs} is not an index source")
        if c.candidate_topk_blocks <= 0 or c.candidate_block_size <= 0:
            _fail("candidate_topk_blocks", "candidate blocks and block size must be positive when enabled")

    if c.engram_layer_ids:
        _layer_list("engram_layer_ids")
        if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
            _fail("engram_num_embeddings", f"needs one row count per Engram layer ({len(c.engram_layer_ids)})")
        for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim"):
            value = getattr(c, name)
            if not isinstance(value, int) or value <= (1 if name == "engram_max_ngram_size" else 0):
                _fail(name, f"must be a positive integer (>1 for n-gram size), got {value!r}")
        if not 0 <= c.engram_pad_id < c.vocab_size:
            _fail("engram_pad_id", f"must be a token id < vocab_size, got {c.engram_pad_id}")
    if not isinstance(c.dspark_block_size, int) or c.dspark_block_size < 0:
        _fail("dspark_block_size", f"must be an integer >= 0 (0 = no drafter), got {c.dspark_block_size!r}")
    if c.dspark_block_size:
        if not _layer_list("dspark_target_layer_ids"):
            _fail("dspark_target_layer_ids", "DSpark needs at least one target layer")
        if not isinstance(c.n_mtp_layers, int) or c.n_mtp_layers <= 0:
            _fail("n_mtp_layers", "DSpark needs at least one draft stage")
        if not isinstance(c.dspark_noise_token_id, int) or not 0 <= c.dspark_noise_token_id < c.vocab_size:
            _fail("dspark_noise_token_id", f"must be a token id < vocab_size, got {c.dspark_noise_token_id!r}")
        if not isinstance(c.dspark_markov_rank, int) or c.dspark_markov_rank <= 0:
            _fail("dspark_markov_rank", f"the Markov head needs a positive rank, got {c.dspark_markov_rank!r}")
        for name in ("dspark_n_routed_experts", "dspark_n_activated_experts"):
            value = getattr(c, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(name, f"must be an integer >= 0 (0 = the backbone's), got {value!r}")
        routed, active = c.moe_config(c.n_layers)
        if active > routed:
            _fail("dspark_n_activated_experts", f"{active} experts per token > {routed} routed experts in draft stages")
    if c.vision_enabled and c.vision_dim % c.vision_n_heads:
        _fail("vision_n_heads", f"vision_dim ({c.vision_dim}) is not divisible by vision_n_heads")


# ---------------------------------------------------------------------- DSpark derived config
def with_dspark(c: ModelConfig, block_size: int = 5, n_stages: int = 3, target_layer_ids: list[int] | None = None,
                noise_token_id: int | None = None, markov_rank: int | None = None, n_routed_experts: int = 0,
                n_activated_experts: int = 0) -> ModelConfig:
    """`c` with a DSpark drafter (SPEC §1a, §5): the switch that gives a preset without one (tiny, small,
    the shipped models/dsv41-small) its draft stages, leaving the backbone unchanged.

    Defaults follow the release's shape scaled down: block 5, 3 stages, the last three backbone layers
    as targets (the release: 37, 38, 39 of 40), the tokenizer's last reserved token as noise
    (`<|reserved_3|>`, id 16 in data/tokenizer.json; ids past the vocabulary fall back to its last
    id), Markov rank min(256, dim), the backbone's experts (0)."""
    if target_layer_ids is None:
        target_layer_ids = list(range(max(c.n_layers - 3, 0), c.n_layers))
    if noise_token_id is None:
        noise_token_id = 16 if c.vocab_size > 16 else c.vocab_size - 1
    ratios = list(c.compress_ratios[: c.n_layers]) + [0] * n_stages  # draft stages are window-only
    return c.replace(dspark_block_size=block_size, n_mtp_layers=n_stages,
                     dspark_target_layer_ids=list(target_layer_ids), dspark_noise_token_id=noise_token_id,
                     dspark_markov_rank=min(256, c.dim) if markov_rank is None else markov_rank,
                     dspark_n_routed_experts=n_routed_experts, dspark_n_activated_experts=n_activated_experts,
                     compress_ratios=ratios)


# ---------------------------------------------------------------------- truncation
def truncated_layer_ids(c: ModelConfig, n_layers: int) -> list[int]:
    """Which of `c`'s layers a truncation to `n_layers` keeps (`truncate_config`), in order."""
    from dsv41.plan import FULL, REINDEX, REUSE, WINDOW, layer_plan

    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
        _fail("n_layers", f"a truncation needs a positive layer count, got {n_layers!r}")
    plans = layer_plan(c)
    chosen: set[int] = set()

    def keep(i: int) -> None:
        p = plans[i]
        chosen.update(j for j in (i, p.kv_source, p.topk_source) if j is not None)
        if p.uses_candidates:
            chosen.add(c.candidate_source_layer)

    for mode in (WINDOW, FULL, REUSE, REINDEX):
        layers = [p for p in plans if p.mode == mode]
        preferred = [p for p in layers if p.engram] if mode == WINDOW else []
        if layers:
            keep((preferred or layers)[0].layer_id)
    if c.engram_layer_ids and not chosen & set(c.engram_layer_ids):
        keep(c.engram_layer_ids[0])
    for half in (range(c.encoder_layers), range(c.encoder_layers, c.n_layers)):
        if not chosen & set(half):
            keep(half[0])
    if n_layers < len(chosen):
        _fail("n_layers", f"keeping every layer role needs at least {len(chosen)} layers "
                          f"({sorted(chosen)} of the full model), got {n_layers}")
    for i in range(c.n_layers):  # then the earliest others, in order
        if len(chosen) >= min(n_layers, c.n_layers):
            break
        keep(i)
    return sorted(chosen)


def truncate_config(c: ModelConfig, n_layers: int) -> ModelConfig:
    """`n_layers` of `c`'s layers, renumbered in order, every width unchanged.

    Kept first (the roles): the first window-only layer (an Engram one if there is one), the first
    Full, Reuse and Reindex layers, each with the layers it reads (kv source, top-k source,
    candidate source), an Engram layer, and a layer of each CED half; then the earliest remaining
    layers until there are `n_layers`. Sources, Engram layers (and their table sizes) and the
    encoder depth are remapped; DSpark stages are dropped (their target layers are gone). For
    v41-flash the roles need 5 layers: 1 (window + Engram), 2 (Full, m = 2), 3 (Reuse), 20 (Full,
    m = 1, the decoder's kv and candidate source), 24 (Reindex). Engram hashing is seeded by layer
    id, so a renumbered Engram layer hashes differently from the full model's."""
    ids = truncated_layer_ids(c, n_layers)
    new = {old: k for k, old in enumerate(ids)}
    engram = [(new[i], rows) for i, rows in zip(c.engram_layer_ids, c.engram_num_embeddings) if i in new]
    return c.replace(
        n_layers=len(ids), n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
        n_encoder_layers=sum(1 for i in ids if i < c.encoder_layers),
        compress_ratios=[c.compress_ratios[i] for i in ids],
        kv_source_layers=[new[i] for i in c.kv_source_layers if i in new],
        index_source_layers=[new[i] for i in c.index_source_layers if i in new],
        candidate_source_layer=new.get(c.candidate_source_layer, -1) if c.candidate_source_layer >= 0 else -1,
        engram_layer_ids=[i for i, _ in engram], engram_num_embeddings=[rows for _, rows in engram],
    )


# ---------------------------------------------------------------------- loading
_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def from_dict(data: dict[str, Any]) -> ModelConfig:
    """Build a validated config from flat ModelArgs-style keys; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"config field '{unknown[0]}': unknown key (not a ModelArgs field)")
    try:
        return ModelConfig(**data)
    except TypeError as e:  # e.g. a list where a number belongs, caught before validation
        raise ConfigError(f"config: {e}") from None


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("dsv41.presets").iterdir() if p.name.endswith(".json"))


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped preset by name (`v41-flash`, `small`, `tiny`), a flat JSON file, a Hugging Face
    `config.json` (recognized by its `text_config`), or a directory holding `config.json`."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        name = str(name_or_path)
        if name not in preset_names():
            raise ConfigError(f"no preset or file named {name!r} (presets: {', '.join(preset_names())})")
        text = resources.files("dsv41.presets").joinpath(f"{name}.json").read_text()
        source = f"preset {name}"
    else:
        text = path.read_text()
        source = str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and "text_config" in data:
        return from_hf_config(data)
    return from_dict(data)


# ---------------------------------------------------------------------- Hugging Face config.json
# text_config key -> ModelArgs field (the release's real key names)
_HF_TEXT = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank", "o_groups": "o_groups",
    "swiglu_limit": "swiglu_limit", "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "norm_topk_prob": "norm_topk_prob", "routed_scaling_factor": "route_scale", "sliding_window": "window_size",
    "compress_ratios": "compress_ratios", "compress_rope_theta": "compress_rope_theta",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "engram_layer_ids": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads", "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_id", "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_block_size", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids", "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
_HF_ROPE = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
            "original_max_position_embeddings": "original_seq_len"}
_HF_VISION = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
# keys that carry no information for us (or restate a fixed fact); accepted and dropped
_HF_IGNORED_TEXT = {"model_type", "hidden_act", "attention_bias", "topk_method", "first_k_dense_replace",
                    "tie_word_embeddings", "dtype", "torch_dtype", "use_cache", "transformers_version",
                    "window_size", "quantization_config", "initializer_range", "bos_token_id",
                    "eos_token_id", "pad_token_id", "image_token_id"}
_HF_IGNORED_TOP = {"architectures", "model_type", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                   "pad_token_id", "transformers_version", "tie_word_embeddings"}


def from_hf_config(data: dict[str, Any]) -> ModelConfig:
    """Map the release's nested config.json onto ModelConfig (unknown keys are an error)."""
    out: dict[str, Any] = {"vision_n_layers": 0, "dspark_block_size": 0, "n_mtp_layers": 0}
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config field 'text_config': must be an object")
    for key, value in text.items():
        if key in _HF_TEXT:
            out[_HF_TEXT[key]] = value
        elif key == "rope_scaling":
            if not isinstance(value, dict):
                raise ConfigError("config field 'text_config.rope_scaling': must be an object")
            kind = value.get("rope_type", value.get("type"))
            if kind not in (None, "yarn"):
                raise ConfigError(f"config field 'text_config.rope_scaling.rope_type': only yarn, got {kind!r}")
            for k, v in value.items():
                if k in _HF_ROPE:
                    out[_HF_ROPE[k]] = v
                elif k not in ("rope_type", "type"):
                    raise ConfigError(f"config field 'text_config.rope_scaling.{k}': unknown key")
        elif key == "num_key_value_heads":
            if value != 1:
                raise ConfigError(f"config field 'text_config.num_key_value_heads': must be 1 (MQA), got {value}")
        elif key not in _HF_IGNORED_TEXT:
            raise ConfigError(f"config field 'text_config.{key}': unknown key")
    vision = data.get("vision_config")
    if vision is not None:
        for key, value in vision.items():
            if key in _HF_VISION:
                out[_HF_VISION[key]] = value
            elif key != "model_type":
                raise ConfigError(f"config field 'vision_config.{key}': unknown key")
    quant = data.get("quantization_config") or text.get("quantization_config")
    if quant is not None:
        out["dtype"] = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
        out["expert_dtype"] = quant.get("expert_dtype")
    if "image_token_id" in data:
        out["image_token_id"] = data["image_token_id"]
    for key in data:
        if key not in ("text_config", "vision_config", "quantization_config", "image_token_id") \
                and key not in _HF_IGNORED_TOP:
            raise ConfigError(f"config field '{key}': unknown top-level key")
    if out.get("dspark_block_size") and not out.get("n_mtp_layers"):
        out["n_mtp_layers"] = 1
    return from_dict(out)
