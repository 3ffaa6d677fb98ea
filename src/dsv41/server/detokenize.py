"""Incremental detokenization: sampled token ids → text deltas on three channels, tool calls, logprob entries.

Channels: "reasoning" (between <think> and </think>), "content", and — when the request offered tools — tool
calls, each between the chat template's tool-call markers (`train/tokenizer.py`: name, newline, arguments JSON).
Ids are decoded in runs that end on a complete character (a run whose text ends in U+FFFD waits for the next
token), so the deltas concatenate to the text of the whole output. Stop strings apply to the content channel:
the last `len(longest stop) - 1` characters are held back until they cannot start a match, and the text is cut
before the first match. `token_bytes` gives a token's raw UTF-8 bytes (OpenAI's logprob `bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.train.tokenizer import END_THINK, THINK, TOOL_CALL_BEGIN, TOOL_CALL_END


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for the 256 bytes) → byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str
    id: str = ""


@dataclass
class Delta:
    """What one `feed` / `finish` produced."""

    text: dict[str, str] = field(default_factory=dict)  # channel → new text
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed by this step


class TokenText:
    """Per-token strings and bytes for logprobs (raw BPE bytes; specials by their text)."""

    def __init__(self, tok):
        self.tok = tok
        self._bytes = _byte_decoder()
        self._special = {i for i in tok.special_ids.values()}

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        try:
            return bytes(self._bytes[c] for c in piece)
        except KeyError:
            return piece.encode()

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class TextStream:
    """One output's detokenizer. `feed(token)` → Delta; `finish()` → the rest (held-back text, an open call)."""

    def __init__(self, tok, stop: list[str], split_reasoning: bool, parse_tools: bool = False):
        self.tok, self.stop = tok, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.think_ids = (tok.special_ids[THINK], tok.special_ids[END_THINK]) if split_reasoning else (-1, -1)
        self.tool_ids = (tok.special_ids[TOOL_CALL_BEGIN], tok.special_ids[TOOL_CALL_END]) if parse_tools else (-1, -1)
        self.channel = "content"
        self.pending: dict[str, list[int]] = {"reasoning": [], "content": []}
        self.text = {"reasoning": "", "content": ""}
        self.sent = {"reasoning": 0, "content": 0}
        self.saw_reasoning = False
        self.stopped = False  # a stop string matched
        self.n_tokens = 0
        self.tool_calls: list[ToolCall] = []
        self._call: list[int] | None = None  # ids of an open tool call
        self.last_channel = "marker"

    # ------------------------------------------------------------------ feeding
    def feed(self, token: int) -> Delta:
        """Take one sampled token; returns the text (and tool calls) it made final. Which channel the token
        went to is `last_channel` ("reasoning", "content", "tool" or "marker")."""
        if self.stopped:
            self.last_channel = "marker"
            return Delta()
        self.n_tokens += 1
        calls: list[ToolCall] = []
        self.last_channel = "marker"
        if self._call is not None:
            if token == self.tool_ids[1]:
                calls.append(self._close_call())
            else:
                self._call.append(token)
                self.last_channel = "tool"
        elif token == self.tool_ids[0]:
            self._decode(self.channel, final=True)
            self._call = []
        elif token == self.think_ids[0]:
            self._decode(self.channel, final=True)
            self.channel, self.saw_reasoning = "reasoning", True
        elif token == self.think_ids[1]:
            self._decode(self.channel, final=True)
            self.channel = "content"
        else:
            self.pending[self.channel].append(token)
            self.last_channel = self.channel
            self._decode(self.channel, final=False)
        return Delta(self._deltas(final=False), calls)

    def finish(self) -> Delta:
        if self.stopped:
            return Delta()
        if self._call is not None:  # an unclosed call is not a call: its text is content
            self.pending["content"] += self._call
            self._call = None
        for ch in self.pending:
            self._decode(ch, final=True)
        return Delta(self._deltas(final=True))

    def _close_call(self) -> ToolCall:
        raw = self.tok.decode(self._call, skip_special=True)
        self._call = None
        name, _, arguments = raw.partition("\n")
        call = ToolCall(len(self.tool_calls), name.strip(), arguments.strip() or "{}")
        self.tool_calls.append(call)
        return call

    def _decode(self, ch: str, final: bool) -> None:
        ids = self.pending[ch]
        if ids:
            piece = self.tok.decode(ids, skip_special=True)
            if final or not piece.endswith("\ufffd"):
                self.text[ch] += piece
                ids.clear()

    def _deltas(self, final: bool) -> dict[str, str]:
        out = {}
        for ch in ("reasoning", "content"):
            text, limit = self.text[ch], len(self.text[ch])
            if ch == "content" and self.stop and not self.stopped:
                start = max(0, self.sent[ch] - self.hold)
                hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text[ch] = text = text[:min(hits)]
                    self.stopped, limit = True, len(text)
                elif not final:
                    limit = max(self.sent[ch], len(text) - self.hold)
            if limit > self.sent[ch]:
                out[ch] = text[self.sent[ch]:limit]
                self.sent[ch] = limit
        return out
