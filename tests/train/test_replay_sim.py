"""The trainer's bounded-replay simulation (SPEC §6, §7 post-training) reaches `Transformer.losses`.

What `window_start` does inside the model is checked against the float64 reference in
tests/model/test_attention_reference.py; here: the trainer draws it as specified, passes it, and the
loss it reports is the model's loss under it (not the loss without it)."""

from __future__ import annotations

import copy

import torch
from tests.conftest import randomize_mixing
from tests.model.csa2_reference import sharpen_attention

from dsv41.train.trainer import TrainConfig, Trainer

LOSS_RTOL = 1e-6  # the same forward twice on one thread count: measured 0 (bit-identical)


def test_replay_simulation_reaches_the_model_losses(tmp_path):
    tc = TrainConfig(preset="tiny", out=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), seq_len=64,
                     batch_size=3, steps=1, replay_sim=True, replay_fraction=1.0, threads=2, device="cpu",
                     progress=False, baseline=False, eval_every=-1, save_every=-1, log_every=1, auto_resume=False)
    tr = Trainer(tc)
    # unit-scale attention so that hiding window keys moves the loss well above the tolerance
    randomize_mixing(tr.model, 3)
    sharpen_attention(tr.model, 3)
    before = copy.deepcopy(tr.model)
    calls = []
    losses_fn = tr._losses

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return losses_fn(*args, **kwargs)

    tr._losses = spy
    stats = tr.train_step()
    ((args, kwargs),) = calls
    tokens, targets = args
    ws = kwargs.get("window_start")
    assert ws is not None, "replay_sim=True must hand a window_start to model.losses"
    B, T = tokens.shape
    t = torch.arange(T)
    for row in ws:  # replay_fraction = 1: every row gets a start s in 1..T−1; queries from s on hide keys < s
        s = int(row.max())
        assert 1 <= s < T and torch.equal(row, torch.where(t >= s, s, 0)), row

    rest = {k: v for k, v in kwargs.items() if k != "window_start"}
    with torch.no_grad():
        replayed = before.losses(tokens, targets, window_start=ws, **rest)
        plain = before.losses(tokens, targets, **rest)
    got, want = stats["lm"].item(), replayed.lm.item()
    assert abs(got - want) <= LOSS_RTOL * want, f"step loss {got:.7f} vs model.losses(window_start) {want:.7f}"
    moved = abs(plain.lm.item() - want)
    assert moved > 100 * LOSS_RTOL * want, f"the replay start barely moved the loss ({moved:.2e}): the case cannot tell"
