"""Grouping rules on a model with official parameter names; AdamW = torch.optim.AdamW; exact resume."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

from dsv41.optim import LRSchedule, build_optimizer
from dsv41.optim.muon import Muon
from dsv41.optim.sinkhorn import SinkhornBalanced

# name → (optimizer, heads, weight decayed, lr multiplier); written out by hand from SPEC §7
EXPECTED = {
    "embed.weight": ("sinkhorn", None, False, 1.0),
    "head.weight": ("sinkhorn", None, False, 1.0),
    "mtp.0.embed.weight": ("sinkhorn", None, False, 1.0),
    "mtp.0.head.weight": ("sinkhorn", None, False, 1.0),
    "layers.1.engram.embed.weight": ("sinkhorn", None, False, 5.0),
    "layers.0.attn.wq_b.weight": ("muon", 4, True, 1.0),
    "mtp.0.attn.wq_b.weight": ("muon", 4, True, 1.0),
    "layers.1.attn.indexer.wq_b.weight": ("muon", 2, True, 1.0),
    "layers.0.attn.wkv.weight": ("muon", 1, True, 1.0),
    "layers.0.attn.compressor.wkv.weight": ("muon", 1, True, 1.0),
    "layers.0.attn.indexer.compressor.wkv.weight": ("muon", 1, True, 1.0),
    "layers.0.attn.indexer.wk.weight": ("muon", 1, True, 1.0),
    "layers.0.attn.wq_a.weight": ("muon", None, True, 1.0),
    "layers.0.attn.wo_a.weight": ("muon", None, True, 1.0),
    "layers.1.attn.wo_b.weight": ("muon", None, True, 1.0),
    "layers.0.attn.compressor.wgate.weight": ("muon", None, True, 1.0),
    "layers.0.attn.indexer.weights_proj.weight": ("muon", None, True, 1.0),
    "layers.0.ffn.gate.weight": ("muon", None, True, 1.0),
    "layers.0.ffn.experts.w1": ("muon", None, True, 1.0),  # stacked (E, out, in): Muon per expert matrix
    "layers.1.ffn.experts.w2": ("muon", None, True, 1.0),
    "mtp.0.ffn.experts.w3": ("muon", None, True, 1.0),
    "layers.0.ffn.shared_experts.w3.weight": ("muon", None, True, 1.0),
    "layers.1.engram.wkv.weight": ("muon", None, True, 5.0),
    "mtp.0.main_proj.weight": ("muon", None, True, 1.0),
    "projector.0.weight": ("muon", None, True, 1.0),
    "mystery": ("muon", None, True, 1.0),
    "norm.weight": ("adamw", None, True, 1.0),
    "layers.0.attn_norm.weight": ("adamw", None, True, 1.0),
    "layers.0.attn.q_norm.weight": ("adamw", None, True, 1.0),
    "layers.0.attn.indexer.k_norm.weight": ("adamw", None, True, 1.0),
    "mtp.0.main_norm.weight": ("adamw", None, True, 1.0),
    "layers.1.engram.norm.weight": ("adamw", None, True, 5.0),
    "layers.0.attn.attn_sink": ("adamw", None, False, 1.0),
    "layers.0.hc_attn_fn": ("adamw", None, False, 1.0),
    "layers.1.hc_ffn_base": ("adamw", None, False, 1.0),
    "layers.1.hc_ffn_scale": ("adamw", None, False, 1.0),
    "hc_head_fn": ("adamw", None, False, 1.0),
    "mtp.0.hc_head_scale": ("adamw", None, False, 1.0),
    "layers.1.engram.q_weight": ("adamw", None, False, 5.0),
    "layers.1.engram.k_weight": ("adamw", None, False, 5.0),
    "projector.0.bias": ("adamw", None, False, 1.0),
    "layers.0.ffn.gate.bias": ("skip", None, False, 1.0),
}


def _placement(opt) -> dict[str, tuple[str, int | None, bool, float]]:
    """Where each named param actually sits in the combined optimizer's groups."""
    out = {}
    for kind, sub in opt.optimizers.items():
        for group in sub.param_groups:
            decayed = group.get("weight_decay", 0.0) > 0
            for name in group["param_names"]:
                assert name not in out, f"{name} is in two groups"
                out[name] = (kind, group.get("heads"), decayed, group["lr_mult"])
    return out


def test_grouping_rules(fake_model, caplog):
    with caplog.at_level(logging.WARNING, logger="dsv41.optim.groups"):
        opt = build_optimizer(fake_model, lr=1e-3)
    placed = _placement(opt)
    for name, want in EXPECTED.items():
        got = placed.get(name, ("skip", None, False, 1.0))
        assert got == want, f"{name}: got {got}, want {want}"
    trainable = {n for n, p in fake_model.named_parameters() if p.requires_grad}
    assert set(placed) == trainable, f"missing {trainable - set(placed)}, extra {set(placed) - trainable}"
    assert isinstance(opt["muon"], Muon) and isinstance(opt["sinkhorn"], SinkhornBalanced)
    assert isinstance(opt["adamw"], torch.optim.AdamW)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(1e-3 * group["lr_mult"])
    assert {g["betas"] for g in opt["adamw"].param_groups} == {(0.9, 0.95)}
    assert {g["eps"] for g in opt["adamw"].param_groups} == {1e-20}
    # the summary is readable and the unknown matrix was reported
    text = str(opt.summary)
    assert "mystery" in text and "sinkhorn: 5 tensors" in text
    assert any("mystery" in r.getMessage() for r in caplog.records)
    assert opt.summary.counts()["skip"][0] == 3  # the three MoE gate biases


