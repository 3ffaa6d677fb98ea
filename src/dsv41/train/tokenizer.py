"""Byte-level BPE tokenizer, chat template, and the Engram compressed-token map.

The tokenizer is a `tokenizers` byte-level BPE (GPT-2 style byte alphabet, no normalizer), so every
string round-trips: `decode(encode(s)) == s`. Special tokens take the first ids, in this order:

    0 <bos>  1 <eos>  2 <pad>                       (pad = 2 is also the Engram pad id, SPEC §1a)
    3 <image>  4 <image_start>  5 <image_end>  6 <image_newline>      (vision placeholders, SPEC §5)
    7 <|system|>  8 <|user|>  9 <|assistant|>  10 <|end|>  11 <think>  12 </think>       (chat)
    13..16 <|reserved_0..3|>                       (room to add tokens without moving ids)

Chat format (`apply_chat_template`), turns concatenated without separators:

    <bos><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|><think>{reasoning}</think>{reply}<|end|>
    ...<|user|>{last user}<|end|><|system|>Reasoning Effort: {b} (range 1–100; ...)<|end|><|assistant|>

Tool calling (issue 17) uses three of the reserved ids, so no id moves: <|reserved_0|> opens a tool call,
<|reserved_1|> closes it, <|reserved_2|> is the `tool` role. A request's tools are a system turn right after
<bos> (stable across turns, so it stays in the cached prefix); an assistant turn's calls follow its text:

    <|system|># Tools ... {one JSON line per tool}<|end|>...
    <|assistant|>{content}<|reserved_0|>{name}\n{arguments JSON}<|reserved_1|>...<|end|><|reserved_2|>{result}<|end|>

The reasoning-effort line (SPEC §8) is a system turn placed immediately before the assistant turn it
governs, not inside the leading system prompt: changing the effort then changes only the tokens after
the last user message, and the cached prefix of the conversation (SPEC §6) still hits. A history
assistant message renders its own effort line only if it records `reasoning_effort`, so a client
that replays the history with the efforts it used gets a byte-exact extension of what was generated.

`build_compressed_token_map` canonicalizes token ids for Engram hashing (SPEC §1a, §5): tokens whose
text is the same after NFKC/NFD/strip-accents/lowercase/space-collapsing share one compressed id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
IMAGE, IMAGE_START, IMAGE_END, IMAGE_NEWLINE = "<image>", "<image_start>", "<image_end>", "<image_newline>"
SYSTEM, USER, ASSISTANT, END_TURN = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
THINK, END_THINK = "<think>", "</think>"
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(4))
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD, IMAGE, IMAGE_START, IMAGE_END, IMAGE_NEWLINE,
    SYSTEM, USER, ASSISTANT, END_TURN, THINK, END_THINK, *RESERVED,
)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2  # fixed: the model's Engram pad id is 2

TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_ROLE = RESERVED[0], RESERVED[1], RESERVED[2]
TOOL_MARKERS = (TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_ROLE)
TOOLS_HEADER = ("# Tools\nYou may call the functions below. A call is the function's name, a newline and its "
                "arguments as one JSON object, between the tool-call markers.\n")

EFFORT_LINE = "Reasoning Effort: {b} (range 1–100; higher values request more thorough reasoning)"
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL_ROLE}

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
DEFAULT_TOKENIZER = DATA_DIR / "tokenizer.json"


# ---------------------------------------------------------------------------------------------
# training / io


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 16384, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with SPECIAL_TOKENS at ids 0..16 and all 256 byte symbols in the vocab.

    Deterministic for a given input order: the BPE trainer picks merges by (count, pair) and
    serializes the vocabulary by id (checked by training twice in tests/train/test_tokenizer.py).
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json (pretty-printed, so the shipped file diffs well)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path), pretty=True)


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER) -> Tok:
    return Tok(Tokenizer.from_file(str(path)))


# ---------------------------------------------------------------------------------------------
# wrapper


class Tok:
    """Ids in, ids out. `encode` treats text literally unless `allow_special=True`, so a user string
    that contains "<eos>" cannot inject a control token; templates are encoded with allow_special."""

    def __init__(self, tokenizer: Tokenizer):
        for i, t in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(t) != i:
                raise ValueError(f"special token {t!r} must have id {i}, has {tokenizer.token_to_id(t)}")
        self.tokenizer = tokenizer  # parses special tokens in text
        self._literal = Tokenizer.from_str(tokenizer.to_str())  # encodes them as plain bytes
        self._literal.encode_special_tokens = True
        self.special_ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        self.image_id = self.special_ids[IMAGE]
        self.image_start_id = self.special_ids[IMAGE_START]
        self.image_end_id = self.special_ids[IMAGE_END]
        self.image_newline_id = self.special_ids[IMAGE_NEWLINE]
        self.end_turn_id = self.special_ids[END_TURN]

    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False,
               allow_special: bool = False) -> list[int]:
        enc = (self.tokenizer if allow_special else self._literal).encode(text, add_special_tokens=False)
        return [BOS_ID] * add_bos + enc.ids + [EOS_ID] * add_eos

    def encode_batch(self, texts: list[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """Literal encoding of many texts in parallel (the tokenizers thread pool)."""
        encs = self._literal.encode_batch_fast(texts, add_special_tokens=False)
        return [[BOS_ID] * add_bos + e.ids + [EOS_ID] * add_eos for e in encs]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str:
        return self.tokenizer.id_to_token(i)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    reasoning_effort: int | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of `apply_chat_template(...)`: the template's markers become control tokens,
        message text is encoded literally (a user typing "<|end|>" gets those characters). All pieces
        go through one batch call of each encoder, which releases the GIL (safe off the event loop)."""
        segments = chat_segments(messages, add_generation_prompt, reasoning_effort, tools)
        literal = [t for t, control in segments if not control]
        control = [t for t, c in segments if c]
        lit = iter(self._literal.encode_batch_fast(literal, add_special_tokens=False)) if literal else iter(())
        ctl = iter(self.tokenizer.encode_batch_fast(control, add_special_tokens=False)) if control else iter(())
        ids: list[int] = []
        for _, is_control in segments:
            ids += next(ctl if is_control else lit).ids
        return ids

    def save(self, path: str | Path) -> None:
        save(self.tokenizer, path)


