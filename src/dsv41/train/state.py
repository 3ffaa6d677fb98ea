"""Training checkpoints: everything a run needs to continue bit-exactly (SPEC §7).

    out/
      metrics.jsonl
      train_config.json        the TrainConfig of the latest start or resume
      latest -> ckpt-000030    relative symlink, replaced atomically (a one-line text file where
                               symlinks are unavailable)
      ckpt-000030/
        model.safetensors      model.state_dict(): weights and the MoE gate biases, each in its own
        config.json            dtype, and the ModelConfig: a `dsv41.checkpoint` directory, so
        tokenizer.json         `load_checkpoint(ckpt_dir)` / `dsv41 generate --checkpoint` read it
        optimizer.pt           CombinedOptimizer.state_dict(): tensors inside plain dicts / lists /
                               numbers / strings / dtypes, written with torch.save and read back
                               with torch.load(weights_only=True), which refuses arbitrary objects
        rng.safetensors        torch generator states: "cpu", "cuda:<i>" (uint8)
        trainer_state.json     step, tokens, elapsed, data position (PackedDataset.state_dict),
                               python `random` and numpy global RNG states, the TrainConfig

A checkpoint is written into a hidden temporary folder next to its final name and renamed into
place, so a crash mid-save never leaves a half-written `ckpt-*` (or a `latest` pointing at one).
What is *not* saved because it is rebuilt: non-persistent buffers (RoPE tables, the Engram token
map, which is a pure function of the tokenizer) and the QAT flag (a function of `tokens`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv41.checkpoint import read_state_dict, save_checkpoint

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
LATEST = "latest"


# ---------------------------------------------------------------------- model weights
def save_model_weights(model: nn.Module, folder: Path, extra_files: dict[str, str | bytes] | None = None) -> None:
    """A model checkpoint (`dsv41.checkpoint`, float format: every tensor in its own dtype) — what
    `load_checkpoint(folder)` and `dsv41 generate --checkpoint` read; `extra_files` e.g. the tokenizer."""
    save_checkpoint(model, folder, extra_files=extra_files)


def load_model_weights(model: nn.Module, folder: Path) -> None:
    """Strict load into an existing model (the optimizer holds its parameters): a missing or
    unexpected tensor name is an error."""
    device = next(model.parameters()).device
    model.load_state_dict(read_state_dict(folder, device=device), strict=True)


# ---------------------------------------------------------------------- RNG
def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(torch generator states as tensors, python/numpy states as JSON-able values)."""
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            tensors[f"cuda:{i}"] = torch.cuda.get_rng_state(i)
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["cpu"])
    for name, state in tensors.items():
        if name.startswith("cuda:") and torch.cuda.is_available():
            i = int(name.split(":")[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(state, i)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------- whole training state
def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, (tuple, set)):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def save_training_state(folder: str | Path, *, model: nn.Module, optimizer: Any, state: dict[str, Any],
                        extra_files: dict[str, str | bytes] | None = None) -> Path:
    """Write a checkpoint atomically into `folder` (replacing one already there); returns it.

    `state` holds the JSON-able trainer fields (step, tokens, data position, TrainConfig, ...);
    the RNG states are added here. `extra_files` are copied in (the tokenizer).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model_weights(model, tmp, extra_files)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    tensors, plain = rng_state()
    save_file(tensors, str(tmp / RNG_FILE))
    (tmp / STATE_FILE).write_text(json.dumps({**state, "rng": plain}, default=_json_default) + "\n")
    if folder.exists():  # a re-save of the same step: move the old one aside first
        old = folder.with_name(f".{folder.name}.old{os.getpid()}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    return folder


def load_training_state(folder: str | Path, *, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Restore model weights, optimizer state and RNG states; return the trainer fields."""
    folder = Path(folder)
    if not (folder / STATE_FILE).exists():
        raise FileNotFoundError(2, "not a training checkpoint (no trainer_state.json)", str(folder))
    load_model_weights(model, folder)
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    state = json.loads((folder / STATE_FILE).read_text())
    set_rng_state(load_file(str(folder / RNG_FILE)), state.pop("rng"))
    return state


# ---------------------------------------------------------------------- the `latest` pointer
def set_latest(out: str | Path, name: str) -> None:
    """Point out/latest at out/<name>, atomically."""
    out = Path(out)
    tmp = out / f".{LATEST}.tmp{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.symlink(name, tmp, target_is_directory=True)
    except OSError:  # no symlinks here: a pointer file instead
        tmp.write_text(name + "\n")
    os.replace(tmp, out / LATEST)


def resolve_checkpoint(path: str | Path) -> Path | None:
    """A checkpoint folder from a checkpoint, a `latest` pointer, or a run folder; None if none."""
    path = Path(path)
    if (path / STATE_FILE).exists():
        return path
    latest = path if path.name == LATEST else path / LATEST
    if latest.is_symlink() or latest.is_dir():
        target = latest.resolve()
        return target if (target / STATE_FILE).exists() else None
    if latest.is_file():
        target = latest.parent / latest.read_text().strip()
        return target if (target / STATE_FILE).exists() else None
    return None


def checkpoints(out: str | Path) -> list[Path]:
    """out/ckpt-* folders, oldest step first."""
    return sorted(p for p in Path(out).glob("ckpt-*") if p.is_dir() and (p / STATE_FILE).exists())


def prune_checkpoints(out: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all); never the `latest` target."""
    if keep_last <= 0:
        return
    keep = resolve_checkpoint(out)
    for p in checkpoints(out)[:-keep_last]:
        if keep is None or p.resolve() != keep.resolve():
            shutil.rmtree(p, ignore_errors=True)
