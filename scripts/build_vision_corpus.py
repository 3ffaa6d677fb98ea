"""Build image-text shards from installed packages (offline): Fashion-MNIST, Google's emoji, Open Clip Art.

    apt-get install -y dataset-fashion-mnist openclipart-png
    npm pack emoji-datasource-google@16.0.0 && tar xzf emoji-datasource-google-16.0.0.tgz   # → ./package
    python scripts/build_vision_corpus.py --emoji package --out ~/.cache/dsv41/vision
    python scripts/build_vision_corpus.py --emoji package --eval-sample data/vision-eval   # the shipped sample

Sources (licences in docs/data.md):
  fashion     Debian `dataset-fashion-mnist` (/usr/share/datasets/fashion-mnist): 70,000 28×28 grey images,
              the official train / test split, captioned with their class name (Zalando's labels).
  emoji       npm `emoji-datasource-google` 16.0.0: the 64×64 Noto PNGs with their Unicode names and
              categories (skin-tone variants left out); a hash of the code point puts ~10 % in `test`.
  openclipart Debian `openclipart-png` (/usr/share/openclipart/png): public-domain clip art, captioned
              "<category>: <title words>" from the folder and file name; ~10 % in `test` by a hash of the path.

Each (source, split) becomes `<source>-<split>.npz` (`pixels`: uint8 (N, H, W) grey or (N, H, W, 3) RGB, and
`label` int64; written without pickling) and `<source>-<split>.jsonl` (one record per image, same order:
caption, name, category, label), plus `manifest.json` (counts, sizes, file hashes). Emoji and clip art
are composited on grey 127 and letterboxed to 56 × 56 (the training size); Fashion-MNIST keeps 28 × 28 (the
image processor scales it up to `vision_min_pixels`). A missing source is skipped with a note.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CLIPART_DIR = Path("/usr/share/openclipart/png")
FASHION_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle boot")  # Zalando's label names, in label order
SIZE = 56  # side of the stored emoji / clip-art images
GREY = (127, 127, 127)
TEST_PERCENT = 10


def _held_out(key: str) -> bool:
    """Deterministic ~10 % test split from a stable key."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < TEST_PERCENT