def test_real_model_experts_are_stacked_muon_and_nothing_is_unknown(caplog):
    """The real Transformer (tiny): each stacked routed-expert weight is one Muon param of E matrices, no
    parameter falls to an 'unknown' rule; the official per-expert (2-D) names still map to Muon too."""
    from dsv41 import load_config
    from dsv41.model.transformer import Transformer
    from dsv41.optim.groups import assign

    config = load_config("tiny")
    model = Transformer(config)
    with caplog.at_level(logging.WARNING, logger="dsv41.optim.groups"):
        opt = build_optimizer(model, lr=1e-3)
    assert opt.summary.notes() == [] and not caplog.records, opt.summary.notes()
    placed = _placement(opt)
    stacked = [n for n in placed if ".ffn.experts." in n]
    E, dim, inter = config.n_routed_experts, config.dim, config.moe_inter_dim
    assert len(stacked) == 3 * config.n_layers, stacked
    params = dict(model.named_parameters())
    for name in stacked:
        assert placed[name] == ("muon", None, True, 1.0), name
        want = (E, dim, inter) if name.endswith("w2") else (E, inter, dim)
        assert tuple(params[name].shape) == want, name
        assert opt.summary.assignments[name][1].rule == f"{E} stacked matrices, one by one"
    per_expert = assign("layers.0.ffn.experts.3.w2.weight", torch.zeros(dim, inter, requires_grad=True), None)
    assert (per_expert.optimizer, per_expert.heads, per_expert.rule) == ("muon", None, "matrix")


def test_heads_for_overrides_config(fake_model):
    opt = build_optimizer(fake_model, lr=1e-3, heads_for=lambda name: 8 if ".indexer." not in name else 1)
    placed = _placement(opt)
    assert placed["layers.0.attn.wq_b.weight"][1] == 8
    assert placed["layers.0.attn.indexer.wq_b.weight"][1] == 1


def test_adamw_group_equals_torch_adamw(fake_model, set_grads):
    lr, wd = 3e-3, 0.1
    reference_model = copy.deepcopy(fake_model)
    opt = build_optimizer(fake_model, lr=lr, weight_decay=wd)
    adamw_names = [n for g in opt["adamw"].param_groups for n in g["param_names"]]
    ref_params = dict(reference_model.named_parameters())
    # reference: plain torch.optim.AdamW, one group per parameter with the SPEC §7 settings
    ref_groups = [
        {
            "params": [ref_params[n]],
            "lr": lr * (5.0 if ".engram." in n else 1.0),
            "weight_decay": wd if n.endswith("norm.weight") else 0.0,
        }
        for n in adamw_names
    ]
    ref = torch.optim.AdamW(ref_groups, lr=lr, betas=(0.9, 0.95), eps=1e-20)
    schedule = LRSchedule(peak=lr, final=lr / 10, warmup_tokens=100, constant_until_tokens=200, decay_until_tokens=400)
    params = dict(fake_model.named_parameters())
    for step in range(1, 6):
        set_grads(fake_model, seed=step)
        set_grads(reference_model, seed=step)
        tokens = 90 * step
        schedule.apply(opt, tokens)
        for group, name in zip(ref.param_groups, adamw_names):
            group["lr"] = schedule.lr_at(tokens) * (5.0 if ".engram." in name else 1.0)
        opt.step()
        ref.step()
        for name in adamw_names:
            assert torch.equal(params[name], ref_params[name]), f"step {step}: {name} differs"


def _train(model, opt, seeds, set_grads):
    for seed in seeds:
        set_grads(model, seed)
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_continues_bit_identically(make_model, set_grads):
    model = make_model()
    opt = build_optimizer(model, lr=2e-2)
    _train(model, opt, seeds=range(3), set_grads=set_grads)

    buffer = io.BytesIO()  # through serialization, as a checkpoint would be
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only: plain tensors and Python values
    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = build_optimizer(resumed, lr=123.0)  # lr comes back from the checkpoint
    resumed_opt.load_state_dict(checkpoint["optim"])

    _train(model, opt, seeds=range(3, 6), set_grads=set_grads)
    _train(resumed, resumed_opt, seeds=range(3, 6), set_grads=set_grads)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name} diverged after resume"

    # the check has teeth: a fresh optimizer (momentum lost) does not continue the same way
    fresh = make_model()
    fresh.load_state_dict(checkpoint["model"])
    _train(fresh, build_optimizer(fresh, lr=2e-2), seeds=range(3, 6), set_grads=set_grads)
    assert not torch.equal(fresh.layers[0].attn.wq_a.weight, model.layers[0].attn.wq_a.weight)


def test_load_state_dict_rejects_other_layout(fake_model):
    opt = build_optimizer(fake_model, lr=1e-3)
    state = opt.state_dict()
    del state["sinkhorn"]
    with pytest.raises(ValueError):
        opt.load_state_dict(state)
