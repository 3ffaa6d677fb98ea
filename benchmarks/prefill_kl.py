"""How far is encoder-only prefill (with decoder bounded replay) from exact prefill?

For prompts longer than the window, encoder-only prefill runs the decoder on the last n_win prompt
tokens only, so the first generated token's distribution differs from exact prefill (every layer
over every token) by design. This measures the mean KL(exact ‖ encoder-only) of that distribution
over random prompts, for the `tiny` preset with random weights and for the shipped trained model
on real text, plus how often the greedy first token agrees.

    python benchmarks/prefill_kl.py [--prompts 20]
Writes benchmarks/results/prefill_kl-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch

from dsv41 import load_config
from dsv41.engine.cache import SequenceCache
from dsv41.engine.cli import SHIPPED_MODEL, load_checkpoint_and_tokenizer
from dsv41.engine.prefill import prefill
from dsv41.engine.runner import Runner
from dsv41.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]


def kl_stats(model: Transformer, prompts: list[list[int]]) -> dict:
    runner = Runner(model.eval())
    kls, agree = [], 0
    for ids in prompts:
        exact = prefill(runner, SequenceCache(model.config), ids, chunk=512, exact=True)
        fast = prefill(runner, SequenceCache(model.config), ids, chunk=512)
        p = exact.log_softmax(-1)
        kls.append(float(torch.sum(p.exp() * (p - fast.log_softmax(-1)))))
        agree += int(exact.argmax() == fast.argmax())
    return dict(prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], mean_kl=sum(kls) / len(kls),
                max_kl=max(kls), greedy_agreement=agree / len(prompts), kls=kls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    results = {}

    tiny = Transformer(load_config("tiny").replace(qat=True)).init_weights(seed=0)
    W = tiny.config.window_size
    prompts = [torch.randint(17, tiny.config.vocab_size, (int(torch.randint(2 * W, 8 * W, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.prompts)]
    results["tiny_random_weights"] = kl_stats(tiny, prompts)
    print(f"tiny (random weights): mean KL {results['tiny_random_weights']['mean_kl']:.4g}, "
          f"greedy agreement {results['tiny_random_weights']['greedy_agreement']:.0%}", flush=True)

    if (SHIPPED_MODEL / "config.json").exists():
        model, tok = load_checkpoint_and_tokenizer(SHIPPED_MODEL)
        texts = [json.loads(line)["text"] for line in (ROOT / "data" / "sample" / "sotu.jsonl").open()]
        W = model.config.window_size
        prompts = []
        for text in texts[:args.prompts]:
            ids = tok.encode(text, add_bos=True)
            n = int(torch.randint(2 * W, 6 * W, (1,), generator=g))
            prompts.append(ids[:n])
        results["shipped_small_real_text"] = kl_stats(model, prompts)
        print(f"shipped small (real text): mean KL {results['shipped_small_real_text']['mean_kl']:.4g}, "
              f"greedy agreement {results['shipped_small_real_text']['greedy_agreement']:.0%}", flush=True)
    out = dict(benchmark="prefill_kl", date=dt.date.today().isoformat(), device="cpu", torch=torch.__version__,
               metric="KL(exact prefill || encoder-only prefill) of the first-token distribution, nats",
               **results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefill_kl-{out['date']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
