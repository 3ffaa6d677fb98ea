"""`dsv41 sft`, `dsv41 rl`, `dsv41 opd`, `dsv41 merge`: the post-training stages as commands (docs/post-training.md).

Each stage reads a checkpoint directory (default: the shipped models/dsv41-small) or `--preset NAME` with
random weights (smoke runs), writes `--out` (a float checkpoint + tokenizer, metrics.jsonl, eval.json with
accuracy and mean reasoning length per effort level before and after) and finally `done.json`; rerunning a
stage whose `--out` has `done.json` prints its result and does nothing (resumable scripts). Bad input (a
missing directory, an unknown family, a bad number) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from dsv41.config import ConfigError

EFFORTS = (25, 50, 75, 100)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _common(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path,
                     help="start from this checkpoint directory (default: models/dsv41-small)")
    src.add_argument("--preset", help="start from a preset with random weights (smoke runs), e.g. tiny")
    src.add_argument("--config", type=Path, help="start from a preset-style JSON config with random weights "
                                                 "(e.g. a larger teacher trained from scratch)")
    p.add_argument("--out", type=Path, required=True, help="output directory (checkpoint, metrics.jsonl, eval.json)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16: training under bf16 autocast (fp32 master weights), rollouts and evaluation on a "
                        "bf16 copy; fp32: everything fp32; auto (default): bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--steps", type=_positive, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    p.add_argument("--families", default="add,mul,sort,copy", help="task families (comma-separated)")
    p.add_argument("--digits", default="2,4", help="digits per operand: N or LO,HI (difficulty)")
    p.add_argument("--efforts", type=_ints, default=EFFORTS, help="training / evaluation effort levels")
    p.add_argument("--eval-problems", type=int, default=64, help="held-out problems per effort level (0 = no eval)")
    p.add_argument("--max-tokens", type=_positive, default=96, help="reply tokens at most (sampling and eval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop training after this many seconds (0 = no limit; a whole step always finishes; "
                        "the evaluations are outside it)")


def _loop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts-per-step", type=_positive, default=8, help="prompt groups per optimizer step")
    p.add_argument("--samples-per-effort", type=_positive, default=2, help="M_b: samples per prompt and effort")
    p.add_argument("--dispatch", choices=("sample", "prompt", "batch"), default="sample",
                   help="rollout dispatch rule (batch = synchronous)")
    p.add_argument("--max-in-flight", type=_positive, default=128, help="cap on samples in flight")
    p.add_argument("--max-staleness", type=int, default=2, help="tokens older than this many versions get no loss")
    p.add_argument("--max-offpolicy", type=float, default=0.5, help="cap on a batch's off-policy token share")
    p.add_argument("--temperature", type=float, default=1.0)


def _setup(args: argparse.Namespace):
    import torch

    from dsv41.config import resolve_dtype
    from dsv41.posttrain.common import load_policy, resolve_device
    from dsv41.posttrain.tasks import FAMILIES, generate

    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise ConfigError(f"unknown task family {bad[0] if bad else '(none)'!r} (families: {', '.join(FAMILIES)})")
    try:
        lo_hi = [int(v) for v in str(args.digits).split(",")]
    except ValueError:
        raise ConfigError(f"--digits: expected N or LO,HI, got {args.digits!r}") from None
    if len(lo_hi) not in (1, 2) or min(lo_hi) < 1 or lo_hi[0] > lo_hi[-1]:
        raise ConfigError(f"--digits: expected N or LO,HI with 1 <= LO <= HI, got {args.digits!r}")
    if any(not 1 <= b <= 100 for b in args.efforts) or len(set(args.efforts)) != len(args.efforts):
        raise ConfigError(f"--efforts: distinct values in 1..100, got {args.efforts}")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if not args.max_seconds >= 0:
        raise ConfigError(f"--max-seconds must be >= 0, got {args.max_seconds}")
    digits = lo_hi[0] if len(lo_hi) == 1 else (lo_hi[0], lo_hi[1])
    device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, device)  # what later stages and eval_key see: "bf16" or "fp32"
    torch.manual_seed(args.seed)
    if args.config is not None and not args.config.is_file():
        raise ConfigError(f"config file '{args.config}' not found")
    model, tok = load_policy(args.checkpoint, args.config or args.preset, device, seed=args.seed)
    train = generate(families, 20_000, digits, seed=args.seed)
    held = generate(families, max(args.eval_problems, 0), digits, seed=10_000 + args.seed)  # other seed: held out
    held = [p for p in held if p not in set(train)] or held
    return model, tok, train, held


def _done(out: Path) -> dict | None:
    from dsv41.posttrain.common import DONE_FILE

    f = out / DONE_FILE
    if f.exists():
        print(f"{out}: already done ({DONE_FILE}); remove it to rerun")
        print(f.read_text())
        return json.loads(f.read_text())
    return None


def _evaluate(model, tok, held, args) -> dict[int, dict[str, float]]:
    from dsv41.posttrain.common import evaluate

    if not held:
        return {}
    return evaluate(model, tok, held, args.efforts, args.max_tokens, dtype=args.dtype)


def _eval_key(held, args) -> str:
    """What an evaluation depends on besides the weights: the held-out problems, the efforts, the token limit and
    the engine's dtype."""
    text = json.dumps([[p.question for p in held], sorted(args.efforts), args.max_tokens]
                      + ([args.dtype] if args.dtype != "fp32" else []))  # fp32 keys stay those of earlier runs
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _evaluate_checkpoint(model, tok, held, args, checkpoint: Path | None) -> dict[int, dict[str, float]]:
    """`_evaluate` of a model loaded from `checkpoint`, reusing the 'after' table of the stage that wrote it when
    that stage evaluated the same problems the same way (its eval.json's eval_key): the weights are the same, so
    the greedy replies are too, and a stage's 'before' costs nothing."""
    f = checkpoint / "eval.json" if checkpoint is not None else None
    if f is not None and f.is_file() and held:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("eval_key") == _eval_key(held, args) and data.get("after"):
            print(f"{checkpoint}: evaluation reused from its eval.json")
            return {int(b): v for b, v in data["after"].items()}
    return _evaluate(model, tok, held, args)


