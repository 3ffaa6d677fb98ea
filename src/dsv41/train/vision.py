"""ViT training, SPEC §5 / §7: SigLIP, then captioning on a small MoE LM, then LM pretraining with images.

    dsv41 train-vision siglip   --data DIR --out runs/vl          # stage 1: ViT + a small text tower
    dsv41 train-vision caption  --data DIR --out runs/vl          # stage 2: the ViT on a small MoE LM
    dsv41 train-vision pretrain --data DIR --out runs/vl          # LM pretraining, ViT frozen until LR decay

Stages (each reads the previous one's output under the same --out):
1. `siglip`: the ViT with a mean-pooled linear head and a small text tower (token + position
   embeddings, a few bidirectional transformer layers, mean pool, linear) trained with SigLIP's
   sigmoid loss, −Σ_ij log σ(z_ij (t·⟨x_i, y_j⟩ + b)), t = exp(t′), z_ij = +1 for a pair whose
   names agree (several Fashion-MNIST images share a class: they are positives, not negatives).
   Evaluated zero-shot: Fashion-MNIST test accuracy against the class prompts, emoji test-split
   image → text recall@5 against all held-out names. Writes `siglip/vision.safetensors`.
2. `caption`: the ViT (from stage 1), the aligner and a fresh MoE LM (the preset) trained
   autoregressively on `<bos> [image span] caption <eos>` documents packed into rows (loss on the
   caption only); a quarter are chat-formatted. The LM is then dropped: `caption/vision.safetensors`
   keeps the ViT, the aligner and the span embeddings.
3. `pretrain`: a fresh LM with that vision side, trained on text rows and packed image-caption rows in
   the token ratio `text_ratio` : 1 (7 : 1); the ViT is frozen until the learning-rate decay starts,
   its last norm and the projector always train. Writes a compact checkpoint `pretrain/model/` (the
   shipped format) with the tokenizer.

Optimizer groups are SPEC §7's (`optim.build_optimizer`: Muon for the ViT matrices and the projector,
AdamW for norms / biases, Sinkhorn for the LM's embedding and head); stage 1's text tower, logit scale
and bias take AdamW. Each stage writes `metrics.jsonl` (train / eval records) and `curves.png`.
Options are `--key=value` over `VisionTrainConfig`; a bad key or value is one ConfigError line (exit 2).
"""

from __future__ import annotations

import json
import math
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.config import ConfigError, ModelConfig, load_config
from dsv41.image_processor import from_pixels
from dsv41.model.moe import update_moe_biases
from dsv41.model.transformer import Transformer
from dsv41.model.vision import ViT, encode_images
from dsv41.optim import LRSchedule, build_optimizer
from dsv41.train.plot import save_figure
from dsv41.train.tokenizer import ASSISTANT, BOS_ID, DEFAULT_TOKENIZER, END_TURN, EOS_ID, PAD_ID, USER, load_tokenizer

STAGES = ("siglip", "caption", "pretrain")
FASHION_TEMPLATES = ("{}", "a {}", "a photo of a {}", "a picture of a {}")
EMOJI_TEMPLATES = ("{}", "an emoji of {}", "{} emoji")
CHAT_QUESTION = "What is in this image?"


