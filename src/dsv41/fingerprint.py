"""Fingerprints of what a model's outputs depend on: its weights, its tokenizer and its config (issue 17).

The prefix cache keys stored KV by these (SPEC §6: a unit may only be reused by the model that wrote it). Two
checkpoints of one preset share a config but never a fingerprint, so they never share a cache entry.

  * `checkpoint_fingerprint(dir)`: SHA-256 over the checkpoint's weight files (`*.safetensors`, in name order,
    each as name + size + bytes). Computed once and cached in a small side file, `.dsv41-fingerprint.json`, in
    the checkpoint directory, keyed by each file's size and modification time (a changed file is hashed again;
    a read-only directory just hashes at every load: ~0.1 s for the shipped 52 MB model).
  * `tensor_fingerprint(model)`: SHA-256 over the state dict in name order (name, dtype, shape, bytes): for
    models that were never saved (random init).
  * `tokenizer_fingerprint(tok)`: SHA-256 of the tokenizer's JSON.
  * `model_identity(...)`: the three, plus the config, as one hex string (the prefix cache's `identity`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SIDE_FILE = ".dsv41-fingerprint.json"
_CHUNK = 8 << 20


def _weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" and p.is_file())


def checkpoint_fingerprint(directory: str | Path) -> str:
    """SHA-256 hex of a checkpoint's weight files; cached in `directory/.dsv41-fingerprint.json`."""
    directory = Path(directory)
    files = _weight_files(directory)
    if not files:
        raise ValueError(f"no .safetensors files in {directory}")
    stats = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    side = directory / SIDE_FILE
    try:
        cached = json.loads(side.read_text())
        if cached.get("files") == stats and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256(b"dsv41-weights\x00")
    for p in files:
        h.update(p.name.encode() + b"\x00" + p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    tmp = side.with_name(f"{SIDE_FILE}.{os.getpid()}.tmp")
    try:  # best effort: a read-only checkpoint directory is fine
        tmp.write_text(json.dumps({"files": stats, "sha256": digest}, indent=1))
        os.replace(tmp, side)
    except OSError as e:
        log.debug("could not cache the weight fingerprint in %s (%s)", side, e)
        tmp.unlink(missing_ok=True)
    return digest


def tensor_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 hex over the state dict, in name order (name, dtype, shape and bytes of each tensor)."""
    h = hashlib.sha256(b"dsv41-tensors\x00")
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def tokenizer_fingerprint(tok) -> str:
    """SHA-256 hex of the tokenizer's serialized JSON (`Tok` or a raw `tokenizers.Tokenizer`)."""
    raw = getattr(tok, "tokenizer", tok)
    return hashlib.sha256(raw.to_str().encode()).hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint the loader attached (`model.weights_fingerprint`), else one computed from the tensors
    (and attached, so it is computed once)."""
    fp = getattr(model, "weights_fingerprint", None)
    if not fp:
        fp = tensor_fingerprint(model)
        model.weights_fingerprint = fp
    return fp


def model_identity(model: torch.nn.Module, tok=None) -> str:
    """One hex string naming weights + tokenizer + config (+ the weights' dtypes when not all fp32: a bf16 engine
    computes other KV from the same checkpoint): what the prefix cache salts every key with."""
    parts = {"weights": weights_fingerprint(model), "config": model.config.to_dict(),
             "tokenizer": tokenizer_fingerprint(tok) if tok is not None else None}
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if dtypes != ["torch.float32"]:  # fp32 identities stay what they were
        parts["dtypes"] = dtypes
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
