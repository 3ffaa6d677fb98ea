"""`--dtype` of `dsv41 generate` / `dsv41 serve` (auto = bf16 on CUDA, fp32 elsewhere).

Claims checked (CPU): bf16 casts every weight but the engine's fp32 ones (head, routers, compressors, mHC
coefficients, sinks), which keep their exact fp32 values (a plain `.to(bf16)` would round them); the command
runs and a bad value exits 2; the prefix store's model identity tells a bf16 engine from an fp32 one of the
same weights, and leaves fp32 identities as they were (computed here from the documented parts).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from dsv41.cli import main
from dsv41.engine.cli import load_model_and_tokenizer
from dsv41.engine.engine import fp32_weights
from dsv41.fingerprint import model_identity, tokenizer_fingerprint, weights_fingerprint


def load(dtype: str):
    args = argparse.Namespace(device="cpu", dtype=dtype, checkpoint=None, preset="tiny", random_init=True,
                              tokenizer=None)
    return load_model_and_tokenizer(args)


def test_bf16_casts_all_but_the_engines_fp32_weights_which_keep_their_values():
    ref, _ = load("fp32")
    model, _ = load("bf16")
    kept = {id(w) for w in fp32_weights(model)}
    ref_params = dict(ref.named_parameters())
    n_bf16 = 0
    for name, p in model.named_parameters():
        if id(p) in kept or p.dtype == torch.float32:  # the engine's, or the model's own fp32 ones (biases)
            assert p.dtype == torch.float32 and torch.equal(p, ref_params[name]), name
        else:
            n_bf16 += 1
            assert p.dtype == torch.bfloat16 and torch.equal(p, ref_params[name].to(torch.bfloat16)), name
    assert n_bf16 > len(kept) > 0
    for layer in model.layers:  # what the release stores in fp32 (checkpoint.release_format)
        assert layer.attn.attn_sink.dtype == torch.float32 and layer.hc_attn_fn.dtype == torch.float32
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():  # RoPE frequencies stay fp32, exact
        if name.endswith(".freqs"):
            assert b.dtype == torch.float32 and torch.equal(b, ref_buffers[name]), name
    auto, _ = load("auto")  # CPU: fp32
    assert all(p.dtype == torch.float32 for p in auto.parameters())


def test_generate_runs_in_bf16_and_refuses_an_unknown_dtype(capsys):
    base = ["generate", "--preset", "tiny", "--random-init", "--device", "cpu", "--prompt", "hi", "--max-tokens", "3"]
    assert main(base + ["--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(base + ["--dtype", "fp16"]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_the_model_identity_names_the_dtype_and_keeps_fp32_identities():
    fp32, tok = load("fp32")
    bf16, _ = load("bf16")
    again, _ = load("fp32")
    assert model_identity(fp32, tok) == model_identity(again, tok)
    assert model_identity(bf16, tok) != model_identity(fp32, tok)
    parts = {"weights": weights_fingerprint(fp32), "config": fp32.config.to_dict(),
             "tokenizer": tokenizer_fingerprint(tok)}
    want = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    assert model_identity(fp32, tok) == want