@dataclass
class VisionTrainConfig:
    preset: str = "tiny-vl"  # model preset (its vision_* fields size the ViT)
    data: str = str(Path.home() / ".cache" / "dsv41" / "vision")  # shards of scripts/build_vision_corpus.py
    text_data: str = str(Path(__file__).resolve().parents[3] / "data" / "sample")  # LM text (stage 3)
    tokenizer: str = str(DEFAULT_TOKENIZER)
    out: str = "runs/vision"  # run folder: one subfolder per stage
    steps: int = 600
    batch_size: int = 128  # images per step (siglip, caption) / rows per step (pretrain)
    seq_len: int = 64  # packed row length (caption, pretrain)
    lr: float = 2e-3  # peak learning rate (Muon's updates have RMS 0.18, so AdamW's scale carries over)
    lr_final: float = 2e-4
    warmup: float = 0.05  # fraction of the steps
    text_ratio: float = 7.0  # pretrain: text tokens per multimodal token
    chat_fraction: float = 0.25  # caption documents in the chat format
    mix: str = "fashion:0.5,emoji:0.25,openclipart:0.25"  # stage-1 image sources and their weights
    caption_mix: str = "fashion:0.7,emoji:0.3"  # stage 2 / 3 caption sources
    text_width: int = 128  # stage-1 text tower
    text_layers: int = 2
    embed_dim: int = 128  # stage-1 joint embedding width
    eval_every: int = 100
    eval_images: int = 2000  # Fashion-MNIST test images per evaluation (siglip: all at the end)
    seed: int = 0
    threads: int = 0  # > 0: torch.set_num_threads
    time_budget_s: float = 0.0  # > 0: stop the loop after this many seconds (then evaluate and save as usual)
    keep_lm: bool = False  # caption: also save the whole captioner (LM included) as a compact checkpoint
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_images"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train-vision option '{name}': must be positive, got {getattr(self, name)}")
        if not 0 <= self.warmup <= 1 or not 0 <= self.chat_fraction <= 1 or self.text_ratio < 0:
            raise ConfigError("train-vision options: warmup and chat_fraction lie in [0, 1], text_ratio >= 0")
        parse_mix(self.mix)
        parse_mix(self.caption_mix)

    def model_config(self) -> ModelConfig:
        c = load_config(self.preset)
        if not c.vision_enabled:
            raise ConfigError(f"train-vision option 'preset': {self.preset} has no vision (vision_n_layers = 0)")
        return c


def parse_mix(text: str) -> dict[str, float]:
    try:
        out = {k.strip(): float(v) for k, v in (part.split(":") for part in text.split(",") if part.strip())}
    except ValueError:
        raise ConfigError(f"train-vision option 'mix': expected source:weight,..., got {text!r}") from None
    if not out or any(w < 0 for w in out.values()) or sum(out.values()) <= 0:
        raise ConfigError(f"train-vision option 'mix': needs positive weights, got {text!r}")
    return out


def config_from_overrides(overrides: dict[str, str | None]) -> VisionTrainConfig:
    from dsv41.train.trainer import _convert  # the trainer's typed --key=value parsing

    hints = typing.get_type_hints(VisionTrainConfig)
    values = asdict(VisionTrainConfig())
    for key, raw in overrides.items():
        if key not in hints:
            raise ConfigError(f"train-vision option '{key}': unknown key (see 'dsv41 train-vision --help')")
        values[key] = _convert(key, raw, hints[key])
    return VisionTrainConfig(**values)


# ---------------------------------------------------------------------- data
@dataclass
class ImageSet:
    """One (source, split) shard: uint8 pixels (N, H, W[, 3]) and one metadata record per image."""

    source: str
    pixels: np.ndarray
    meta: list[dict]

    def __len__(self) -> int:
        return len(self.meta)


def load_shard(folder: str | Path, source: str, split: str) -> ImageSet:
    folder = Path(folder)
    npz, jsonl = folder / f"{source}-{split}.npz", folder / f"{source}-{split}.jsonl"
    if not npz.exists() or not jsonl.exists():
        raise ConfigError(f"{npz}: missing (build the shards with scripts/build_vision_corpus.py)")
    with np.load(npz, allow_pickle=False) as z:
        pixels = z["pixels"]
    meta = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if len(meta) != len(pixels):
        raise ConfigError(f"{jsonl}: {len(meta)} records for {len(pixels)} images")
    return ImageSet(source, pixels, meta)


def caption(source: str, record: dict, rng: np.random.Generator | None = None) -> str:
    """A training caption (a random template when rng is given; the bare name otherwise)."""
    templates = {"fashion": FASHION_TEMPLATES, "emoji": EMOJI_TEMPLATES}.get(source, ("{}",))
    name = record["name"] if source in ("fashion", "emoji") else record["caption"]
    return (templates[int(rng.integers(len(templates)))] if rng is not None else "{}").format(name)


def image_inputs(pixels: list[np.ndarray], config: ModelConfig) -> tuple[list[Tensor], list[tuple[int, int]]]:
    """Processor path of raw pixels: (patches per image, patch grids)."""
    ims = [from_pixels(p, config) for p in pixels]
    return [im.patches for im in ims], [im.grid for im in ims]