def _idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): big-endian dims after a 4-byte magic."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion() -> dict[str, tuple[np.ndarray, list[dict]]]:
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = _idx(FASHION_DIR / f"{prefix}-images-idx3-ubyte.gz")  # (N, 28, 28)
        labels = _idx(FASHION_DIR / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        meta = [{"caption": FASHION_CLASSES[y], "name": FASHION_CLASSES[y], "category": "clothing", "label": int(y)}
                for y in labels]
        out[split] = (images.copy(), meta)
    return out


def _letterbox(image) -> np.ndarray:
    """RGB(A) PIL image → uint8 (SIZE, SIZE, 3): composited on grey, fitted inside, centred."""
    from PIL import Image, ImageOps

    rgba = image.convert("RGBA")
    canvas = Image.new("RGBA", rgba.size, GREY + (255,))
    rgb = Image.alpha_composite(canvas, rgba).convert("RGB")
    return np.asarray(ImageOps.pad(rgb, (SIZE, SIZE), color=GREY), dtype=np.uint8)


def emoji(root: Path) -> dict[str, tuple[np.ndarray, list[dict]]]:
    from PIL import Image

    records = json.loads((root / "emoji.json").read_text())
    categories = sorted({r["category"] for r in records})
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    for r in sorted(records, key=lambda r: r["sort_order"]):
        path = root / "img" / "google" / "64" / r["image"]
        if not r.get("has_img_google") or not r.get("name") or not path.exists():
            continue
        name = r["name"].lower()
        split = "test" if _held_out(r["unified"]) else "train"
        with Image.open(path) as im:
            parts[split][0].append(_letterbox(im))
        parts[split][1].append({"caption": name, "name": name, "category": r["category"].lower(),
                                "label": categories.index(r["category"]), "unified": r["unified"]})
    return {s: (np.stack(px), meta) for s, (px, meta) in parts.items() if px}


def _title(path: Path) -> str:
    words = re.sub(r"[_\-]+", " ", path.stem)
    words = re.sub(r"\b\d+\b", " ", words)
    return " ".join(words.split()).lower()


def clipart(root: Path) -> dict[str, tuple[np.ndarray, list[dict]]]:
    from PIL import Image

    files = sorted(p for p in root.rglob("*.png") if p.relative_to(root).parts[0] not in ("special", "unsorted"))
    categories = sorted({p.relative_to(root).parts[0] for p in files})
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    for p in files:
        rel = p.relative_to(root)
        where = " ".join(w.replace("_", " ") for w in rel.parts[:-1])
        title = _title(p)
        try:
            with Image.open(p) as im:
                if im.width * im.height > 25_000_000:  # a few posters are 15,000 px wide: not worth decoding
                    raise OSError(f"{im.width}x{im.height} is too large")
                px = _letterbox(im)
        except (OSError, Image.DecompressionBombError) as e:
            print(f"  skipping {rel}: {e}", file=sys.stderr)
            continue
        split = "test" if _held_out(str(rel)) else "train"
        parts[split][0].append(px)
        parts[split][1].append({"caption": f"{where}: {title}", "name": title, "category": rel.parts[0],
                                "label": categories.index(rel.parts[0]), "path": str(rel)})
    return {s: (np.stack(px), meta) for s, (px, meta) in parts.items() if px}


def write_shard(out: Path, source: str, split: str, pixels: np.ndarray, meta: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    npz, jsonl = out / f"{source}-{split}.npz", out / f"{source}-{split}.jsonl"
    np.savez_compressed(npz, pixels=pixels, label=np.array([m["label"] for m in meta], dtype=np.int64))
    jsonl.write_text("".join(json.dumps(m, ensure_ascii=False) + "\n" for m in meta))
    return {"images": len(meta), "shape": list(pixels.shape[1:]),
            "sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in (npz, jsonl)}}


def sample(shards: dict[str, tuple[np.ndarray, list[dict]]], n: int, seed: int = 0) -> tuple[np.ndarray, list[dict]]:
    """A fixed subset of a split (the shipped held-out evaluation sample)."""
    pixels, meta = shards["test"]
    keep = np.sort(np.random.default_rng(seed).permutation(len(meta))[:n])
    return pixels[keep], [meta[i] for i in keep]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "dsv41" / "vision", help="shard folder")
    ap.add_argument("--emoji", type=Path, default=None, help="unpacked emoji-datasource-google package folder")
    ap.add_argument("--clipart", type=Path, default=CLIPART_DIR, help="openclipart-png's png folder")
    ap.add_argument("--eval-sample", type=Path, default=None,
                    help="write only a small held-out sample here (500 Fashion-MNIST test images, emoji test split)")
    args = ap.parse_args(argv)

    builders = {"fashion": (fashion, FASHION_DIR.exists(), "apt-get install -y dataset-fashion-mnist")}
    builders["emoji"] = (lambda: emoji(args.emoji), args.emoji is not None and (args.emoji / "emoji.json").exists(),
                         "npm pack emoji-datasource-google@16.0.0 && tar xzf the .tgz, then --emoji package")
    if args.eval_sample is None:
        builders["openclipart"] = (lambda: clipart(args.clipart), args.clipart.exists(),
                                   "apt-get install -y openclipart-png")
    manifest: dict = {"sources": {}, "size": SIZE, "test_percent": TEST_PERCENT}
    target = args.eval_sample or args.out
    for source, (build, available, how) in builders.items():
        if not available:
            print(f"{source}: not installed, skipped ({how})", file=sys.stderr)
            continue
        shards = build()
        if args.eval_sample is not None:
            n = 500 if source == "fashion" else len(shards["test"][1])
            shards = {"test": sample(shards, n)}
        manifest["sources"][source] = {split: write_shard(target, source, split, px, meta)
                                       for split, (px, meta) in shards.items()}
        counts = ", ".join(f"{s} {v['images']}" for s, v in manifest["sources"][source].items())
        print(f"{source}: {counts} -> {target}")
    if not manifest["sources"]:
        print("no source is installed; nothing written", file=sys.stderr)
        return 2
    (target / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
