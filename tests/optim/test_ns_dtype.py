"""Muon's Newton–Schulz dtype: bf16 on CUDA for bf16 runs (tensor cores), fp32 otherwise; the trainer and the
post-training optimizers pass the run's choice; a checkpoint never overrides it; bf16 iterations still give
singular values near 1 (an fp64 SVD as the reference)."""

from __future__ import annotations

import pytest
import torch

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.optim.muon import Muon, newton_schulz, ns_dtype_for

# bf16 NS on Gaussian matrices of aspect ≥ 2: singular values in [0.9933, 1.0062], relative distance from the
# exact polar factor U Vᵀ ≤ 2.0e-2 (measured, CPU bf16 matmuls); fp32 is 1e-4 (test_optim_muon.py)
BF16_SV_TOL, BF16_POLAR_RTOL = 0.02, 0.05


def test_ns_dtype_follows_the_device_and_the_training_precision():
    assert ns_dtype_for("cuda", "bf16") is torch.bfloat16
    assert ns_dtype_for(torch.device("cuda", 0), "bf16") is torch.bfloat16
    assert ns_dtype_for("cuda", "fp32") is torch.float32
    assert ns_dtype_for("cpu", "bf16") is torch.float32  # CPU bf16 matmuls are slower than fp32
    assert ns_dtype_for("cpu", "fp32") is torch.float32


@pytest.mark.parametrize("shape", [(64, 384), (384, 1024), (6, 64, 384), (200, 80)])
def test_bf16_newton_schulz_stays_near_the_polar_factor(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    X = newton_schulz(G.float(), dtype=torch.bfloat16)
    assert X.dtype == torch.float32  # returned in the update's dtype
    sv = torch.linalg.svdvals(X.double())
    assert float((sv - 1).abs().max()) < BF16_SV_TOL
    assert float((X.double() - polar).norm() / polar.norm()) < BF16_POLAR_RTOL


def test_trainer_and_posttrain_optimizers_take_the_runs_ns_dtype(monkeypatch, tmp_path):
    """The wiring: whatever ns_dtype_for answers for (device, dtype) is what every Muon group computes in."""
    import dsv41.optim.muon as muon_module
    import dsv41.train.trainer as trainer_module
    from dsv41.posttrain.common import optimizer_for

    calls = []

    def fake(device, dtype):
        calls.append((torch.device(device).type, dtype))
        return torch.float64

    monkeypatch.setattr(muon_module, "ns_dtype_for", fake)
    monkeypatch.setattr(trainer_module, "ns_dtype_for", fake)
    model = Transformer(load_config("tiny")).init_weights(seed=0)
    opt = optimizer_for(model, 1e-4, "bf16")
    assert calls == [("cpu", "bf16")]
    assert {g["ns_dtype"] for g in opt.optimizers["muon"].param_groups} == {torch.float64}

    tc = trainer_module.TrainConfig(preset="tiny", out=str(tmp_path / "run"), cache_dir=str(tmp_path / "tok"),
                                    seq_len=64, batch_size=1, steps=1, device="cpu", dtype="bf16", progress=False,
                                    baseline=False, eval_every=-1, save_every=-1, auto_resume=False, threads=1)
    tr = trainer_module.Trainer(tc)
    assert calls[-1] == ("cpu", "bf16")
    assert {g["ns_dtype"] for g in tr.optimizer.optimizers["muon"].param_groups} == {torch.float64}


def test_a_checkpoint_keeps_its_state_but_not_its_ns_dtype():
    p = torch.nn.Parameter(torch.randn(16, 32))
    saved = Muon([p], lr=0.1, ns_dtype=torch.float32)
    p.grad = torch.randn(16, 32)
    saved.step()
    state = saved.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = Muon([q], lr=0.2, ns_dtype=torch.bfloat16)
    resumed.load_state_dict(state)
    group = resumed.param_groups[0]
    assert group["ns_dtype"] is torch.bfloat16  # this run's
    assert group["lr"] == 0.1  # the checkpoint's hyper-parameters otherwise
    assert torch.equal(resumed.state[q]["momentum_buffer"], saved.state[p]["momentum_buffer"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_newton_schulz_on_cuda_matches_the_cpu_bound():
    G = torch.randn(8, 384, 1024, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    X = newton_schulz(G.float().cuda(), dtype=torch.bfloat16).double().cpu()
    sv = torch.linalg.svdvals(X)
    assert float((sv - 1).abs().max()) < BF16_SV_TOL
    assert float((X - U @ Vh).norm() / (U @ Vh).norm()) < BF16_POLAR_RTOL