def sample_batch(sets: dict[str, ImageSet], weights: dict[str, float], n: int,
                 rng: np.random.Generator) -> list[tuple[str, int]]:
    """n (source, index) pairs: sources drawn by weight, images uniformly within a source."""
    names = [s for s in weights if s in sets]
    p = np.array([weights[s] for s in names])
    picks = rng.choice(len(names), size=n, p=p / p.sum())
    return [(names[k], int(rng.integers(len(sets[names[k]])))) for k in picks]


# ---------------------------------------------------------------------- stage 1 towers
class TextTower(nn.Module):
    """Token + position embeddings → bidirectional pre-norm transformer layers → mean pool → linear."""

    def __init__(self, vocab: int, width: int, layers: int, out_dim: int, max_len: int = 32):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, max(1, width // 32), 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out_dim, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        """ids (B, L) padded with PAD_ID → (B, out_dim) unit vectors."""
        ids = ids[:, :self.max_len]
        valid = ids != PAD_ID  # (B, L)
        x = self.embed(ids) + self.pos[:ids.shape[1]]
        x = self.norm(self.layers(x, src_key_padding_mask=~valid))
        pooled = (x * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)  # (B, width)
        return F.normalize(self.proj(pooled), dim=-1)


class SigLIP(nn.Module):
    """The ViT (`vision.*`, the release's names) with a pooled head, a text tower, SigLIP's t and b."""

    def __init__(self, config: ModelConfig, vocab: int, tc: VisionTrainConfig):
        super().__init__()
        self.vision = ViT(config)
        self.image_proj = nn.Linear(config.vision_dim, tc.embed_dim, bias=False)
        self.text = TextTower(vocab, tc.text_width, tc.text_layers, tc.embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))  # SigLIP's init: t = 10, b = −10
        self.logit_bias = nn.Parameter(torch.tensor(-10.0))

    def encode_image(self, patches: list[Tensor], grids: list[tuple[int, int]]) -> Tensor:
        n = max(p.shape[0] for p in patches)
        batch = torch.stack([F.pad(p, (0, 0, 0, n - p.shape[0])) for p in patches])  # (B, n, 3·p²)
        feats = self.vision(batch, grids)  # (B, n, D)
        counts = torch.tensor([h * w for h, w in grids], device=feats.device)
        valid = (torch.arange(n, device=feats.device) < counts[:, None]).float()  # (B, n)
        pooled = (feats * valid[..., None]).sum(1) / counts[:, None]
        return F.normalize(self.image_proj(pooled), dim=-1)

    def loss(self, img: Tensor, txt: Tensor, positive: Tensor) -> Tensor:
        logits = img @ txt.T * self.logit_scale.exp() + self.logit_bias  # (B, B)
        sign = positive.float() * 2 - 1
        return -F.logsigmoid(sign * logits).sum() / img.shape[0]


def tokenize_texts(tok, texts: list[str], max_len: int = 32) -> Tensor:
    ids = [tok.encode(t)[:max_len] or [PAD_ID] for t in texts]
    out = torch.full((len(ids), max(map(len, ids))), PAD_ID, dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, :len(row)] = torch.tensor(row)
    return out


@torch.no_grad()
def zero_shot(model: SigLIP, tok, config: ModelConfig, fashion: ImageSet | None, emoji: ImageSet | None,
              n_fashion: int | None = None, batch: int = 500) -> dict[str, float]:
    """Zero-shot Fashion-MNIST accuracy (class prompts averaged over templates) and emoji image → text
    recall@5 over all held-out names; chance levels beside them."""
    model.eval()
    out: dict[str, float] = {}
    if fashion is not None:
        names = sorted({m["name"]: m["label"] for m in fashion.meta}.items(), key=lambda kv: kv[1])
        prompts = [t.format(n) for n, _ in names for t in FASHION_TEMPLATES]
        txt = model.text(tokenize_texts(tok, prompts)).view(len(names), len(FASHION_TEMPLATES), -1).mean(1)
        txt = F.normalize(txt, dim=-1)
        n = min(n_fashion or len(fashion), len(fashion))
        correct = 0
        for i in range(0, n, batch):
            img = model.encode_image(*image_inputs(list(fashion.pixels[i:i + batch][:n - i]), config))
            labels = torch.tensor([m["label"] for m in fashion.meta[i:i + img.shape[0]]])
            correct += int(((img @ txt.T).argmax(1) == labels).sum())
        out |= {"fashion_zero_shot_acc": correct / n, "fashion_n": n, "fashion_chance": 1 / len(names)}
    if emoji is not None:
        txt = model.text(tokenize_texts(tok, [m["name"] for m in emoji.meta]))
        img = model.encode_image(*image_inputs(list(emoji.pixels), config))
        rank = (img @ txt.T).argsort(dim=1, descending=True)[:, :5]  # (N, 5)
        hits = (rank == torch.arange(len(emoji))[:, None]).any(1).float().mean().item()
        out |= {"emoji_recall_at_5": hits, "emoji_n": len(emoji), "emoji_chance_at_5": 5 / len(emoji)}
    model.train()
    return out


