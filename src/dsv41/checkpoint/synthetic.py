"""Synthetic checkpoints in the release's exact format: random weights, real names, dtypes and shapes.

`write_synthetic_release(config, directory)` writes what an `official-fp8` save of a model with
`config` would write — every tensor in its `release_format` form, sharded with an index — without
ever building the model: names and shapes come from the accounting's inventory (which equals the
model's state dict), values are drawn directly in the stored form, shard by shard:
  * FP8 tiles / rows: E4M3 codes of N(0, 64²) (clamped to ±448) with one power-of-two scale so the
    values have std ≈ fan_in^-½ (tables: std 1);
  * MXFP4: random bytes (every nibble is an E2M1 code) with a scale giving std ≈ fan_in^-½;
  * BF16 / FP32: norms, Engram q/k weights and mHC scales ones, mHC bases, sinks and gate biases
    zeros, mHC projections N(0, 10⁻⁶), other matrices N(0, 0.02²).
Values are generated on `device` (a GPU makes 50 GB quick) and written from the host one shard at
a time, so host memory holds one shard. `scripts/make_release_shards.py` is the command line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import Tensor

from dsv41.accounting.params import Param, block_params, engram_params, text_params
from dsv41.checkpoint.files import CONFIG_NAME, INDEX_FILE, atomic_write_bytes, save_state_dict_file, shard_names
from dsv41.checkpoint.release_format import (
    BF16,
    BLOCK,
    FP8_ROWS,
    FP8_TILES,
    MXFP4,
    scale_name,
    storage_of,
    stored_bytes,
)
from dsv41.config import ModelConfig
from dsv41.plan import layer_plan

_ONES = re.compile(r"(norm\.weight|engram\.[qk]_weight|hc_(attn|ffn)_scale)$")
_ZEROS = re.compile(r"(hc_(attn|ffn)_base|attn_sink|ffn\.gate\.bias(_vl)?)$")
_E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of a uniformly random code


def model_tensors(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the text model's state dict, in order (experts expanded)."""
    params: list[Param] = text_params(config)[:1]  # embed first, as the model orders them
    for plan in layer_plan(config):
        params += block_params(config, plan)
        if plan.engram:
            params += engram_params(config, plan.layer_id)
    params += text_params(config)[1:]
    out = []
    for p in params:
        out += [(p.name.replace("{e}", str(e)), p.shape) for e in range(p.copies)] if "{e}" in p.name \
            else [(p.name, p.shape)]
    return out


def _scale_byte(std: float, code_std: float) -> int:
    """E8M0 byte of the power of two that maps codes of `code_std` to values of `std`."""
    return 127 + round(math.log2(std / code_std))


def synthetic_tensors(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device
                      ) -> dict[str, Tensor]:
    """The stored tensors of one logical tensor, random in its release form, on the host."""
    form = storage_of(name)
    if form in (FP8_TILES, FP8_ROWS):
        rows, cols = shape
        codes = (torch.randn(shape, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        std = 1.0 if form == FP8_ROWS else cols ** -0.5
        scale_shape = (math.ceil(rows / BLOCK) if form == FP8_TILES else rows, math.ceil(cols / BLOCK))
        scale = torch.full(scale_shape, _scale_byte(std, 64.0), dtype=torch.uint8, device=device)
        return {name: codes.cpu(), scale_name(name): scale.view(torch.float8_e8m0fnu).cpu()}
    if form == MXFP4:
        rows, cols = shape
        packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, device=device, dtype=torch.uint8)
        scale = torch.full((rows, cols // BLOCK), _scale_byte(cols ** -0.5, _E2M1_RMS), dtype=torch.uint8,
                           device=device)
        return {name: packed.view(torch.int8).cpu(), scale_name(name): scale.view(torch.float8_e8m0fnu).cpu()}
    dtype = torch.bfloat16 if form == BF16 else torch.float32
    if _ONES.search(name):
        value = torch.ones(shape, dtype=dtype)
    elif _ZEROS.search(name):
        value = torch.zeros(shape, dtype=dtype)
    else:
        std = 1e-3 if re.search(r"hc_(attn|ffn)_fn$", name) else 0.02
        value = (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
    return {name: value}


def write_synthetic_release(config: ModelConfig, directory: str | Path, *, seed: int = 0,
                            device: str | torch.device = "cpu", max_shard_bytes: int = 4 << 30) -> Path:
    """Write a random checkpoint of `config` in the release's format (see the module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    tensors = model_tensors(config)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in tensors:
        size = stored_bytes(name, shape)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    files = shard_names(len(shards))
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for file, members in zip(files, shards):
        stored: dict[str, Tensor] = {}
        for name, shape in members:
            stored.update(synthetic_tensors(name, shape, gen, device))
        total += sum(t.numel() * t.element_size() for t in stored.values())
        save_state_dict_file(stored, directory / file, {"dsv41.format": "official-fp8", "dsv41.synthetic": "1"})
        weight_map.update(dict.fromkeys(stored, file))
        del stored
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_bytes(directory / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())
    written = config.replace(dtype="fp8", expert_dtype="fp4")
    atomic_write_bytes(directory / CONFIG_NAME, (written.to_json() + "\n").encode())
    return directory


def resize_engram(config: ModelConfig, vocab_size: int) -> ModelConfig:
    """The config with Engram buckets searched from `vocab_size` (and tables sized to their primes)
    when that is smaller than the config's: the release's 16M-row start makes 98 GB tables, more
    than one GPU's disk holds beside the rest."""
    from dsv41.plan import engram_table_rows

    if not config.engram_layer_ids or vocab_size >= config.engram_vocab_size:
        return config
    resized = config.replace(engram_vocab_size=vocab_size)
    return resized.replace(engram_num_embeddings=engram_table_rows(resized))
