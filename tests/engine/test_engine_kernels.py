"""The engine on the Triton kernels equals the engine on the torch twins.

CPU: the `tiny` engine with every op forced to Triton (CPU interpreter) — encoder-only prefill and
batched decode — against the same run on the twins, scaled to short prompts (the interpreter's cost is
per program, i.e. per token): a window of 8, top-k 4, two candidate blocks of 4 (`tiny`'s 32 / 16 / 4 × 8
at a quarter) and two Sinkhorn rounds (the kernels' loop runs once instead of 19 times). GPU: the `small`
model in bf16 on CUDA, kernels (`auto`) and twins both against the fp32 twin engine, at a few hundred tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.conftest import engine_test_model, randomize_mixing

from dsv41 import load_config
from dsv41.engine.cache import SequenceCache, private_pools
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.kernels.ops import use_backend
from dsv41.model.transformer import Transformer


def run(model, prompts: list[list[int]], steps: int, backend: str, exact: bool, device="cpu",
        chunk: int = 24) -> list[torch.Tensor]:
    """Prefill each prompt, then `steps` batched decode steps feeding fixed tokens: every step's logits."""
    runner = Runner(model)
    pools = private_pools(model.config, device, max_slots=len(prompts))
    seqs = [SequenceCache(model.config, device, pools) for _ in prompts]
    out = []
    with use_backend(backend), torch.no_grad():
        out.append(torch.stack([prefill(runner, s, p, chunk=chunk, exact=exact) for s, p in zip(seqs, prompts)]))
        for k in range(steps):
            tok = torch.tensor([[3 + (7 * k + b) % 50] for b in range(len(seqs))], device=device)
            start = torch.tensor([s.n_tokens for s in seqs], device=device)
            h, pre_mix = runner.forward(seqs, tok, start, range(model.config.n_layers))
            for s, t in zip(seqs, tok[:, 0].tolist()):
                s.tokens.append(t)
            out.append(runner.logits(h, pre_mix))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# `tiny` scaled to short prompts: every prompt is longer than the window (the decoder replay starts past 0: a
# window start), the ratio-2 layers keep more entries than the top-k, the decoder's (ratio 1) more than the
# candidate blocks hold, and the Reindex layer more candidates than its top-k
SMALL = dict(window_size=8, index_topk=4, candidate_topk_blocks=2, candidate_block_size=4, hc_sinkhorn_iters=2)
CHUNK = 8  # encoder chunks of the prompts below: 8 + 7 and 8 + 8 + 7 (a wrapped ring from the second one on)


def test_tiny_engine_on_triton_kernels_equals_the_twins():
    """Encoder-only prefill (encoder chunks, the decoder's global KV from the encoder output, the
    decoder's bounded replay with a window start) and batched decode: every op on both paths."""
    model = engine_test_model(31, **SMALL)
    c = model.config
    g = torch.Generator().manual_seed(31)
    lengths = (15, 23)
    assert min(lengths) > max(c.window_size, c.candidate_topk_blocks * c.candidate_block_size, 2 * c.index_topk)
    assert max(lengths) > 2 * CHUNK
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in lengths]
    twin = run(model, prompts, 2, "torch", exact=False, chunk=CHUNK)
    kernels = run(model, prompts, 2, "triton", exact=False, chunk=CHUNK)
    for step, (k, t) in enumerate(zip(kernels, twin)):
        assert torch.isfinite(k).all()
        assert rel_err(k, t) < 1e-4, f"step {step}: logits differ by {rel_err(k, t):.2e}"


@pytest.mark.gpu
def test_small_engine_on_gpu_kernels_is_as_close_to_fp32_as_the_twins():
    """bf16 kernels round differently from the bf16 twins (bf16 P·V operands, FP8 MMAs), so both are
    compared with the fp32 twin engine: the kernels may not be much further from it than the twins."""
    torch.manual_seed(5)
    model = Transformer(load_config("small").replace(qat=True)).init_weights(seed=5)
    randomize_mixing(model, 5)
    ref_model = copy.deepcopy(model).to("cuda").eval()
    model = model.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (300, 517, 90)]
    for exact in (True, False):
        ref = run(ref_model, prompts, 8, "torch", exact, "cuda")
        twin = run(model, prompts, 8, "torch", exact, "cuda")
        kernels = run(model, prompts, 8, "auto", exact, "cuda")
        for step, (k, t, r) in enumerate(zip(kernels, twin, ref)):
            assert rel_err(k, r) <= 2 * rel_err(t, r) + 1e-3, \
                f"exact={exact} step {step}: kernels {rel_err(k, r):.2e} vs twins {rel_err(t, r):.2e} from fp32"