# ---------------------------------------------------------------------- captioning documents
def caption_doc(tok, n_positions: int, text: str, chat: bool, image_token_id: int) -> tuple[list[int], list[bool]]:
    """(tokens, is_target) of one image-caption document; targets = the caption and its end marker."""
    span = [image_token_id] * n_positions
    body = tok.encode(text)
    if chat:
        head = [BOS_ID] + tok.encode(USER, allow_special=True) + span + tok.encode(CHAT_QUESTION) + \
            tok.encode(END_TURN + ASSISTANT, allow_special=True)
        tail = body + tok.encode(END_TURN, allow_special=True)
    else:
        head, tail = [BOS_ID] + span, body + [EOS_ID]
    return head + tail, [False] * len(head) + [True] * len(tail)


def pack_rows(docs: list[tuple[list[int], list[bool], Any]], seq_len: int) -> list[dict]:
    """Greedy packing of documents (tokens, is_target, image) into rows of seq_len + 1 tokens, each
    with doc ids and the images in order; a document longer than a row is dropped."""
    rows, cur = [], {"tokens": [], "doc": [], "target": [], "images": []}
    for tokens, target, image in docs:
        if len(tokens) > seq_len + 1:
            continue
        if len(cur["tokens"]) + len(tokens) > seq_len + 1:
            rows.append(cur)
            cur = {"tokens": [], "doc": [], "target": [], "images": []}
        k = len(cur["images"]) + 1
        cur["tokens"] += tokens
        cur["doc"] += [k] * len(tokens)
        cur["target"] += target
        cur["images"].append(image)
    if cur["tokens"]:
        rows.append(cur)
    return rows


def collate_rows(rows: list[dict], seq_len: int, image_token_id: int) -> dict[str, Any]:
    """Rows → tensors (B, T): tokens, targets, doc_ids, loss_mask (targets inside a document that are
    caption tokens), image_mask; plus the images in row-major order."""
    B, T = len(rows), seq_len + 1
    tokens = torch.full((B, T), PAD_ID, dtype=torch.long)
    docs = torch.zeros(B, T, dtype=torch.long)
    target = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["tokens"])
        tokens[i, :n], docs[i, :n] = torch.tensor(r["tokens"]), torch.tensor(r["doc"])
        target[i, :n] = torch.tensor(r["target"])
    same = (docs[:, :-1] == docs[:, 1:]) & (docs[:, :-1] != 0)
    images = [im for r in rows for im in r["images"] if im is not None]
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "doc_ids": docs[:, :-1],
            "loss_mask": same & target[:, 1:], "image_mask": tokens[:, :-1] == image_token_id, "images": images}


def caption_batch(sets: dict[str, ImageSet], weights: dict[str, float], n_images: int, tok, config: ModelConfig,
                  tc: VisionTrainConfig, rng: np.random.Generator) -> dict[str, Any]:
    picks = sample_batch(sets, weights, n_images, rng)
    docs = []
    for source, i in picks:
        im = from_pixels(sets[source].pixels[i], config)
        chat = bool(rng.random() < tc.chat_fraction)
        toks, tgt = caption_doc(tok, im.n_positions, caption(source, sets[source].meta[i], rng), chat,
                                config.image_token_id)
        docs.append((toks, tgt, im))
    return collate_rows(pack_rows(docs, tc.seq_len), tc.seq_len, config.image_token_id)


def forward_losses(model: Transformer, batch: dict[str, Any]):
    embeds = None
    if batch["images"]:
        spans = encode_images(model, [im.patches for im in batch["images"]], [im.grid for im in batch["images"]])
        embeds = torch.cat(spans)  # (M, dim), row-major = the order of the images in the rows
    return model.losses(batch["tokens"], batch["targets"], batch["doc_ids"], batch["loss_mask"],
                        image_mask=batch["image_mask"], image_embeds=embeds, token_mask=batch["doc_ids"] != 0)


