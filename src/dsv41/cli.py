"""`dsv41` / `python -m dsv41`: one entry point, one subcommand per job.

Subcommands live in a registry: each entry names an object (or a module) with two attributes,
`add_parser(subparsers) -> ArgumentParser` and `run(args) -> int`. A module adds its own command by
appending to `SUBCOMMANDS` below (e.g. `"train": "dsv41.train.cli"`); it is imported only when the
parser is built, so keep heavy imports (torch) inside `run`. Only implemented commands are listed.

Errors a user can fix (a malformed preset or config.json, a missing file) print one line,
`dsv41: error: <message naming the field>`, on stderr and exit with code 2 — no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Protocol

from dsv41.config import ConfigError, ModelConfig, load_config, preset_names


class Subcommand(Protocol):
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> "module" or "module:attribute" providing add_parser / run (in --help order)
SUBCOMMANDS: dict[str, str] = {
    "plan": "dsv41.cli:PLAN",
    "accounting": "dsv41.cli:ACCOUNTING",
    "train": "dsv41.train.cli",
    "train-vision": "dsv41.train.vision",
    "train-dspark": "dsv41.train.dspark",
    "demo": "dsv41.demo",
    "generate": "dsv41.engine.cli",
    "serve": "dsv41.server.cli",
    "sft": "dsv41.posttrain.cli:SFT",
    "rl": "dsv41.posttrain.cli:RL",
    "opd": "dsv41.posttrain.cli:OPD",
    "merge": "dsv41.posttrain.cli:MERGE",
}


def register(name: str, target: str) -> None:
    """Add (or replace) a subcommand: `target` is "module" or "module:attribute"."""
    SUBCOMMANDS[name] = target


def _resolve(target: str) -> Subcommand:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    return getattr(obj, attr) if attr else obj


# ---------------------------------------------------------------------- shared arguments
def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--preset NAME | --config PATH` (mutually exclusive; default: the v41-flash preset)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", metavar="NAME",
                       help=f"a shipped preset: {', '.join(preset_names())} (default: v41-flash)")
    group.add_argument("--config", metavar="PATH", type=Path,
                       help="a flat preset-style JSON, a Hugging Face config.json, or a checkpoint directory")
    parser.add_argument("--max-layers", metavar="N", type=int,
                        help="cut the config to N of its layers at their real widths, keeping every layer role "
                             "(window, Full, Reuse, Reindex, Engram; v41-flash needs N >= 5)")


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    if args.config is not None:
        if not args.config.exists():
            raise ConfigError(f"config file '{args.config}' not found")
        config = load_config(args.config)
    else:
        name = args.preset or "v41-flash"
        if name not in preset_names():
            raise ConfigError(f"unknown preset '{name}' (presets: {', '.join(preset_names())})")
        config = load_config(name)
    max_layers = getattr(args, "max_layers", None)
    return config if max_layers is None else config.truncated(max_layers)


def _add(subparsers: Any, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(name, help=help, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


# ---------------------------------------------------------------------- plan
class _Plan:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = _add(subparsers, "plan", "print each layer's role (window / Full / Reindex / Reuse)",
                 "Print the layer plan derived from a config: encoder/decoder half, CSA2 mode, compression\n"
                 "ratio, where each layer reads its compressed KV and its top-k, candidate blocks, Engram\n"
                 "and RoPE flavour.",
                 "examples:\n  dsv41 plan --preset v41-flash\n"
                 "  dsv41 plan --config ./DeepSeek-V4.1-Flash/config.json\n"
                 "  python -m dsv41 plan --preset tiny --json")
        add_config_arguments(p)
        p.add_argument("--json", action="store_true", help="print the plan as JSON (one object per layer)")
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dataclasses import asdict

        from dsv41.plan import format_plan, layer_plan

        config = config_from_args(args)
        if args.json:
            print(json.dumps([asdict(p) for p in layer_plan(config)], indent=1))
        else:
            print(format_plan(config))
        return 0


# ---------------------------------------------------------------------- accounting
class _Accounting:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = _add(subparsers, "accounting", "parameters, active parameters, KV bytes and FLOPs of a config",
                 "Recompute the report's summary table from a config: backbone / Engram / DSpark / vision\n"
                 "parameters, active parameters per token in prefill and decode, KV-cache bytes per token\n"
                 "(and against DeepSeek-V4-Flash), decode and prefill FLOPs, and the checkpoint's bytes in the\n"
                 "release's format per component. For the v41-flash preset the report's figure is printed\n"
                 "beside ours. Definitions: docs/accounting.md, docs/checkpoint.md.",
                 "examples:\n  dsv41 accounting --preset v41-flash\n"
                 "  dsv41 accounting --preset small --json\n"
                 "  dsv41 accounting --preset v41-flash --max-layers 6   # what one GPU holds\n"
                 "  python -m dsv41 accounting --config ./config.json")
        add_config_arguments(p)
        p.add_argument("--json", action="store_true", help="print every figure as one JSON object")
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dsv41.accounting import compute, format_report

        config = config_from_args(args)
        print(json.dumps(compute(config), indent=1) if args.json else format_report(config))
        return 0


PLAN = _Plan()
ACCOUNTING = _Accounting()


# ---------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv41",
        description="DeepSeek-V4.1-Flash in PyTorch: inspect configs, train, serve.",
        epilog="examples:\n  dsv41 plan --preset v41-flash\n  dsv41 accounting --preset v41-flash\n"
               "  dsv41 accounting --config path/to/config.json --json\n\n"
               "run 'dsv41 COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, target in SUBCOMMANDS.items():
        command = _resolve(target)
        sub = command.add_parser(subparsers)
        sub.set_defaults(_run=command.run, _name=name)
    return parser


def _error(message: str) -> int:
    print(f"dsv41: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed by argparse)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return int(args._run(args) or 0)
    except ConfigError as e:
        return _error(str(e))
    except FileNotFoundError as e:
        return _error(f"{e.strerror}: '{e.filename}'")
    except BrokenPipeError:  # `dsv41 plan | head`
        sys.stderr.close()
        return 0
