"""`dsv41 generate`: stream a completion for one prompt and print a one-line summary.

    dsv41 generate --checkpoint DIR --prompt "Once upon a time" --max-tokens 64
    dsv41 generate --preset tiny --random-init --prompt "hello"
    dsv41 generate --checkpoint models/dsv41-tiny-vl --image shoe.png --prompt ""      # caption an image
    dsv41 generate --checkpoint models/dsv41-tiny-vl --chat --image shoe.png --prompt "What is in this image?"

Images (`--image FILE`, repeatable, in order) go where the prompt says `<image>`, else right after <bos>
(with --chat: at the start of the user message); each becomes its span of image positions (SPEC §5).
--chat renders the prompt as one user message of the chat template, as the server does for
`/v1/chat/completions` (the same ids for the same text and images).

The summary line (stderr) reports prompt tokens, prefill milliseconds, decode tokens per second and
the measured global KV bytes per token of the sequence's cache.

--speculative dspark decodes speculatively with the checkpoint's DSpark drafter (docs/speculative.md;
an error when it has none); --speculative oracle drafts with a copy of the model itself (every greedy
draft is accepted: it exercises the mechanism, it is not faster). -v adds the acceptance statistics.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dsv41.config import ConfigError


def add_prefill_options(p: argparse.ArgumentParser) -> None:
    """The engine's prefill flags, shared by `generate` and `serve`."""
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill run while other requests decode (default: 128 with static prefill "
                        "from CUDA graphs, each run whole beside the streams; else 2048, in 4-layer pieces; "
                        "docs/engine.md)")
    p.add_argument("--static-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="run whole prefill chunks and the decoder replay from static steps at power-of-two shapes, "
                        "replayed from CUDA graphs (docs/engine.md; default: on with CUDA graphs)")
    p.add_argument("--idle-prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per chunk in a step without decoding streams (default on CUDA: "
                        "max(--prefill-chunk, 16384); 0: off; docs/engine.md)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="generate text from a prompt (encoder-only prefill, packed FP4/FP8 caches)",
        description="Generate a continuation of --prompt with the inference engine and stream it to stdout.\n"
                    "The last line (stderr) summarizes prompt tokens, prefill time, decode speed and KV bytes.",
        epilog="examples:\n  dsv41 generate --checkpoint models/small --prompt 'It is a truth' --max-tokens 40\n"
               "  dsv41 generate --preset tiny --random-init --prompt hello --temperature 0.8 --seed 1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path, metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", metavar="NAME", help="build a preset model (needs --random-init)")
    p.add_argument("--random-init", action="store_true", help="with --preset: random weights, no checkpoint")
    p.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="tokenizer.json (default: the checkpoint's, else the shipped one)")
    p.add_argument("--prompt", required=True, help="prompt text ('<image>' marks where each --image goes)")
    p.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                   help="an image file (PNG, JPEG, WEBP, GIF, BMP); repeat for several, in prompt order")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message of the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--exact-prefill", action="store_true", help="run every layer over every prompt token")
    add_prefill_options(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights and activations: auto (default) = bf16 on CUDA (the head, routers, "
                        "compressors, mHC coefficients and sinks stay fp32), fp32 elsewhere")
    p.add_argument("--speculative", choices=["off", "dspark", "oracle"], default="off",
                   help="speculative decoding: the checkpoint's DSpark drafter, or the model itself as an oracle "
                        "(a mechanism test); default off")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default: dspark_block_size - 1, or 4)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print speculative acceptance statistics")
    return p


def build_speculative(args: argparse.Namespace, model, max_batch: int) -> dict:
    """Engine keyword arguments for --speculative (empty when off); ConfigError when it cannot run."""
    kind = getattr(args, "speculative", "off")
    if kind == "off":
        return {}
    from dsv41.engine.speculative import SpeculativeError, build_drafter

    c = model.config
    k = args.draft_tokens if getattr(args, "draft_tokens", None) is not None else (
        c.dspark_block_size - 1 if c.dspark_block_size > 1 else 4)
    if not 1 <= k < c.window_size:
        raise ConfigError(f"--draft-tokens must be in 1..{c.window_size - 1}, got {k}")
    try:
        drafter = build_drafter(kind, model, checkpoint=getattr(args, "checkpoint", None), k=k,
                                max_sequences=max_batch)
    except SpeculativeError as e:
        raise ConfigError(str(e)) from None
    return {"drafter": drafter}


SHIPPED_MODEL = Path(__file__).resolve().parents[3] / "models" / "dsv41-small"  # the repo's trained model


def install_engram_map(model, tok) -> None:
    """Give the model's Engram hasher the tokenizer's compressed vocabulary (when the sizes agree)."""
    if model.hasher is None:
        return
    from dsv41.train.tokenizer import build_compressed_token_map

    lookup, size = build_compressed_token_map(tok)
    if model.config.engram_compressed_vocab_size in (0, size):
        model.set_engram_token_map(lookup, size)


def load_checkpoint_and_tokenizer(directory: Path, device: str = "cpu", tokenizer: Path | None = None):
    """(model in eval mode, tokenizer) of a checkpoint directory: its own tokenizer.json unless one is
    given, else the shipped one; Engram's token map installed; `model.weights_fingerprint` set (the
    SHA-256 of the weight files, cached beside them: dsv41.fingerprint). CheckpointError is a ConfigError."""
    from dsv41.checkpoint import load_checkpoint
    from dsv41.fingerprint import checkpoint_fingerprint

    model = load_checkpoint(directory, device=device)
    model.weights_fingerprint = checkpoint_fingerprint(directory)  # the prefix cache's key names these weights
    own = Path(directory) / "tokenizer.json"
    return model, _tokenizer_for(model, tokenizer or (own if own.exists() else None))


