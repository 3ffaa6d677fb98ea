"""Model merging: the weighted average of checkpoints, to initialise the next run (SPEC §8).

θ = Σ_i w_i θ_i / Σ_i w_i for every floating tensor (the gates' selection biases included); integer buffers
must agree across the inputs and are copied. Works on state dicts (`merge_state_dicts`) or checkpoint
directories (`merge_checkpoints`: float loads, a float safetensors output with the first input's tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dsv41.config import ConfigError


def merge_state_dicts(states: list[dict[str, Tensor]], weights: list[float] | None = None) -> dict[str, Tensor]:
    if not states:
        raise ValueError("merge needs at least one state dict")
    weights = [1.0] * len(states) if weights is None else [float(w) for w in weights]
    if len(weights) != len(states):
        raise ValueError(f"{len(weights)} weights for {len(states)} checkpoints")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"merge weights must be >= 0 with a positive sum, got {weights}")
    keys = states[0].keys()
    for i, s in enumerate(states[1:], 1):
        if s.keys() != keys:
            missing = sorted(set(keys) ^ set(s.keys()))[:3]
            raise ValueError(f"checkpoint {i} has different tensors from checkpoint 0 (e.g. {missing})")
    total = sum(weights)
    out = {}
    for name in keys:
        first = states[0][name]
        if any(s[name].shape != first.shape for s in states):
            raise ValueError(f"tensor {name}: shapes differ across checkpoints")
        if not first.is_floating_point():
            if any(not torch.equal(s[name], first) for s in states):
                raise ValueError(f"integer tensor {name} differs across checkpoints: cannot average it")
            out[name] = first.clone()
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
        for s, w in zip(states, weights):
            acc += (w / total) * s[name].to(acc.device, torch.float64)
        out[name] = acc.to(first.dtype)
    return out


def merge_checkpoints(directories: list[str | Path], weights: list[float] | None, out: str | Path) -> Path:
    """Average checkpoint directories into `out` (float32)."""
    from dsv41.checkpoint import load_checkpoint, save_checkpoint

    dirs = [Path(d) for d in directories]
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"checkpoint directory '{d}' not found")
    models = [load_checkpoint(d) for d in dirs]
    if any(m.config != models[0].config for m in models[1:]):
        raise ConfigError("merge: the checkpoints have different model configs")
    merged = merge_state_dicts([m.state_dict() for m in models], weights)
    models[0].load_state_dict(merged, strict=True)
    tok = dirs[0] / "tokenizer.json"
    extra = {"tokenizer.json": tok.read_text()} if tok.exists() else None
    return save_checkpoint(models[0], out, fmt="float", dtype=torch.float32, extra_files=extra,
                           metadata={"merged_from": [str(d) for d in dirs], "merge_weights": weights})