def _print_eval(name: str, table: dict) -> None:
    for b, row in sorted(table.items(), key=lambda kv: int(kv[0])):
        print(f"{name:>7s}  b={int(b):3d}  accuracy {row['accuracy']:.3f}  "
              f"reasoning tokens {row['reasoning_tokens']:.1f}  (n={row['n']})")


def _finish(args, model, tok, held: list, before: dict, extra: dict[str, Any]) -> int:
    from dsv41.posttrain.common import DONE_FILE, save_policy

    after = _evaluate(model, tok, held, args)
    save_policy(model, tok, args.out, metadata={"stage": args.command})
    result = {"stage": args.command, "before": before, "after": after,
              "eval_key": _eval_key(held, args) if held else None, **extra}
    (args.out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    _print_eval("before", before)
    _print_eval("after", after)
    (args.out / DONE_FILE).write_text(json.dumps(result) + "\n")
    return 0


# ---------------------------------------------------------------------- sft
class _SFT:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser("sft", help="supervised fine-tuning on generated tasks, effort-levelled reasoning",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="examples:\n  dsv41 sft --out runs/sft --steps 400\n"
                                         "  dsv41 sft --preset tiny --device cpu --steps 2 --out /tmp/sft")
        _common(p, steps=300, lr=1e-4)
        p.add_argument("--batch-size", type=_positive, default=32)
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dsv41.posttrain.common import Metrics
        from dsv41.posttrain.sft import SFTConfig, train_sft

        if _done(args.out):
            return 0
        model, tok, train, held = _setup(args)
        before = _evaluate(model, tok, held, args)
        cfg = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, efforts=args.efforts, seed=args.seed,
                        max_seconds=args.max_seconds, dtype=args.dtype)
        losses = train_sft(model, tok, train, cfg, Metrics(args.out / "metrics.jsonl"))
        return _finish(args, model, tok, held, before, {"final_loss": losses[-1], "steps": len(losses)})


# ---------------------------------------------------------------------- rl
class _RL:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser("rl", help="GRPO with the effort-length reward on asynchronous rollouts",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="examples:\n  dsv41 rl --checkpoint runs/sft --out runs/rl --steps 40\n"
                                         "  dsv41 rl --preset tiny --device cpu --steps 1 --out /tmp/rl")
        _common(p, steps=40, lr=2e-5)
        _loop_args(p)
        p.add_argument("--k0", type=float, default=0.5, help="length penalty at the lowest effort")
        p.add_argument("--lam", type=float, default=0.5, help="λ: τ = λ · mean gap of the effort levels")
        p.add_argument("--c-max", type=float, default=0.5, help="cap of the length penalty")
        p.add_argument("--l-norm", type=float, default=64.0, help="reasoning tokens that cost k(b)")
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dsv41.posttrain.common import Metrics
        from dsv41.posttrain.grpo import EffortReward
        from dsv41.posttrain.loop import AsyncLoop, grpo_step

        if _done(args.out):
            return 0
        try:
            reward = EffortReward(levels=tuple(sorted(args.efforts)), k0=args.k0, lam=args.lam, c_max=args.c_max,
                                  l_norm=args.l_norm)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model, tok, train, held = _setup(args)
        before = _evaluate_checkpoint(model, tok, held, args, args.checkpoint)
        cfg = _loop_config(args, reward=reward)
        loop = AsyncLoop(model, tok, train, cfg, Metrics(args.out / "metrics.jsonl"))
        records = loop.run(grpo_step(model, tok, cfg))
        loop.close()
        return _finish(args, model, tok, held, before, {"steps": len(records),
                                                  "stopped_at_max_seconds": "stopped_at_max_seconds" in loop.counters})


