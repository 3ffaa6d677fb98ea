"""Training the drafter on `tiny` (CPU): the loss goes down and the acceptance rises; the CLI runs end to
end and rejects bad options with exit code 2.

The backbone is a random `tiny` with a sharpened head (×10: peaked, input-dependent distributions to
match) on a synthetic text in which each token usually follows a fixed permutation of the previous
one, so later draft positions are predictable from the anchor.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv41.checkpoint import load_drafter, save_checkpoint
from dsv41.cli import main as cli
from dsv41.config import load_config
from dsv41.model.transformer import Transformer
from dsv41.train.dspark import DSparkTrainConfig, DSparkTrainer, greedy_continuation

V0, NV = 17, 32


def _rows(g: torch.Generator, n: int, T: int, perm: torch.Tensor) -> torch.Tensor:
    x = torch.empty(n, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, NV, (n,), generator=g)
    for t in range(T):
        x[:, t + 1] = perm[x[:, t]]
    flip = torch.rand(n, T + 1, generator=g) < 0.1
    return torch.where(flip, torch.randint(0, NV, (n, T + 1), generator=g), x) + V0


def _batches(perm: torch.Tensor, T: int = 32):
    g = torch.Generator().manual_seed(1)
    while True:
        t = _rows(g, 2, T, perm)
        yield {"tokens": t[:, :-1], "targets": t[:, 1:], "doc_ids": torch.ones(2, T, dtype=torch.long),
               "loss_mask": torch.ones(2, T, dtype=torch.bool)}


@pytest.mark.slow
def test_loss_falls_and_acceptance_rises(tmp_path):
    torch.manual_seed(0)
    main = Transformer(load_config("tiny")).init_weights(seed=0)
    with torch.no_grad():
        main.head.weight.mul_(10.0)
    perm = torch.randperm(NV, generator=torch.Generator().manual_seed(3))
    seqs = greedy_continuation(main, _rows(torch.Generator().manual_seed(2), 2, 16, perm)[:, :12], 12)
    tc = DSparkTrainConfig(model="unused", out=str(tmp_path), steps=40, n_anchors=8, lr=3e-3, lr_final=1e-3,
                           log_every=10, progress=False, eval_prompt_len=12, eval_new_tokens=12, save_format="float",
                           device="cpu", plot=False)
    trainer = DSparkTrainer(tc, main=main, batches=_batches(perm), eval_sequences=seqs)
    final = trainer.run()
    train = [r for r in trainer.history if r["type"] == "train"]
    first, last = train[0], train[-1]  # means over steps 1-10 and 31-40
    assert last["total"] < first["total"] - 0.15, (first["total"], last["total"])  # measured 2.66 -> 2.43
    gain = [b - a for a, b in zip(first["accept"], last["accept"])]
    assert sum(gain[1:]) / len(gain[1:]) > 0.02, gain  # positions 1-4: measured +0.045 each (0.30 -> 0.34)
    assert last["l1"] < first["l1"] and last["confidence"] < first["confidence"] + 0.05
    # the run's files: metrics, plot, drafter (loads back under the official names)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records][:1] == ["start"] and records[-1]["type"] == "eval"
    assert set(final["tau"]) == set(range(1, 6)) and all(1.0 <= v <= 6.0 for v in final["tau"].values())
    back = load_drafter(tmp_path, main)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), trainer.drafter.state_dict().values()))


def test_cli_trains_two_steps_and_rejects_bad_options(tmp_path, capsys):
    model = Transformer(load_config("tiny")).init_weights(seed=0)
    save_checkpoint(model, tmp_path / "model")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 8
    for split, n in (("train", 6), ("val", 2)):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(n)))
    args = ["train-dspark", "--model", str(tmp_path / "model"), "--data", str(corpus), "--cache_dir",
            str(tmp_path / "cache"), "--device", "cpu", "--steps", "2", "--batch_size", "1", "--seq_len", "64",
            "--n_anchors", "4", "--eval_prompts", "1", "--eval_prompt_len", "16", "--eval_new_tokens", "8",
            "--progress=false"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "τ(5)=" in out and (tmp_path / "model" / "dspark" / "config.json").exists()
    assert (tmp_path / "model" / "dspark" / "acceptance.png").stat().st_size > 10_000
    records = [json.loads(line) for line in (tmp_path / "model" / "dspark" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "eval_saved" and records[-1]["format"] == "official-fp8"
    assert cli(["train-dspark", "--model", str(tmp_path / "model"), "--block_size", "0"]) == 2
    assert cli(["train-dspark", "--model", str(tmp_path / "model"), "--no_such_option", "1"]) == 2
    assert cli(["train-dspark", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("dsv41: error:") == 3 and "no_such_option" in err
