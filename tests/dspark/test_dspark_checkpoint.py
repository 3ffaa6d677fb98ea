"""The drafter's tensors go through the checkpoint code under their official `mtp.*` names: with the
backbone (`load_checkpoint` builds `model.mtp` when the config has a drafter and the files hold it),
alone (`<model>/dspark/`, `load_drafter`), and in the release's storage (`official-fp8`)."""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import CheckpointError, load_checkpoint, load_drafter, read_header, save_checkpoint
from dsv41.checkpoint.release_format import stored_layout
from dsv41.config import load_config, with_dspark
from dsv41.model.dspark import DSpark, drafter_of
from dsv41.model.transformer import Transformer


@pytest.fixture(scope="module")
def pair():
    c = with_dspark(load_config("tiny"))
    main = Transformer(c).init_weights(seed=0)
    return main, DSpark(c).init_weights(seed=1)


def _same(a: DSpark, b: DSpark) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def test_backbone_checkpoint_carries_the_drafter(pair, tmp_path):
    main, drafter = pair
    drafter.attach(main)
    try:
        save_checkpoint(main, tmp_path / "full")
    finally:
        del main.mtp
    assert not any(k.startswith("mtp.") for k in main.state_dict())
    loaded = load_checkpoint(tmp_path / "full")
    assert _same(drafter_of(loaded), drafter)
    assert not hasattr(load_checkpoint(tmp_path / "full", drafter=False), "mtp")
    # a config without a drafter keeps skipping the mtp.* tensors (the shipped small model's case)
    plain = load_checkpoint(tmp_path / "full", config=load_config("tiny"))
    assert drafter_of(plain) is None and not hasattr(plain, "mtp")


def test_drafter_alone_in_the_release_format(pair, tmp_path):
    main, drafter = pair
    save_checkpoint(drafter, tmp_path / "fp8", fmt="official-fp8")
    header = {}
    for f in sorted((tmp_path / "fp8").glob("*.safetensors")):
        header.update({k: v for k, v in read_header(f).items() if k != "__metadata__"})
    assert all(n.startswith("mtp.") for n in header)
    for name, shape in [(n, tuple(t.shape)) for n, t in drafter.state_dict().items()]:
        for stored, dtype, stored_shape in stored_layout(name, shape):  # exactly the release's table
            assert header[stored]["dtype"] == dtype and tuple(header[stored]["shape"]) == stored_shape, stored
    assert header["mtp.0.main_proj.weight"]["dtype"] == "F8_E4M3" and "mtp.0.main_proj.scale" in header
    assert header["mtp.1.ffn.experts.3.w2.weight"]["dtype"] == "I8"
    assert header["mtp.2.markov_head.head.weight"]["dtype"] == "BF16"
    back = load_drafter(tmp_path / "fp8", main)
    err = max((a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-9)
              for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))
    assert 0 < err < 0.2, err  # FP8 / MXFP4 rounding (measured 0.125 relative to the tensor max, MXFP4 experts)
    save_checkpoint(drafter, tmp_path / "float")
    assert _same(load_drafter(tmp_path / "float", main), drafter)


def test_load_drafter_refuses_a_mismatch(pair, tmp_path):
    main, drafter = pair
    save_checkpoint(drafter, tmp_path / "d")
    other = Transformer(load_config("tiny").replace(dim=96)).init_weights(seed=0)
    with pytest.raises(CheckpointError, match="dim"):
        load_drafter(tmp_path / "d", other)
    save_checkpoint(main, tmp_path / "nodraft")  # a drafter config, but no mtp.* tensors
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(tmp_path / "nodraft", main)
    save_checkpoint(Transformer(load_config("tiny")), tmp_path / "plain")
    with pytest.raises(CheckpointError, match="no DSpark drafter"):
        load_drafter(tmp_path / "plain", main)