@torch.no_grad()
def greedy_captions(model: Transformer, tok, images: list, max_new: int = 8, with_image: bool = True,
                    batch: int = 250) -> list[str]:
    """Greedy continuations of `<bos> [image span]` (or `<bos>` alone) until <eos>, full forward per
    token (short sequences; the engine is the serving path)."""
    model.eval()
    c = model.config
    texts = []
    for lo in range(0, len(images), batch):
        ims = images[lo:lo + batch]
        prompts = [[BOS_ID] + ([c.image_token_id] * im.n_positions if with_image else []) for im in ims]
        embeds = torch.cat(encode_images(model, [im.patches for im in ims], [im.grid for im in ims])) \
            if with_image else None
        L = max(map(len, prompts))
        outs = [[] for _ in ims]
        done = torch.zeros(len(ims), dtype=torch.bool)
        seqs = torch.tensor([p + [PAD_ID] * (L - len(p)) for p in prompts])  # all prompts have the same length
        for _ in range(max_new):
            mask = seqs == c.image_token_id
            logits = model(seqs, image_mask=mask if with_image else None, image_embeds=embeds)[:, -1]
            nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t in (EOS_ID, tok.end_turn_id):
                        done[i] = True
                    else:
                        outs[i].append(t)
            if bool(done.all()):
                break
            seqs = torch.cat([seqs, nxt[:, None]], 1)
        texts += [tok.decode(o, skip_special=True).strip() for o in outs]
    model.train()
    return texts


def match_class(text: str, names: list[str]) -> str | None:
    """The class whose name the caption starts with (longest name first: 't-shirt' before 'shirt')."""
    text = text.lower().strip()
    for prefix in ("a photo of a ", "a picture of a ", "a "):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    for name in sorted(names, key=len, reverse=True):
        if text.startswith(name):
            return name
    return None


def caption_eval(model: Transformer, tok, fashion: ImageSet, n: int, with_image: bool = True) -> dict[str, float]:
    config = model.config
    ims = [from_pixels(p, config) for p in fashion.pixels[:n]]
    texts = greedy_captions(model, tok, ims, with_image=with_image)
    names = sorted({m["name"] for m in fashion.meta})
    hits = sum(match_class(t, names) == m["name"] for t, m in zip(texts, fashion.meta))
    return {"caption_match": hits / len(ims), "caption_n": len(ims), "samples": texts[:5]}


# ---------------------------------------------------------------------- the loop
class _Run:
    """One stage's folder, metrics.jsonl, progress bar and schedule."""

    def __init__(self, tc: VisionTrainConfig, stage: str):
        self.tc, self.stage = tc, stage
        self.dir = Path(tc.out) / stage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self.dir / "metrics.jsonl"
        self.metrics.write_text("")
        self.schedule = LRSchedule(tc.lr, tc.lr_final, tc.warmup * tc.steps, 28 / 45 * tc.steps, 40 / 45 * tc.steps)
        self.t0 = time.time()
        self.log({"type": "start", "stage": stage, "config": asdict(tc)})
        self.bar = None
        if tc.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=tc.steps, desc=f"train-vision {stage}", dynamic_ncols=True)

    def over_budget(self) -> bool:
        return self.tc.time_budget_s > 0 and time.time() - self.t0 > self.tc.time_budget_s

    def log(self, record: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps({**record, "time_s": round(time.time() - self.t0, 2)}) + "\n")

    def step(self, step: int, optimizer, **values: float) -> float:
        lr = self.schedule.apply(optimizer, step, step)
        self.log({"type": "train", "stage": self.stage, "step": step, "lr": lr, **values})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in values.items() if isinstance(v, float)})
        return lr

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        plot_stage(self.metrics, self.dir / "curves.png", self.stage)


def _sets(tc: VisionTrainConfig, sources: dict[str, float], split: str) -> dict[str, ImageSet]:
    folder = Path(tc.data)
    found = {s: load_shard(folder, s, split) for s in sources if (folder / f"{s}-{split}.npz").exists()}
    if not found:
        raise ConfigError(f"train-vision: no shards of {', '.join(sources)} in {folder} (run "
                          f"scripts/build_vision_corpus.py)")
    return found


