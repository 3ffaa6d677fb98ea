"""FSDP2, expert parallelism and context parallelism equal single-device training (gloo, CPU): losses and
gradients at every step, parameters after 5 steps (tests/parallel/equality.py), 2 ranks per layout."""

from __future__ import annotations

import os

import pytest
from tests.parallel.equality import run_layout
from tests.parallel.harness import spawn

FULL = pytest.mark.skipif(not os.environ.get("DSV41_PARALLEL_FULL"), reason="set DSV41_PARALLEL_FULL=1 (minutes)")


def _layouts(rank: int, world: int, layouts: list[str]) -> None:
    for layout in layouts:
        run_layout(layout)
        if rank == 0:
            print(f"{layout}: losses, gradients and 5-step parameters equal single-device", flush=True)


@FULL
@pytest.mark.parametrize("layouts", [["dp=2", "dp=2,ep=2", "cp=2"]])
def test_equal_to_single_device(layouts: list[str]) -> None:
    spawn(_layouts, 2, layouts)
