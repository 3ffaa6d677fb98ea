"""The pipeline payload carries exactly the live CSA2 shared state (SPEC §3): at every possible cut of the
tiny, small and v41-flash layer plans, `plan_boundary` equals a from-scratch simulation of the shared
record — which layer last published each field up to the cut, and which fields a later layer reads before
a later layer overwrites them. A field is shipped iff it is live, so a source's state is dropped at the
first boundary after its last consumer. No process group: milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv41 import load_config
from dsv41.parallel.pipeline import plan_boundary
from dsv41.plan import FULL, REINDEX, REUSE, layer_plan


def simulate(plans, after: int) -> dict:
    """Walk the layers: who published each field up to `after`, which fields are read after it while live."""
    published: dict[str, int] = {}
    for p in plans[:after + 1]:
        if p.mode == FULL:
            published.update(kv=p.layer_id, index_k=p.layer_id, topk=p.layer_id)
            if p.candidate_source:
                published["candidates"] = p.layer_id
        elif p.mode == REINDEX:
            published["topk"] = p.layer_id
    live, overwritten = set(), set()
    for p in plans[after + 1:]:
        reads = {REUSE: {"kv", "topk"}, REINDEX: {"kv", "index_k"}}.get(p.mode, set())
        if p.uses_candidates:
            reads.add("candidates")
        live |= {f for f in reads if f in published and f not in overwritten}
        if p.mode == FULL:
            overwritten |= {"kv", "index_k", "topk"} | ({"candidates"} if p.candidate_source else set())
        elif p.mode == REINDEX:
            overwritten.add("topk")
    return {f: published[f] for f in live}


@pytest.mark.parametrize("preset", ["tiny", "small", "v41-flash"])
def test_payload_is_the_live_shared_state(preset: str) -> None:
    model = SimpleNamespace(plan=layer_plan(load_config(preset)))  # plan_boundary reads the plan only
    plans, shipped_somewhere = model.plan, 0
    for after in range(len(plans) - 1):
        b, live = plan_boundary(model, after), simulate(plans, after)
        got = {"kv": b.kv_source, "topk": b.topk_source, "candidates": b.candidate_source,
               "index_k": b.kv_source if b.index_keys else None}
        expected = {f: live.get(f) for f in got}
        assert got == expected, f"{preset}: cut after layer {after}: payload {got}, live state {expected}"
        if b.kv_source is not None:
            assert b.ratio == plans[b.kv_source].ratio
        shipped_somewhere += b.kv_source is not None
    assert shipped_somewhere > 0  # some cut separates a kv source from its consumers
