"""The release's per-tensor storage: one table of which tensors are FP8, MXFP4, BF16 or FP32.

DeepSeek-V4.1-Flash's checkpoint (the Hugging Face safetensors that `inference/convert.py` reads)
stores every tensor in one of five forms (SPEC §1a "weights"). `RULES` below says which form each
state-dict name takes, each rule with the line of the official `inference/model.py` /
`inference/convert.py` (revision dba1be0a) or `config.json` it comes from. The `official-fp8`
saver writes exactly this, the `as-released` loader keeps what it marks quantized in its stored
form, `dsv41 accounting` sums checkpoint bytes with it and `scripts/make_release_shards.py` writes
synthetic shards from it. Torch-free (accounting imports it).

Forms (safetensors dtype names; "32" is the release's `fp8_block_size` = `fp4_block_size`):
  * `fp8_tiles` — `X.weight` F8_E4M3 [out, in] + `X.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]:
    one power-of-two scale per 32×32 tile (`config.json` quantization_config weight_block_size
    [32, 32], scale_fmt ue8m0).
  * `fp8_rows` — `X.weight` F8_E4M3 [rows, dim] + `X.scale` F8_E8M0 [rows, ceil(dim/32)]: one scale
    per 32 channels of a row (the Engram tables). The reference sizes the scale `dim // 32`; the
    ceiling only matters for our small presets, whose rows are narrower than 32.
  * `mxfp4` — `X.weight` I8 [out, in/2] (E2M1 pairs, element 2i in the low nibble) + `X.scale`
    F8_E8M0 [out, in/32] (the routed experts).
  * `bf16`, `f32` — plain tensors.

A name no rule covers raises `ReleaseFormatError`: a new tensor must be placed in the table on
purpose, never by a default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

FP8_TILES, FP8_ROWS, MXFP4, BF16, F32 = "fp8_tiles", "fp8_rows", "mxfp4", "bf16", "f32"
QUANTIZED = (FP8_TILES, FP8_ROWS, MXFP4)
BLOCK = 32  # fp8_block_size = fp4_block_size = 32 (model.py, top of file)

# bytes per element of each safetensors dtype the release uses
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


class ReleaseFormatError(ValueError):
    """A tensor the table does not cover, or one whose shape its form cannot store."""


@dataclass(frozen=True)
class Rule:
    pattern: str  # regular expression searched in the state-dict name
    storage: str  # FP8_TILES | FP8_ROWS | MXFP4 | BF16 | F32
    source: str  # where in the official inference code (or config.json) this comes from


# First match wins. Names are the official ones (`layers.N.`, `mtp.N.` prefixes).
RULES: tuple[Rule, ...] = (
    # --- quantized
    Rule(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$", MXFP4,
         "model.py MoE.__init__: expert_dtype = float4_e2m1fn_x2 when args.expert_dtype == 'fp4'; Linear: fp4 "
         "weight [out, in // 2], scale [out, in // fp4_block_size] float8_e8m0fnu; convert.py: int8 experts "
         "are .view(torch.float4_e2m1fn_x2)"),
    Rule(r"(^|\.)engram\.embed\.weight$", FP8_ROWS,
         "model.py ParallelEngramEmbedding: weight float8_e4m3fn [rows, dim], scale [rows, dim // "
         "fp8_block_size] (scale_dtype = float8_e8m0fnu); 'stays fp8: rows are dequantized on lookup'"),
    Rule(r"(^|\.)attn\.(wq_a|wq_b|wkv|wo_b)\.weight$", FP8_TILES,
         "model.py Attention: Linear(...) with default_dtype = float8_e4m3fn (ModelArgs.dtype 'fp8'); Linear: "
         "scale [(out + 31) // 32, (in + 31) // 32] float8_e8m0fnu"),
    Rule(r"(^|\.)attn\.wo_a\.weight$", FP8_TILES,
         "convert.py main: for wo_a.weight it pops wo_a.scale, checks 32x32 (or 128x128) blocks and "
         "dequantizes to bf16 for the reference's grouped einsum (model.py: 'convert.py dequantizes it to "
         "bf16'), so the release stores it FP8"),
    Rule(r"(^|\.)attn\.indexer\.wq_b\.weight$", FP8_TILES,
         "model.py Indexer: wq_b = ColumnParallelLinear(q_lora_rank, n_heads * index_head_dim) (default fp8)"),
    Rule(r"(^|\.)ffn\.shared_experts\.w[123]\.weight$", FP8_TILES,
         "model.py MoE: shared_experts = Expert(dim, moe_inter_dim) without a dtype (default fp8)"),
    Rule(r"(^|\.)engram\.wkv\.weight$", FP8_TILES,
         "model.py Engram: wkv = Linear(n_hash_cols * head_dim, dim * (hc_mult + 1)) (default fp8)"),
    Rule(r"(^|\.)main_proj\.weight$", FP8_TILES,
         "model.py DSparkBlock: main_proj = Linear(dim * len(dspark_target_layer_ids), dim) (default fp8)"),
    # --- FP32
    Rule(r"(^|\.)hc_(attn|ffn)_(fn|base|scale)$", F32,
         "model.py Block: hc_attn_fn / hc_ffn_fn / *_base / *_scale built under set_dtype(torch.float32)"),
    Rule(r"(^|\.)attn\.attn_sink$", F32, "model.py Attention: attn_sink = Parameter(..., dtype=torch.float32)"),
    Rule(r"(^|\.)ffn\.gate\.(bias|bias_vl)$", F32,
         "model.py Gate: bias and bias_vl = Parameter(..., dtype=torch.float32)"),
    # --- BF16
    Rule(r"^(embed|head)\.weight$", BF16,
         "model.py ParallelHead: 'bf16 in the checkpoint, kept as fp32 here'; ParallelEmbedding weight under the "
         "bf16 default dtype"),
    Rule(r"(^|\.)attn\.compressor\.(wkv|wgate)\.weight$", BF16,
         "model.py Compressor: 'ratio 1 is a plain projection, so it stays in the checkpoint's bf16'; above "
         "ratio 1 the weights are promoted to fp32 at load"),
    Rule(r"(^|\.)attn\.indexer\.(wk|weights_proj)\.weight$", BF16,
         "model.py Indexer: wk = Linear(head_dim, index_head_dim, dtype=torch.bfloat16); weights_proj = "
         "ColumnParallelLinear(dim, n_heads, dtype=torch.bfloat16)"),
    Rule(r"(^|\.)ffn\.gate\.weight$", BF16,
         "model.py Gate: weight = Parameter(torch.empty(n_routed_experts, dim)) under the bf16 default (the "
         "router is read as linear(x.float(), weight.float()))"),
    Rule(r"(^|\.)\w*norm\.weight$", BF16,
         "model.py RMSNorm: weight = Parameter(torch.ones(dim)) under the bf16 default dtype"),
    Rule(r"(^|\.)engram\.(q_weight|k_weight)$", BF16,
         "model.py Engram: q_weight / k_weight = Parameter(torch.ones(hc_mult, dim)) under the bf16 default"),
    Rule(r"(^|\.)markov_head\.(embed|head)\.weight$", BF16,
         "model.py DSparkMarkovHead: ParallelEmbedding + ParallelHead (bf16 in the checkpoint)"),
    Rule(r"(^|\.)confidence_head\.proj\.weight$", BF16,
         "model.py DSparkConfidenceHead: 'proj in the checkpoint is stored in bf16'"),
    Rule(r"^(vision|aligner|image_start|image_end|image_newline)(\.|$)", BF16,
         "vision.py: plain nn.Linear / Parameter under the bf16 default dtype"),
)
_COMPILED = tuple((re.compile(r.pattern), r) for r in RULES)


def rule_for(name: str) -> Rule:
    """The rule that stores `name` (ReleaseFormatError when none does)."""
    for pattern, rule in _COMPILED:
        if pattern.search(name):
            return rule
    raise ReleaseFormatError(f"release format: no rule stores tensor {name!r} (add it to RULES)")


def storage_of(name: str) -> str:
    """FP8_TILES | FP8_ROWS | MXFP4 | BF16 | F32 for a state-dict name."""
    return rule_for(name).storage


def scale_name(weight_name: str) -> str:
    """`X.weight` → `X.scale` (the companion of a quantized weight)."""
    if not weight_name.endswith(".weight"):
        raise ReleaseFormatError(f"release format: {weight_name!r} is not an X.weight name")
    return weight_name[: -len("weight")] + "scale"


def stored_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(stored name, safetensors dtype, stored shape)] of one logical tensor of `shape`."""
    storage = storage_of(name)
    shape = tuple(int(d) for d in shape)
    if storage in QUANTIZED:
        if len(shape) != 2:
            raise ReleaseFormatError(f"release format: {name} is stored {storage}, which needs a 2-D tensor, "
                                     f"got shape {list(shape)}")
        out_dim, in_dim = shape
        if storage == FP8_TILES:
            return [(name, "F8_E4M3", shape),
                    (scale_name(name), "F8_E8M0", (math.ceil(out_dim / BLOCK), math.ceil(in_dim / BLOCK)))]
        if storage == FP8_ROWS:
            return [(name, "F8_E4M3", shape), (scale_name(name), "F8_E8M0", (out_dim, math.ceil(in_dim / BLOCK)))]
        if in_dim % BLOCK:
            raise ReleaseFormatError(f"release format: {name} has in_features {in_dim}, not a multiple of {BLOCK}: "
                                     f"it cannot be stored as MXFP4")
        return [(name, "I8", (out_dim, in_dim // 2)), (scale_name(name), "F8_E8M0", (out_dim, in_dim // BLOCK))]
    return [(name, "BF16" if storage == BF16 else "F32", shape)]


def stored_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes one logical tensor takes in the release's format (values + scales)."""
    return sum(DTYPE_BYTES[dtype] * math.prod(s) for _, dtype, s in stored_layout(name, shape))
