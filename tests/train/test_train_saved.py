"""benchmarks/train_saved.py: the census counts each saved storage once, scales with the tokens, and leaves
parameters out."""

from __future__ import annotations

import json

import torch
from tests.conftest import load_script


def _script():
    return load_script("benchmarks/train_saved.py")


def test_census_counts_saved_storages_once_and_skips_parameters():
    s = _script()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def run():
        y = (x @ w).sin()  # saves x, w (a parameter: skipped) and x @ w
        (y * y).sum()  # saves y twice: one storage

    by_site, _ = s.census(run, {w.untyped_storage().data_ptr()}, "tests/train/")
    assert sum(by_site.values()) == 3 * 4 * 8 * 4  # x, x @ w, y: fp32 (4, 8) each


def test_the_benchmark_writes_bytes_per_token_that_do_not_grow_with_the_batch(tmp_path):
    s = _script()
    per_token = []
    for batch in (1, 2):
        assert s.main(["--preset", "tiny", "--batch", str(batch), "--seq", "32", "--no-peer",
                       "--out", str(tmp_path / str(batch))]) == 0
        (f,) = (tmp_path / str(batch)).glob("train_saved-*.json")
        d = json.loads(f.read_text())["dsv41"]
        assert d["saved_mib"] > 0 and d["sites_mib"]
        per_token.append(d["saved_kib_per_token"])
    # more tokens save more, never more per token (per-forward tensors are shared by the rows)
    assert 0.5 * per_token[0] < per_token[1] <= per_token[0]
    assert s.main(["--batch", "0", "--no-peer", "--out", str(tmp_path)]) == 2
