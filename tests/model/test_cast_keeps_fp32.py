"""`model.to(dtype)` keeps what must stay fp32 exactly: the RoPE frequencies (a pure function of the config)
and the router's selection biases (trained state). A bf16 cast used to round both to ~3 significant digits —
at position 10^4 the top RoPE frequency's phase was then off by radians in every bf16 engine (the engine
benchmarks', and since 2026-12-04 `dsv41 serve`'s), and experts near a tie could be chosen differently."""

from __future__ import annotations

import torch

from dsv41 import load_config
from dsv41.model.rope import layer_frequencies
from dsv41.model.transformer import Transformer


def model_with_biases(seed: int = 0) -> Transformer:
    m = Transformer(load_config("tiny")).init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed)
    for moe in m.moe_layers():
        moe.gate.bias.data = (torch.rand(moe.gate.bias.shape, generator=g) - 0.5) * 0.2
    return m


def test_a_bf16_cast_and_back_keeps_rope_frequencies_and_router_biases_exact():
    m = model_with_biases()
    biases = [moe.gate.bias.detach().clone() for moe in m.moe_layers()]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        m.to(dtype)
        for layer in m.layers:
            freqs = layer.attn.freqs
            assert freqs.dtype == torch.float32
            assert torch.equal(freqs, layer_frequencies(m.config, layer.attn.ratio))
        for moe, b in zip(m.moe_layers(), biases):
            assert moe.gate.bias.dtype == torch.float32 and torch.equal(moe.gate.bias, b)
        assert m.embed.weight.dtype == dtype  # the rest follows the cast


def test_rope_angles_of_a_bf16_model_equal_the_fp32_models_at_long_positions():
    ref = model_with_biases(1)
    cast = model_with_biases(1).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 127, 10_000, 65_535])
    for a, b in zip(ref.layers, cast.layers):
        for x, y in zip(a.attn.angles(positions), b.attn.angles(positions)):
            assert torch.equal(x, y)
