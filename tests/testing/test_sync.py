"""NoSyncMode catches every kind of host sync / data-dependent shape it claims to, and lets static ops run;
OpCounter counts ops and kernels."""

from __future__ import annotations

import pytest
import torch

from dsv41.testing.sync import HostSyncError, NoSyncMode, OpCounter


def _x() -> torch.Tensor:
    return torch.randn(6, 5)  # fresh values every test


# each entry: (what, function of x); every one must raise inside NoSyncMode and run outside it
SYNCS = {
    "item": lambda x: x.sum().item(),
    "int()": lambda x: int(x[0, 0] > 0),
    "bool() / if": lambda x: bool((x > 0).any()),
    "float()": lambda x: float(x.max()),
    "tolist": lambda x: x.argmax(dim=1).tolist(),
    "numpy": lambda x: x.numpy(),
    "nonzero": lambda x: torch.nonzero(x > 0),
    "argwhere": lambda x: torch.argwhere(x > 0),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "bincount": lambda x: torch.bincount(x.argmax(dim=1)),
    "unique": lambda x: torch.unique(x.argmax(dim=1)),
    "unique dim": lambda x: torch.unique(x.argmax(dim=1, keepdim=True), dim=0),
    "unique_consecutive": lambda x: torch.unique_consecutive(x.argmax(dim=1)),
    "boolean-mask read": lambda x: x[x > 0],
    "boolean-mask row read": lambda x: x[x[:, 0] > 0],
    "boolean-mask write": lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
    "boolean-mask setitem": lambda x: x.clone().__setitem__(x > 0, torch.zeros(())),
    "repeat_interleave without output_size": lambda x: torch.repeat_interleave(x.argmax(dim=1)),
    "repeat_interleave(t, repeats) without output_size":
        lambda x: torch.repeat_interleave(x[:, 0], x.argmax(dim=1)),
    "equal": lambda x: torch.equal(x, x + 1),
    "allclose": lambda x: torch.allclose(x, x + 1),
}

# static shapes, no host read: these must run inside the mode
STATIC = {
    "integer indexing": lambda x: x[x.argmax(dim=0)],
    "index_select": lambda x: x.index_select(0, x[:, 0].argsort()),
    "integer index_put_": lambda x: x.clone().index_put_((torch.tensor([1, 3]),), torch.zeros(5)),
    "repeat_interleave with output_size": lambda x: torch.repeat_interleave(
        x[:, 0], torch.full((6,), 2), output_size=12),
    "repeat_interleave int": lambda x: x.repeat_interleave(3, dim=0),
    "scatter_add_ counts": lambda x: torch.zeros(5, dtype=torch.long).scatter_add_(
        0, x.argmax(dim=1), torch.ones(6, dtype=torch.long)),
    "where": lambda x: torch.where(x > 0, x, 0.0),
    "nonzero_static": lambda x: torch.nonzero_static(x > 0, size=30),
    "topk + sort": lambda x: x.topk(2, dim=1).indices.sort(dim=1, stable=True).values,
    "masked_fill": lambda x: x.masked_fill(x > 0, 0.0),
}


@pytest.mark.parametrize("what", list(SYNCS))
def test_catches(what):
    fn = SYNCS[what]
    x = _x()
    fn(x)  # runs outside the mode
    with pytest.raises(HostSyncError):
        with NoSyncMode():
            fn(x)
    fn(x)  # and the mode is gone afterwards (both halves popped after the error)


@pytest.mark.parametrize("what", list(STATIC))
def test_lets_static_ops_run(what):
    x = _x()
    want = STATIC[what](x)
    with NoSyncMode() as mode:
        got = STATIC[what](x)
    assert mode.ops_seen > 0
    assert torch.equal(got, want)


def test_allow_lets_named_ops_through_and_message_names_the_op():
    x = _x()
    with pytest.raises(HostSyncError, match="aten.nonzero"):
        with NoSyncMode():
            torch.nonzero(x)
    with NoSyncMode(allow={"aten.nonzero.default", "Tensor.tolist"}):
        n = torch.nonzero(x > 0)
        x.argmax(dim=1).tolist()
    assert n.shape[1] == 2
    with pytest.raises(HostSyncError, match="Tensor.tolist"):
        with NoSyncMode(allow={"aten.nonzero.default"}):
            x.tolist()


@pytest.mark.gpu
def test_catches_device_to_host_copies_cuda():
    x = torch.randn(8, device="cuda")
    for fn in (lambda: x.cpu(), lambda: x.to("cpu"), lambda: torch.empty(8).copy_(x), lambda: x.sum().item()):
        with pytest.raises(HostSyncError):
            with NoSyncMode():
                fn()
    with NoSyncMode():  # device-side work and host → device copies are fine
        (x * 2 + torch.ones(8).to("cuda")).sum()


def test_op_counter_counts_ops_and_kernels():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    with OpCounter() as ops:
        c = a + b  # kernel
        d = c.t()  # view
        e = d.reshape(12)  # a view here (non-contiguous → copy would be a kernel)
        torch.empty(3)  # allocation only
        e.mul_(2)  # kernel
    assert ops.counts["aten.add"] == 1 and ops.counts["aten.t"] == 1 and ops.counts["aten.mul_"] == 1
    assert ops.kernels == 3, ops.counts  # add, the copy reshape needs (d is not contiguous), mul_
    assert ops.total == sum(ops.counts.values()) >= 5