def _tokenizer_for(model, path: Path | None):
    from dsv41.train.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    path = path or DEFAULT_TOKENIZER
    if not Path(path).exists():
        raise ConfigError(f"tokenizer file '{path}' not found")
    tok = load_tokenizer(path)
    if tok.vocab_size > model.config.vocab_size:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                          f"{model.config.vocab_size}")
    install_engram_map(model, tok)
    model.eval()
    return tok


def load_model_and_tokenizer(args: argparse.Namespace):
    """(model, tokenizer) from --checkpoint or --preset --random-init; raises ConfigError on misuse."""
    import torch

    from dsv41.config import resolve_dtype
    from dsv41.engine.engine import cast_for_engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = resolve_dtype(getattr(args, "dtype", "auto"), device) == "bf16"
    if args.checkpoint is not None:
        model, tok = load_checkpoint_and_tokenizer(args.checkpoint, device, args.tokenizer)
    elif args.preset is not None and args.random_init:
        from dsv41 import load_config
        from dsv41.model.transformer import Transformer

        model = Transformer(load_config(args.preset)).init_weights(seed=0).to(device)
        tok = _tokenizer_for(model, args.tokenizer)
    else:
        raise ConfigError("give --checkpoint DIR, or --preset NAME with --random-init")
    return (cast_for_engine(model, torch.bfloat16) if bf16 else model), tok


IMAGE_TAG = "<image>"


def read_images(paths: list[Path], config) -> list:
    """The processor's inputs of image files; an unreadable or bad image is a ConfigError (exit 2)."""
    if not paths:
        return []
    from dsv41.image_processor import ImageError, decode_image

    if not config.vision_enabled:
        raise ConfigError("--image: this model has no vision encoder (vision_n_layers = 0)")
    out = []
    for path in paths:
        try:
            out.append(decode_image(Path(path).read_bytes(), config))
        except OSError as e:
            raise ConfigError(f"--image {path}: cannot read it ({e.strerror or e})") from None
        except ImageError as e:
            raise ConfigError(f"--image {path}: {e}") from None
    return out


def prompt_ids(tok, text: str, n_images: int, image_token_id: int, chat: bool = False) -> list[int]:
    """Prompt ids with one `image_token_id` placeholder per image: at each '<image>' of the text, else all at
    the start (after <bos>, or of the user message with `chat`)."""
    tags = text.count(IMAGE_TAG)
    if n_images and tags not in (0, n_images):
        raise ConfigError(f"the prompt has {tags} '{IMAGE_TAG}' marks for {n_images} --image files")
    if not n_images and not chat:
        return tok.encode(text, add_bos=True)
    import secrets

    from dsv41.image_processor import chat_ids_with_images
    from dsv41.train.tokenizer import BOS, chat_segments

    marker = f"\x00image-{secrets.token_hex(8)}\x00"
    body = text.replace(IMAGE_TAG, marker) if tags else marker * n_images + text
    segments = chat_segments([{"role": "user", "content": body}]) if chat else [(BOS, True), (body, False)]
    return chat_ids_with_images(tok, segments, image_token_id, marker)


def run(args: argparse.Namespace) -> int:
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    chunk, idle = args.prefill_chunk, args.idle_prefill_chunk
    if (chunk is not None and chunk < 1) or (idle is not None and idle < 0):
        raise ConfigError(f"--prefill-chunk must be >= 1 and --idle-prefill-chunk >= 0, got {args.prefill_chunk}, "
                          f"{args.idle_prefill_chunk}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model, tok = load_model_and_tokenizer(args)
    images = read_images(getattr(args, "image", []), model.config)
    prompt = prompt_ids(tok, args.prompt, len(images), model.config.image_token_id, getattr(args, "chat", False))
    if images:
        from dsv41.image_processor import expand_placeholders

        prompt = expand_placeholders(prompt, images, model.config.image_token_id)
    if len(prompt) > model.config.max_seq_len:
        raise ConfigError(f"prompt has {len(prompt)} tokens, more than the model's context {model.config.max_seq_len}")
    params.stop_token_ids = [tok.eos_id] + ([tok.end_turn_id] if getattr(args, "chat", False) else [])
    speculative = build_speculative(args, model, 1)  # one request: one row to profile and draft for
    options = dict(max_batch=1, **speculative) if speculative else {}
    engine = Engine(model, prefill_chunk=args.prefill_chunk, idle_prefill_chunk=args.idle_prefill_chunk,
                    static_prefill=args.static_prefill, **options)
    try:
        req = engine.add_request(prompt, params, exact_prefill=args.exact_prefill, images=images or None)
    except ValueError as e:  # images that do not fit the prompt
        raise ConfigError(str(e)) from None
    shown = ""
    t0 = time.perf_counter()
    while not req.finished:
        engine.step()
        text = tok.decode(req.output, skip_special=True)
        if not text.endswith("\ufffd"):  # wait for a multi-byte character to complete
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t0
    decode_tokens = max(len(req.output) - 1, 0)
    tps = decode_tokens / req.decode_s if req.decode_s > 0 else float("nan")
    print(f"[prompt {len(prompt)} tok | prefill {req.prefill_ms:.1f} ms | decode {tps:.1f} tok/s | "
          f"KV {req.cache.bytes_per_token():g} B/token | {len(req.output)} tok in {elapsed:.2f} s]", file=sys.stderr)
    if getattr(args, "verbose", False) and engine.stats.speculative is not None:
        print(f"[{engine.stats.speculative.summary()}]", file=sys.stderr)
    return 0