def _optimizer(module: nn.Module, tc: VisionTrainConfig, extra: list[nn.Parameter] | None = None):
    opt = build_optimizer(module, tc.lr)
    if extra:
        opt.optimizers["extra_adamw"] = torch.optim.AdamW([{"params": extra, "lr_mult": 0.5}], lr=tc.lr * 0.5,
                                                          betas=(0.9, 0.95), weight_decay=0.0)
    return opt


def train_siglip(tc: VisionTrainConfig) -> dict[str, float]:
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    config, tok = tc.model_config(), load_tokenizer(tc.tokenizer)
    weights = parse_mix(tc.mix)
    train, test = _sets(tc, weights, "train"), _sets(tc, weights, "test")
    model = SigLIP(config, tok.vocab_size, tc)
    vision_only = nn.Module()
    vision_only.vision = model.vision  # the ViT under its release names: SPEC §7 groups
    vision_only.projector = model.image_proj  # a projector: Muon
    extra = [p for n, p in model.named_parameters() if not n.startswith(("vision.", "image_proj."))]
    opt = _optimizer(vision_only, tc, extra)
    run = _Run(tc, "siglip")
    for step in range(1, tc.steps + 1):
        picks = sample_batch(train, weights, tc.batch_size, rng)
        pixels = [train[s].pixels[i] for s, i in picks]
        names = [f"{s}:{train[s].meta[i]['name'] if s != 'openclipart' else train[s].meta[i]['caption']}"
                 for s, i in picks]
        texts = [caption(s, train[s].meta[i], rng) for s, i in picks]
        img = model.encode_image(*image_inputs(pixels, config))
        txt = model.text(tokenize_texts(tok, texts))
        positive = torch.tensor([[a == b for b in names] for a in names])
        loss = model.loss(img, txt, positive)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.step(step, opt, loss=loss.item(), t=model.logit_scale.exp().item())
        opt.step()
        if step % tc.eval_every == 0 or step == tc.steps:
            n = None if step == tc.steps else tc.eval_images
            ev = zero_shot(model, tok, config, test.get("fashion"), test.get("emoji"), n)
            run.log({"type": "eval", "stage": "siglip", "step": step, **ev})
    run.close()
    save_vision(run.dir / "vision.safetensors", {f"vision.{k}": v for k, v in model.vision.state_dict().items()},
                {"stage": "siglip", "model_config": config.to_json()})
    save_vision(run.dir / "towers.safetensors", model.state_dict(), {"stage": "siglip"})
    return ev


