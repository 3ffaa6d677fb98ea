"""The whole training step on every training kernel at once (`DSV41_KERNELS=triton`) against the whole step on the
twins (`torch`): the LM and indexer losses and every parameter's gradient, fp32, with packed documents and a replay
start. Each kernel has its own test against fp64; this one checks that they compose — that every op which runs a
kernel under a gradient has a backward (an inference kernel there would cut the graph and leave gradients missing)
and that the model passes them what the twins get."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_grads_close, randomize_mixing

from dsv41 import load_config
from dsv41.kernels.ops import use_backend
from dsv41.model.transformer import Transformer

pytest.importorskip("triton")

# the training Functions whose backward must appear in the step's graph on the kernel path
KERNEL_NODES = ("_RoPEBackward", "_RMSNormTrainBackward", "_SwiGLUTrainBackward", "_SinkhornSplitBackward",
                "MhcPostTrainBackward", "_SparseTrainAttentionBackward", "_SelectedScoresKernelBackward")


def _graph_nodes(root) -> set[str]:
    """Class names of every autograd node reachable from `root`."""
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_training_step_on_every_kernel_equals_the_twins():
    """`tiny` cut to 6 layers (window-only, Full m = 2, Reuse; Full m = 1 with the candidate pool, Reuse, Reindex),
    2 Sinkhorn rounds (the kernels' own tests run 20; here they only cost interpreter time), 44 tokens in two
    documents with a replay start; fp32, so the two paths differ only by reduction order."""
    config = load_config("tiny").replace(
        n_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layers=[1, 3], index_source_layers=[1, 3, 5],
        candidate_source_layer=3, hc_sinkhorn_iters=2)
    model = Transformer(config).init_weights(seed=11).train()
    randomize_mixing(model, 11)
    T = 44
    g = torch.Generator().manual_seed(12)
    tokens = torch.randint(3, config.vocab_size, (1, T + 1), generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, 9:] = 1  # the second document longer than the window (32)
    ws = torch.where(torch.arange(T) >= 37, 37, 0).unsqueeze(0)

    def run(backend: str):
        model.zero_grad(set_to_none=True)
        with use_backend(backend):
            losses = model.losses(tokens[:, :-1], tokens[:, 1:], doc_ids=doc, window_start=ws, attention="sparse")
            nodes = _graph_nodes(losses.total.grad_fn)
            losses.total.backward()
        return losses, nodes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lt, nodes_t, gt = run("torch")
    lk, nodes_k, gk = run("triton")
    missing = [name for name in KERNEL_NODES if name not in nodes_k]
    assert not missing, f"training kernels that did not run: {missing}"
    assert not nodes_t.intersection(KERNEL_NODES), "the torch backend ran a kernel"
    for name in ("lm", "indexer", "total"):
        want, got = getattr(lt, name).item(), getattr(lk, name).item()
        assert abs(got - want) <= 1e-5 * abs(want), f"{name}: kernels {got:.8f} vs twins {want:.8f}"
    assert gk.keys() == gt.keys(), f"gradients missing on the kernel path: {sorted(gt.keys() - gk.keys())}"
    assert_grads_close(gk, gt, 1e-5)
