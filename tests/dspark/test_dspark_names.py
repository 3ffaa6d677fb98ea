"""The drafter's tensors are the release's `mtp.*` tensors (issue 19, acceptance 4) and its size is the
accounting formula's.

The expected table is written here from the official `inference/model.py` (DSparkBlock = Block with
DSparkAttention; stage 0 adds main_proj / main_norm, the last stage norm, DSparkMarkovHead (a
ParallelEmbedding and a ParallelHead of width dspark_markov_rank) and DSparkConfidenceHead
(Linear(dim + rank, 1)); Gate.bias_vl exists when vision is enabled; Linear weights are (out, in)) and
the release's config.json (dim 5120, 64 heads × 512, q_lora_rank 1280, o_groups 8 × o_lora_rank 1024,
hc_mult 4, moe_inter_dim 2304, 128 routed experts, 3 stages, 3 target layers, rank 256, vocab 129280).
"""

from __future__ import annotations

import torch

from dsv41.accounting.params import dspark_params
from dsv41.config import load_config, with_dspark
from dsv41.model.dspark import DSpark


def official_mtp_table() -> dict[str, tuple[int, ...]]:
    dim, hc, heads, hd, q_rank, groups, o_rank, inter, experts, rank, vocab = (
        5120, 4, 64, 512, 1280, 8, 1024, 2304, 128, 256, 129280)
    table: dict[str, tuple[int, ...]] = {}
    for k in range(3):
        p = f"mtp.{k}."
        for sub in ("attn", "ffn"):
            table[f"{p}hc_{sub}_fn"] = ((2 + hc) * hc, hc * dim)
            table[f"{p}hc_{sub}_base"] = ((2 + hc) * hc,)
            table[f"{p}hc_{sub}_scale"] = (3,)
            table[f"{p}{sub}_norm.weight"] = (dim,)
        table.update({
            f"{p}attn.attn_sink": (heads,), f"{p}attn.wq_a.weight": (q_rank, dim), f"{p}attn.q_norm.weight": (q_rank,),
            f"{p}attn.wq_b.weight": (heads * hd, q_rank), f"{p}attn.wkv.weight": (hd, dim),
            f"{p}attn.kv_norm.weight": (hd,), f"{p}attn.wo_a.weight": (groups * o_rank, heads * hd // groups),
            f"{p}attn.wo_b.weight": (dim, groups * o_rank),
            f"{p}ffn.gate.weight": (experts, dim), f"{p}ffn.gate.bias": (experts,), f"{p}ffn.gate.bias_vl": (experts,),
        })
        for w, shape in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            table[f"{p}ffn.shared_experts.{w}.weight"] = shape
            for e in range(experts):
                table[f"{p}ffn.experts.{e}.{w}.weight"] = shape
    table["mtp.0.main_proj.weight"] = (dim, 3 * dim)
    table["mtp.0.main_norm.weight"] = (dim,)
    table["mtp.2.norm.weight"] = (dim,)
    table["mtp.2.markov_head.embed.weight"] = (vocab, rank)
    table["mtp.2.markov_head.head.weight"] = (vocab, rank)
    table["mtp.2.confidence_head.proj.weight"] = (1, dim + rank)
    return table


def test_v41_flash_drafter_has_exactly_the_official_mtp_tensors():
    with torch.device("meta"):
        drafter = DSpark(load_config("v41-flash"))
    have = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
    want = official_mtp_table()
    assert len(want) == 1224
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    assert not missing and not extra, f"missing {missing[:5]} ({len(missing)}), extra {extra[:5]} ({len(extra)})"
    wrong = {n: (have[n], want[n]) for n in want if have[n] != want[n]}
    assert not wrong, f"shapes differ: {dict(list(wrong.items())[:5])}"


def _accounted(config) -> int:
    return sum(p.numel for p in dspark_params(config))


def test_parameter_count_equals_the_accounting_formula():
    flash = load_config("v41-flash")
    with torch.device("meta"):
        drafter = DSpark(flash)
    assert drafter.num_parameters() == _accounted(flash) == sum(
        torch.Size(s).numel() for s in official_mtp_table().values())
    tiny = with_dspark(load_config("tiny"))
    assert DSpark(tiny).num_parameters() == _accounted(tiny)
