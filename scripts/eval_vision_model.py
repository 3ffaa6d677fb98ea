"""Caption-match rate of a shipped vision-language checkpoint on held-out Fashion-MNIST (the model card's numbers).

    python scripts/eval_vision_model.py --checkpoint models/dsv41-tiny-vl --n 1000

Greedy captions of `<bos> [image span]` (full forward per token, `train.vision.greedy_captions`) on the first n
test images of the shards of `scripts/build_vision_corpus.py`, matched to a class name by prefix; the same model
prompted without the image (`<bos>` only) is the text-only baseline; chance = 1 / classes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsv41.engine.cli import load_checkpoint_and_tokenizer
from dsv41.train.vision import caption_eval, load_shard


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path.home() / ".cache" / "dsv41" / "vision")
    ap.add_argument("--n", type=int, default=1000, help="test images (the first n of the official test split)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", type=Path, default=None, help="also draw the three rates as bars (PNG)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint_and_tokenizer(args.checkpoint)
    test = load_shard(args.data, "fashion", "test")
    n = min(args.n, len(test))
    with_image = caption_eval(model, tok, test, n)
    blind = caption_eval(model, tok, test, n, with_image=False)
    classes = len({m["name"] for m in test.meta})
    result = {"checkpoint": str(args.checkpoint), "n": n, "caption_match": with_image["caption_match"],
              "text_only_match": blind["caption_match"], "chance": 1 / classes,
              "samples": with_image["samples"], "text_only_samples": blind["samples"][:2]}
    print(json.dumps(result))
    if args.plot is not None:
        plot(result, args.plot)
    return 0


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["with the image", "text only (no image)", "chance (1 / 10)"]
    values = [result["caption_match"], result["text_only_match"], result["chance"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    bars = ax.bar(labels, values, color=["tab:blue", "tab:orange", "tab:gray"])
    ax.bar_label(bars, labels=[f"{v:.1%}" for v in values])
    ax.set_ylim(0, 1)
    ax.set_ylabel("caption names the true class")
    ax.set_title(f"{Path(result['checkpoint']).name}: held-out Fashion-MNIST, n = {result['n']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
