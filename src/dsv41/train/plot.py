"""Training curves from out/metrics.jsonl → one PNG (matplotlib, Agg backend: no display needed).

Three panels against tokens (log x): train and validation loss (with the bigram baseline as a
horizontal line when logged), learning rate, and throughput in tokens/s.
"""

from __future__ import annotations

import json
from pathlib import Path


def save_figure(fig, out_png: str | Path, dpi: int = 110) -> Path:
    """tight_layout, create the folder, write the PNG, close the figure (its memory): the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    plt.close(fig)
    return out_png


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(ln) for ln in Path(metrics_jsonl).read_text().splitlines() if ln.strip()]
    train = [r for r in records if r.get("type") == "train" and r["tokens"] > 0]
    evals = [r for r in records if r.get("type") == "eval" and r["tokens"] > 0]
    baseline = [r for r in records if r.get("type") == "baseline"]

    fig, (ax_loss, ax_lr, ax_speed) = plt.subplots(3, 1, figsize=(8, 10), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 1, 1]})
    if train:
        x = [r["tokens"] for r in train]
        ax_loss.plot(x, [r["loss"] for r in train], lw=1, label="train (LM)")
        ax_lr.plot(x, [r["lr"] for r in train], lw=1, color="C2")
        ax_speed.plot(x, [r["tokens_per_s"] for r in train], lw=1, color="C3")
    if evals:
        ax_loss.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="validation")
    for r in baseline:
        ax_loss.axhline(r["bigram_val_loss"], ls="--", color="gray", lw=1,
                        label=f"bigram baseline ({r['bigram_val_loss']:.2f})")
    ax_loss.set_ylabel("loss (nats / token)")
    ax_loss.legend()
    ax_lr.set_ylabel("learning rate")
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_xlabel("tokens")
    for ax in (ax_loss, ax_lr, ax_speed):
        ax.grid(alpha=0.3)
        if train or evals:
            ax.set_xscale("log")
    fig.suptitle(title or str(Path(metrics_jsonl).parent))
    return save_figure(fig, out_png, dpi=120)
