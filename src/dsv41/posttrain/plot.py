"""Plots of a post-training run from its JSONL metrics and eval.json files (matplotlib, Agg backend).

`python -m dsv41.posttrain.plot RUN_DIR [--out DIR]` reads RUN_DIR/{sft,rl,opd}/ (whichever exist) and writes:
  effort.png       accuracy and mean reasoning length per effort level b, before SFT / after SFT / after RL / OPD
  rl_curves.png    RL reward, accuracy, off-policy ratio and rollout concurrency per step
It prints the same numbers as a table, so a run without a display still shows them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv41.posttrain.common import read_jsonl
from dsv41.train.plot import save_figure


def effort_table(run: Path) -> dict[str, dict[int, dict[str, float]]]:
    """label → effort → {accuracy, reasoning_tokens}: before (the SFT stage's 'before'), then each stage's 'after'."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for stage in ("sft", "rl", "rl_sync", "opd", "teacher"):
        f = run / stage / "eval.json"
        if not f.exists():
            continue
        data = json.loads(f.read_text())
        if stage == "sft" and data.get("before"):
            rows["shipped"] = {int(b): v for b, v in data["before"].items()}
        rows[stage] = {int(b): v for b, v in data["after"].items()}
    return rows


def plot(run: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    table = effort_table(run)
    if table:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for label, rows in table.items():
            bs = sorted(rows)
            axes[0].plot(bs, [rows[b]["accuracy"] for b in bs], marker="o", label=label)
            axes[1].plot(bs, [rows[b]["reasoning_tokens"] for b in bs], marker="o", label=label)
            print(label, " ".join(f"b={b}: acc {rows[b]['accuracy']:.3f} len {rows[b]['reasoning_tokens']:.1f}"
                                  for b in bs))
        axes[0].set(xlabel="reasoning effort b", ylabel="held-out accuracy")
        axes[1].set(xlabel="reasoning effort b", ylabel="mean reasoning tokens")
        axes[0].legend(fontsize=8)
        written.append(save_figure(fig, out / "effort.png", dpi=120))
    records = [r for r in read_jsonl(run / "rl" / "metrics.jsonl") if "reward" in r]
    if records:
        steps = [r["step"] for r in records]
        fig, axes = plt.subplots(1, 4, figsize=(14, 3))
        for ax, key in zip(axes, ("reward", "accuracy", "offpolicy_ratio", "in_flight")):
            ax.plot(steps, [r[key] for r in records])
            ax.set(xlabel="RL step", title=key)
        written.append(save_figure(fig, out / "rl_curves.png", dpi=120))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.posttrain.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not args.run.is_dir():
        print(f"dsv41: error: run directory '{args.run}' not found")
        return 2
    for f in plot(args.run, args.out or args.run / "plots"):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
