"""`dsv41 train`: pre-train a preset on a corpus folder, resumable; `--plot RUN` draws its curves.

Every TrainConfig field is an option, `--key=value` or `--key value` (`--model.KEY=JSON` overrides
a ModelConfig field). An unknown key or a value of the wrong type is one error line naming the key,
exit code 2 (raised as ConfigError, printed by `dsv41.cli.main`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  dsv41 train --preset tiny --out runs/tiny --steps=200 --seq_len=256 --batch_size=4
  dsv41 train --preset small --data data/corpus --out runs/small --total_tokens=2e9 --dtype=bf16
  dsv41 train --preset small --seq_len=65536 --batch_size=1 --checkpoint-activations --compile --dtype=bf16
  dsv41 train --preset tiny --attention=dense        # the dense masked spec (same math, O(T²) memory)
  dsv41 train --preset small --seq_len=4096 --batch_size=16 --long_seq_len=65536 --long_from=0.75
                                                     # rows of 4K, then of 64K from 3/4 of the run (SPEC §7)
  dsv41 train --out runs/small                       # resumes from runs/small/latest
  dsv41 train --resume runs/small/ckpt-001000 --out runs/small
  dsv41 train --plot runs/small                      # runs/small/curves.png from metrics.jsonl
  torchrun --standalone --nproc-per-node 4 -m dsv41 train --preset tiny --steps 50 --grad_accum 4 \
      --parallel dp=2,pp=2 --out runs/tiny-pp          # distributed (docs/distributed.md)
"""


class OverridesParser(argparse.ArgumentParser):
    """Leaves unrecognized `--key=value` arguments to a config dataclass (`namespace.overrides`) instead of
    failing on them, and lists that dataclass's fields in --help, built on demand (importing a trainer
    imports torch). Made from a subparser by `as_overrides_parser`."""

    field_help: Callable[[], str]
    examples: str = ""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.overrides = list(extras)
        return namespace, []

    def format_help(self) -> str:
        self.epilog = self.field_help() + "\n\n" + self.examples
        return super().format_help()


def as_overrides_parser(p: argparse.ArgumentParser, field_help: Callable[[], str], examples: str
                        ) -> OverridesParser:
    """`p` (built by `add_parser` as the parent's parser class) turned into an `OverridesParser`."""
    p.__class__ = OverridesParser
    p.field_help, p.examples = field_help, examples  # type: ignore[attr-defined]
    return p  # type: ignore[return-value]


def dataclass_field_help(cls: type, title: str) -> str:
    """`title`, then every field of dataclass `cls` with its default and the comment it carries in the source."""
    import inspect
    import re

    comments = dict(re.findall(r"^\s+(\w+): [^=]+=.*?#\s*(.*)$", inspect.getsource(cls), re.M))
    lines = [title]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {f'--{f.name}={default}':<30} {comments.get(f.name, '')}")
    return "\n".join(lines)


def _field_help() -> str:
    from dsv41.train.trainer import TrainConfig

    return dataclass_field_help(TrainConfig, "options (TrainConfig fields, --key=value; --model.KEY=JSON sets a "
                                             "ModelConfig field):")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="pre-train a model on a corpus (resumable, metrics.jsonl, checkpoints)",
        description="Train a preset with Muon / Sinkhorn / AdamW on packed documents (SPEC §7). Writes\n"
                    "OUT/metrics.jsonl and atomic checkpoints OUT/ckpt-<step>/ (OUT/latest points at the\n"
                    "newest); rerunning with the same --out resumes exactly.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    as_overrides_parser(p, _field_help, EXAMPLES)  # keep --key=value extras for TrainConfig
    p.add_argument("--resume", metavar="DIR", help="checkpoint (or run folder / latest) to resume from")
    p.add_argument("--plot", metavar="RUN", type=Path, help="only draw RUN/metrics.jsonl into RUN/curves.png")
    return p


def run(args: argparse.Namespace) -> int:
    from dsv41.train.trainer import Trainer, split_overrides, train_config_from_overrides

    if args.plot is not None:
        from dsv41.train.plot import plot_metrics

        metrics = args.plot / "metrics.jsonl"
        if not metrics.exists():
            raise FileNotFoundError(2, "No such file", str(metrics))
        print(plot_metrics(metrics, args.plot / "curves.png"))
        return 0
    tc = train_config_from_overrides(split_overrides(args.overrides))
    if tc.parallel:  # under torchrun: every rank runs this (dsv41.parallel.trainer)
        from dsv41.parallel.trainer import ParallelTrainer

        trainer = ParallelTrainer(tc, resume=args.resume)
    else:
        trainer = Trainer(tc, resume=args.resume)
    if trainer.resumed_from is not None:
        print(f"resuming from {trainer.resumed_from} (step {trainer.step}, {trainer.tokens:,} tokens)")
    trainer.run()
    print(f"done: step {trainer.step}, {trainer.tokens:,} tokens -> {tc.out}")
    return 0
