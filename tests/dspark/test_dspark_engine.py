"""The trained-drafter path end to end: a DSpark saved in `MODEL/dspark/` (where `dsv41 train-dspark`
puts it) is what `--speculative dspark` loads, and greedy speculation with it equals plain decode."""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import save_checkpoint
from dsv41.config import load_config, with_dspark
from dsv41.engine.dspark_drafter import DSparkDrafter
from dsv41.engine.engine import Engine
from dsv41.engine.speculative import SpeculativeError, build_drafter
from dsv41.model.dspark import DSpark
from dsv41.model.transformer import Transformer


def test_a_saved_drafter_is_found_and_speculation_with_it_equals_plain_decode(tmp_path):
    torch.manual_seed(0)
    main = Transformer(load_config("tiny")).init_weights(seed=0).eval()
    model_dir = tmp_path / "model"
    save_checkpoint(main, model_dir)
    with pytest.raises(SpeculativeError, match="no DSpark drafter"):
        build_drafter("dspark", main, checkpoint=model_dir)
    drafter = DSpark(with_dspark(load_config("tiny"))).init_weights(seed=1)
    save_checkpoint(drafter, model_dir / "dspark")
    found = build_drafter("dspark", main, checkpoint=model_dir)
    assert isinstance(found, DSparkDrafter) and found.k == drafter.block_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 17, 40)]
    plain = Engine(main).generate(prompts, max_tokens=10)
    spec = Engine(main, drafter=found)
    assert spec.generate(prompts, max_tokens=10) == plain
    stats = spec.stats.speculative
    assert stats is not None and stats.verifications > 0, stats