def _loop_config(args, **kw):
    from dsv41.posttrain.loop import LoopConfig

    if not 0 <= args.max_offpolicy <= 1 or args.max_staleness < 0:
        raise ConfigError("--max-offpolicy must be in [0, 1] and --max-staleness >= 0")
    return LoopConfig(steps=args.steps, prompts_per_step=args.prompts_per_step,
                      samples_per_effort=args.samples_per_effort, efforts=tuple(args.efforts),
                      max_tokens=args.max_tokens, temperature=args.temperature, lr=args.lr, dispatch=args.dispatch,
                      max_in_flight=args.max_in_flight, max_staleness=args.max_staleness,
                      max_offpolicy=args.max_offpolicy, seed=args.seed, max_seconds=args.max_seconds,
                      dtype=args.dtype, **kw)


# ---------------------------------------------------------------------- opd
class _OPD:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser("opd", help="on-policy distillation: reverse KL from teachers on own samples",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="examples:\n"
                                         "  dsv41 opd --checkpoint runs/sft --teacher runs/teacher --out runs/opd\n"
                                         "  dsv41 opd --checkpoint A --teacher T1 --teacher T2 --switch-at 10 --out O")
        _common(p, steps=40, lr=2e-5)
        _loop_args(p)
        p.add_argument("--teacher", type=Path, action="append", required=True,
                       help="a teacher checkpoint directory (repeat: t0, t1, ...; t0 is active first)")
        p.add_argument("--switch-at", type=int, default=0,
                       help="at this step switch every dataset to the next teacher (0 = never); in-flight samples stay")
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dsv41.posttrain.common import Metrics, load_policy
        from dsv41.posttrain.loop import AsyncLoop, opd_step
        from dsv41.posttrain.opd import Teachers

        if _done(args.out):
            return 0
        for t in args.teacher:
            if not t.is_dir():
                raise ConfigError(f"teacher checkpoint directory '{t}' not found")
        if args.switch_at and len(args.teacher) < 2:
            raise ConfigError("--switch-at needs at least two --teacher")
        model, tok, train, held = _setup(args)
        device = next(model.parameters()).device
        models = {f"t{i}": load_policy(t, None, device)[0] for i, t in enumerate(args.teacher)}
        teachers = Teachers(models, {"*": ["t0"]})
        teacher_eval = _evaluate_checkpoint(models["t0"], tok, held, args, args.teacher[0])
        before = _evaluate_checkpoint(model, tok, held, args, args.checkpoint)
        cfg = _loop_config(args)
        loop = AsyncLoop(model, tok, train, cfg, Metrics(args.out / "metrics.jsonl"))

        def on_step(step: int) -> None:
            if args.switch_at and step == args.switch_at:
                loop.config_version = teachers.switch({"*": ["t1"]})
                print(f"step {step}: teachers switched to t1 with {loop.rollouts.in_flight} samples in flight")

        records = loop.run(opd_step(model, tok, cfg, teachers), on_step)
        loop.close()
        _print_eval("teacher", teacher_eval)
        n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
        return _finish(args, model, tok, held, before, {"steps": len(records), "teacher": teacher_eval,
                                                  "stopped_at_max_seconds": "stopped_at_max_seconds" in loop.counters,
                                                  "teacher_params": n_params,
                                                  "student_params": sum(p.numel() for p in model.parameters())})


# ---------------------------------------------------------------------- merge
class _Merge:
    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser("merge", help="weighted average of checkpoints (to initialise the next run)",
                                  description="θ = Σ w_i θ_i / Σ w_i over checkpoints of one config.",
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="examples:\n  dsv41 merge runs/rl-a runs/rl-b --out runs/merged\n"
                                         "  dsv41 merge A B C --weights 2,1,1 --out runs/merged")
        p.add_argument("checkpoints", type=Path, nargs="+", help="checkpoint directories")
        p.add_argument("--weights", help="comma-separated weights, one per checkpoint (default: equal)")
        p.add_argument("--out", type=Path, required=True)
        return p

    def run(self, args: argparse.Namespace) -> int:
        from dsv41.posttrain.merge import merge_checkpoints

        weights = None
        if args.weights is not None:
            try:
                weights = [float(w) for w in args.weights.split(",")]
            except ValueError:
                raise ConfigError(f"--weights: expected comma-separated numbers, got {args.weights!r}") from None
        try:
            out = merge_checkpoints(args.checkpoints, weights, args.out)
        except ValueError as e:
            raise ConfigError(f"merge: {e}") from None
        print(f"merged {len(args.checkpoints)} checkpoints into {out}")
        return 0


SFT, RL, OPD, MERGE = _SFT(), _RL(), _OPD(), _Merge()
