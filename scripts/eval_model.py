"""Validation loss and sample generations of a checkpoint (what docs/model-card.md reports).

    python scripts/eval_model.py                                  # the shipped model, 32,768 val tokens
    python scripts/eval_model.py --checkpoint runs/small/latest --data .corpus/tok --tokens 0   # whole split

The validation split is read from `--data` (a corpus folder or a pre-tokenized one, as `dsv41 train`
takes); rows are packed with document masking exactly like the trainer's evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv41.engine.cli import SHIPPED_MODEL, load_checkpoint_and_tokenizer
from dsv41.engine.engine import Engine
from dsv41.train.data import load_corpus, val_batches

PROMPTS = ["It is a truth universally acknowledged, that", "Mr. President, Mr. Speaker, Members of the Congress:",
           "LAWYER, n.", "The meaning of the word", "def fibonacci(n):"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=SHIPPED_MODEL)
    ap.add_argument("--data", type=Path, default=Path(".corpus/tok"))
    ap.add_argument("--tokens", type=int, default=32768, help="validation tokens to score (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_checkpoint_and_tokenizer(args.checkpoint)
    out: dict = {"checkpoint": str(args.checkpoint)}
    if args.data.exists():
        val = load_corpus(args.data, tok, Path.home() / ".cache" / "dsv41" / "tokens", split="val")
        nll, n = 0.0, 0
        with torch.no_grad():
            for b in val_batches(val, 1024, 4):
                logits = model(b["tokens"], doc_ids=b["doc_ids"])
                ce = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), reduction="none")
                nll += float((ce * b["loss_mask"].flatten()).sum())
                n += int(b["loss_mask"].sum())
                if args.tokens and n >= args.tokens:
                    break
        out.update(val_loss=nll / n, val_tokens=n)
    engine = Engine(model)
    samples = {}
    for p in PROMPTS:
        ids = tok.encode(p, add_bos=True)
        greedy = engine.generate([ids], max_tokens=args.max_tokens, stop_token_ids=[tok.eos_id])[0]
        sampled = engine.generate([ids], max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1,
                                  stop_token_ids=[tok.eos_id])[0]
        samples[p] = {"greedy": tok.decode(greedy, skip_special=True),
                      "sampled (T=0.8, top-p 0.95, seed 1)": tok.decode(sampled, skip_special=True)}
    out["samples"] = samples
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
