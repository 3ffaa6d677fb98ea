"""torch.compile of the training forward (issue 18, build 4): every Block traces whole — fullgraph=True, no
graph break from a host sync or a data-dependent shape — and the compiled step gives the eager step's
losses and gradients. CPU, `tiny` in bf16 (grouped_mm's meta kernel, what compile traces MoE with, takes
bf16 only), backend aot_eager (the traced graph run by eager kernels: the test is about tracing, not
Inductor's code generation). Two Sinkhorn rounds instead of 20: the mHC split's loop still runs (and traces)
its body, and each block's graph loses the 18 unrolled copies of it (a third of the tracing time)."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close

from dsv41 import load_config
from dsv41.model.transformer import Transformer
from dsv41.train.trainer import apply_block_options


def _model(**changes) -> Transformer:
    torch.manual_seed(5)
    model = Transformer(load_config("tiny").replace(**changes)).init_weights(seed=5).to(torch.bfloat16).train()
    for moe in model.moe_layers():
        moe.moe_impl = "grouped"  # the GPU path (the loop twin syncs by design)
    return model


def _step(model: Transformer, tokens, doc_ids, attention: str, window_start=None):
    model.zero_grad(set_to_none=True)
    losses = model.losses(tokens, tokens.roll(-1, dims=1), doc_ids=doc_ids, attention=attention,
                          window_start=window_start)
    losses.total.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_every_block_compiles_whole_and_matches_eager(attention):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    B, T = 2, 96
    tokens = torch.randint(3, 1000, (B, T), generator=g)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    doc_ids[0, 37:] = 1  # packed documents: rows with different slot counts
    doc_ids[1, 70:] = 1
    window_start = torch.randint(0, T // 2, (B, T), generator=g)  # bounded replay simulated
    eager = _model(hc_sinkhorn_iters=2)
    compiled = _model(hc_sinkhorn_iters=2)
    compiled.load_state_dict(eager.state_dict())
    want, want_g = _step(eager, tokens, doc_ids, attention, window_start)
    # a limit below tiny's 8 block kinds, raised to an error: a block past it would otherwise run eager unseen
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        apply_block_options(compiled, compile=True, compile_options={"fullgraph": True, "backend": "aot_eager"})
        got, got_g = _step(compiled, tokens, doc_ids, attention, window_start)  # fullgraph: a break raises
    for name in ("lm", "indexer", "balance", "total"):
        assert_close(getattr(got, name).float(), getattr(want, name).float(), rtol=2e-2, atol=2e-3, what=name)
    assert float(got.indexer.detach()) > 0  # the indexer's KL ran inside the compiled blocks
    assert set(got_g) == set(want_g)
    diff = torch.stack([(got_g[n] - want_g[n]).norm() for n in want_g])
    norm = torch.stack([want_g[n].norm() for n in want_g])
    total = (diff.norm() / norm.norm()).item()
    print(f"{attention}: gradients, relative error of the whole {total:.2e}, worst parameter "
          f"{(diff / norm.clamp_min(1e-30)).max().item():.2e}")
    # bf16 (AOT autograd's decomposed backward rounds a few ops differently): measured 0 (sparse) and 2.1e-3
    # (dense) for the whole; parameters whose gradients are 1e-6 of the largest differ by up to 2 %
    assert total < 1e-2, total
    assert (diff <= 5e-2 * norm + 1e-4 * norm.max()).all(), (diff / norm).max()
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_block_compiles_whole_on_cuda_with_the_fused_sparse_kernel():
    """On CUDA the sparse path runs the fused Triton training attention (an autograd.Function): every Block
    still traces whole (fullgraph=True, Inductor) and matches the eager step."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    B, T = 2, 256
    tokens = torch.randint(3, 1000, (B, T), generator=g).cuda()
    doc_ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    doc_ids[0, 100:] = 1
    eager = _model().cuda()
    compiled = _model().cuda()
    compiled.load_state_dict(eager.state_dict())
    apply_block_options(compiled, compile=True, compile_options={"fullgraph": True})
    want, want_g = _step(eager, tokens, doc_ids, "sparse")
    got, got_g = _step(compiled, tokens, doc_ids, "sparse")
    for name in ("lm", "indexer", "balance", "total"):
        assert_close(getattr(got, name).float(), getattr(want, name).float(), rtol=2e-2, atol=2e-3, what=name)
    diff = torch.stack([(got_g[n] - want_g[n]).norm() for n in want_g])
    norm = torch.stack([want_g[n].norm() for n in want_g])
    total = (diff.norm() / norm.norm()).item()
    print(f"cuda sparse: gradients, relative error of the whole {total:.2e}")
    assert total < 2e-2, total  # bf16 with Inductor's fused kernels: not yet measured, a first bound
    torch._dynamo.reset()