# ---------------------------------------------------------------------------------------------
# chat template


def effort_turn(b: int) -> str:
    if not (isinstance(b, int) and 1 <= b <= 100):
        raise ValueError(f"reasoning effort must be an int in 1..100, got {b!r}")
    return SYSTEM + EFFORT_LINE.format(b=b) + END_TURN


def tools_text(tools: list[dict]) -> str:
    """The tools system turn's text: a header and one JSON line per function (name, description, parameters)."""
    lines = []
    for t in tools:
        fn = t.get("function", t)
        lines.append(json.dumps({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None},
                                ensure_ascii=False, sort_keys=True, separators=(",", ":")))
    return TOOLS_HEADER + "\n".join(lines)


def tool_call_text(call: dict) -> str:
    """One call inside its markers: name, newline, the arguments string as the client sent it back."""
    fn = call.get("function", call)
    return f"{fn['name']}\n{fn.get('arguments') or '{}'}"


def chat_segments(messages: list[dict], add_generation_prompt: bool = True,
                  reasoning_effort: int | None = None, tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """The chat template as (text, is_control) pieces: markers and effort lines are control text,
    message contents are user text. Concatenated, they are `apply_chat_template`'s string."""
    out: list[tuple[str, bool]] = [(BOS, True)]
    if tools:
        out += [(SYSTEM, True), (tools_text(tools), False), (END_TURN, True)]
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown role {role!r}")
        if role == "assistant":
            if m.get("reasoning_effort") is not None:
                out.append((effort_turn(m["reasoning_effort"]), True))
            out.append((ASSISTANT, True))
            thinking = m.get("reasoning_content")
            if thinking is not None:
                out += [(THINK, True), (thinking, False), (END_THINK, True)]
        else:
            out.append((ROLE_TOKENS[role], True))
        out.append((content, False))
        for call in (m.get("tool_calls") or []) if role == "assistant" else []:
            out += [(TOOL_CALL_BEGIN, True), (tool_call_text(call), False), (TOOL_CALL_END, True)]
        out.append((END_TURN, True))
    if add_generation_prompt:
        if reasoning_effort is not None:
            out.append((effort_turn(reasoning_effort), True))
        out.append((ASSISTANT, True))
    return [(text, control) for text, control in out if text]


def chat_boundary_ids(tok: Tok | None = None) -> tuple[int, ...]:
    """Token ids the prefix cache cuts units around: the end-of-turn marker and the role markers. A unit then
    ends after every message (so the history before the reasoning-effort line is one) and after the
    generation prompt's <|assistant|>; `tok` is accepted for symmetry (the ids are fixed)."""
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return tuple(ids[t] for t in (END_TURN, SYSTEM, USER, ASSISTANT, *TOOL_MARKERS))


def apply_chat_template(messages: list[dict], add_generation_prompt: bool = True,
                        reasoning_effort: int | None = None, tools: list[dict] | None = None) -> str:
    """Render messages ({"role": system|user|assistant|tool, "content": str, optional "reasoning_content"
    and, for assistant turns, "reasoning_effort" and "tool_calls"}) to the string format in the module
    docstring."""
    return "".join(text for text, _ in chat_segments(messages, add_generation_prompt, reasoning_effort, tools))


# ---------------------------------------------------------------------------------------------
# Engram tokenizer compression

_SPACE_SENTINEL = "\ue000"  # private use: keeps a lone space alive through Strip


def engram_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex("[ \t\r\n]+"), " "),
        normalizers.Replace(Regex("^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def build_compressed_token_map(tok: Tok) -> tuple[list[int], int]:
    """lookup[token id] = compressed id, and the compressed vocabulary size.

    Each id is decoded alone. A partial UTF-8 byte token (decodes to U+FFFD) is keyed by its raw
    token string; anything else by its normalized text (raw text if normalization empties it).
    Compressed ids are assigned in first-seen order over ids 0..V-1, so the map is deterministic.
    """
    norm = engram_normalizer()
    keys: dict[str, int] = {}
    lookup = []
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


def main(argv: list[str] | None = None) -> None:
    """Retrain the shipped tokenizer: `python -m dsv41.train.tokenizer` (same input -> same file)."""
    import argparse

    from dsv41.train.data import load_texts

    p = argparse.ArgumentParser(description="train the byte-level BPE tokenizer on a corpus folder")
    p.add_argument("--data", type=Path, default=DATA_DIR / "sample", help="folder of .jsonl / .txt")
    p.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER)
    p.add_argument("--vocab-size", type=int, default=16384)
    args = p.parse_args(argv)
    texts = load_texts(args.data, "all")
    save(train_tokenizer(texts, args.vocab_size), args.out)
    print(f"{len(texts)} documents -> {args.out} ({args.vocab_size} tokens)")


if __name__ == "__main__":
    main()