def save_vision(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    from dsv41.checkpoint import save_state_dict_file

    save_state_dict_file({k: v.detach().float() for k, v in tensors.items()}, path, metadata)


def load_into(model: nn.Module, path: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Copy the tensors of `path` whose names start with `prefixes` into `model` (same names)."""
    from dsv41.checkpoint import load_state_dict_file

    if not path.exists():
        raise ConfigError(f"{path}: missing (run the previous train-vision stage with the same --out)")
    state = {k: v for k, v in load_state_dict_file(path).items() if k.startswith(prefixes)}
    missing = model.load_state_dict(state, strict=False).unexpected_keys
    if missing:
        raise ConfigError(f"{path}: tensors the model does not have: {missing[:3]}")
    return sorted(state)


def train_caption(tc: VisionTrainConfig) -> dict[str, float]:
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed + 1)
    config, tok = tc.model_config(), load_tokenizer(tc.tokenizer)
    weights = parse_mix(tc.caption_mix)
    train, test = _sets(tc, weights, "train"), _sets(tc, {"fashion": 1.0}, "test")
    model = Transformer(config).init_weights(seed=tc.seed).train()
    load_into(model, Path(tc.out) / "siglip" / "vision.safetensors", ("vision.",))
    from dsv41.engine.cli import install_engram_map

    install_engram_map(model, tok)  # the map a loaded checkpoint gets: train with the same hashing
    opt = _optimizer(model, tc)
    run = _Run(tc, "caption")
    for step in range(1, tc.steps + 1):
        last = step == tc.steps or run.over_budget()
        batch = caption_batch(train, weights, tc.batch_size, tok, config, tc, rng)
        losses = forward_losses(model, batch)
        opt.zero_grad()
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.step(step, opt, loss=float(losses.lm.detach()))
        opt.step()
        update_moe_biases(model)  # text → bias, image tokens → bias_vl, each from its own load
        if step % tc.eval_every == 0 or last:
            ev = caption_eval(model, tok, test["fashion"], min(tc.eval_images, len(test["fashion"])))
            if last:
                blind = caption_eval(model, tok, test["fashion"], ev["caption_n"], with_image=False)
                ev |= {"text_only_match": blind["caption_match"], "text_only_samples": blind["samples"][:2],
                       "chance": 1 / len({m["name"] for m in test["fashion"].meta})}
            run.log({"type": "eval", "stage": "caption", "step": step, **ev})
        if last:
            break
    run.close()
    keep = {k: v for k, v in model.state_dict().items() if k.startswith(("vision.", "aligner.", "image_"))}
    save_vision(run.dir / "vision.safetensors", keep, {"stage": "caption", "model_config": config.to_json()})
    if tc.keep_lm:
        from dsv41.checkpoint import save_checkpoint

        save_checkpoint(model.eval(), run.dir / "model", fmt="compact",
                        extra_files={"tokenizer.json": Path(tc.tokenizer).read_text()},
                        metadata={"trained_by": "dsv41 train-vision caption", "steps": step})
    return ev


def set_vit_trainable(model: Transformer, trainable: bool) -> None:
    """Freeze / unfreeze the ViT; its last norm always trains (SPEC §5); the aligner is not touched."""
    for name, p in model.vision.named_parameters():
        p.requires_grad_(trainable or name.startswith("norm."))


def train_pretrain(tc: VisionTrainConfig) -> dict[str, float]:
    from dsv41.checkpoint import save_checkpoint
    from dsv41.train.data import PackedDataset, load_corpus

    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed + 2)
    config, tok = tc.model_config(), load_tokenizer(tc.tokenizer)
    weights = parse_mix(tc.caption_mix)
    train, test = _sets(tc, weights, "train"), _sets(tc, {"fashion": 1.0}, "test")
    model = Transformer(config).init_weights(seed=tc.seed + 7).train()
    load_into(model, Path(tc.out) / "caption" / "vision.safetensors", ("vision.", "aligner.", "image_"))
    from dsv41.engine.cli import install_engram_map

    install_engram_map(model, tok)
    opt = _optimizer(model, tc)  # every parameter has a group; a frozen one simply gets no gradient
    text = PackedDataset(load_corpus(tc.text_data, tok, Path.home() / ".cache" / "dsv41" / "tokens"), tc.seq_len,
                         seed=tc.seed).batches(max(1, round(tc.batch_size * tc.text_ratio / (tc.text_ratio + 1))))
    mm_rows = max(1, tc.batch_size - round(tc.batch_size * tc.text_ratio / (tc.text_ratio + 1)))
    run = _Run(tc, "pretrain")
    frozen = None
    for step in range(1, tc.steps + 1):
        decaying = step > run.schedule.constant_until_tokens
        if frozen is not decaying:  # the ViT trains once the learning rate decays
            set_vit_trainable(model, decaying)
            frozen = decaying
            run.log({"type": "phase", "stage": "pretrain", "step": step, "vit_trainable": decaying})
        tb = next(text)
        mm = _mm_rows(train, weights, mm_rows, tok, config, tc, rng)
        batch = {k: torch.cat([tb[k], mm[k]]) for k in ("tokens", "targets", "doc_ids", "loss_mask")}
        batch["image_mask"] = torch.cat([torch.zeros_like(tb["tokens"], dtype=torch.bool), mm["image_mask"]])
        batch["images"] = mm["images"]
        losses = forward_losses(model, batch)
        opt.zero_grad()
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        n_text, n_mm = int(tb["loss_mask"].sum()), int(mm["loss_mask"].sum())
        run.step(step, opt, loss=float(losses.lm.detach()), text_targets=n_text,
                 mm_tokens=int(mm["doc_ids"].ne(0).sum()))
        opt.step()
        update_moe_biases(model)
        if step % tc.eval_every == 0 or step == tc.steps:
            n = min(tc.eval_images, len(test["fashion"]))
            ev = caption_eval(model, tok, test["fashion"], n)
            blind = caption_eval(model, tok, test["fashion"], n, with_image=False)  # the text-only baseline
            ev |= {"text_only_match": blind["caption_match"], "text_only_samples": blind["samples"][:2],
                   "chance": 1 / len({m["name"] for m in test["fashion"].meta})}
            run.log({"type": "eval", "stage": "pretrain", "step": step, **ev, "mm_targets": n_mm})
    run.close()
    save_checkpoint(model.eval(), run.dir / "model", fmt="compact",
                    extra_files={"tokenizer.json": Path(tc.tokenizer).read_text()},
                    metadata={"trained_by": "dsv41 train-vision pretrain", "steps": tc.steps})
    return ev


def _mm_rows(sets, weights, n_rows: int, tok, config: ModelConfig, tc: VisionTrainConfig, rng) -> dict[str, Any]:
    """Exactly n_rows packed image-caption rows (documents drawn until the rows are full)."""
    rows: list[dict] = []
    while len(rows) < n_rows:
        picks = sample_batch(sets, weights, 4 * n_rows * max(1, tc.seq_len // 16), rng)
        docs = []
        for source, i in picks:
            im = from_pixels(sets[source].pixels[i], config)
            toks, tgt = caption_doc(tok, im.n_positions, caption(source, sets[source].meta[i], rng),
                                    bool(rng.random() < tc.chat_fraction), config.image_token_id)
            docs.append((toks, tgt, im))
        rows += pack_rows(docs, tc.seq_len)[:-1]  # the last row may be short: drawn again
    return collate_rows(rows[:n_rows], tc.seq_len, config.image_token_id)


def plot_stage(metrics: Path, out_png: Path, stage: str) -> Path:
    """Loss (train) and the stage's evaluation numbers against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("SigLIP loss" if stage == "siglip" else "LM loss (nats / target token)")
    shown = ("fashion_zero_shot_acc", "emoji_recall_at_5", "caption_match", "text_only_match")
    keys = [k for k in shown if evals and k in evals[0]]
    for k in keys:
        b.plot([r["step"] for r in evals], [r[k] for r in evals], "o-", ms=3, label=k)
    for k, style in (("fashion_chance", ":"), ("emoji_chance_at_5", "--"), ("chance", ":")):
        if evals and k in evals[0]:
            b.axhline(evals[0][k], ls=style, color="gray", lw=0.8, label=k)
    b.set_xlabel("step")
    b.set_ylim(0, 1)
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle(f"train-vision {stage}")
    return save_figure(fig, out_png)


def run_stage(stage: str, tc: VisionTrainConfig) -> dict[str, float]:
    if stage not in STAGES:
        raise ConfigError(f"train-vision: unknown stage {stage!r} (stages: {', '.join(STAGES)})")
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    return {"siglip": train_siglip, "caption": train_caption, "pretrain": train_pretrain}[stage](tc)


__all__ = ["STAGES", "VisionTrainConfig", "config_from_overrides", "run_stage", "caption_doc", "pack_rows",
           "collate_rows", "match_class", "greedy_captions", "SigLIP", "TextTower", "set_vit_trainable"]


# ---------------------------------------------------------------------- `dsv41 train-vision`
def add_parser(subparsers: Any):
    import argparse

    p = subparsers.add_parser(
        "train-vision", help="train the ViT: SigLIP, captioning on a small MoE LM, LM pretraining with images",
        description=__doc__.split("\n\n")[0] + "\n\nOptions are --key=value over VisionTrainConfig:\n" + "\n".join(
            f"  --{f.name}={f.default!r}" for f in dataclasses_fields(VisionTrainConfig)),
        epilog="examples:\n  dsv41 train-vision siglip --steps=300 --out=runs/vl\n"
               "  dsv41 train-vision caption --steps=80 --batch_size=64 --keep_lm=true --out=runs/vl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES + ("all",), help="stage to run ('all' runs the three in order)")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--key=value options")
    return p


def dataclasses_fields(cls):
    import dataclasses

    return dataclasses.fields(cls)


def run(args) -> int:
    from dsv41.train.trainer import split_overrides

    tc = config_from_overrides(split_overrides(args.overrides))
    for stage in STAGES if args.stage == "all" else (args.stage,):
        result = run_stage(stage, tc)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k != "samples"}
        print(f"{stage}: {json.dumps(shown)} -> {Path(tc.out) / stage}")
    return 0
