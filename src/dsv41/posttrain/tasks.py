"""Generated verifiable tasks for post-training: problems, worked reasoning at four detail levels, exact verifiers.

Key idea: every problem is drawn from a seeded generator with a tunable difficulty (`digits`), has one
exact answer, and a worked solution whose detail follows the requested reasoning effort b (SPEC §8):
level 0 (b < 38) answers at once, level 3 (b ≥ 88) writes every intermediate step. SFT on these traces
teaches the format and the effort line's meaning; RL (`grpo.py`) then trades length for accuracy.

Families (digits are space-separated so the byte-level BPE gives one token per digit):
  add   "add 4 5 7 + 8 9"        → "5 4 6"      (n-digit + n-digit)
  mul   "mul 4 5 7 * 8"          → "3 6 5 6"    (n-digit × 1-digit)
  sort  "sort 3 1 2 1"           → "1 1 2 3"    (n digits)
  copy  "copy 4 0 9"             → "4 0 9 # 3"  (the digits, then their sum mod 10)

Format (the chat template of `train/tokenizer.py`): the prompt is a user turn, the effort line and
`<|assistant|>`; the reply is `<think>{reasoning}</think>{answer}<|end|>`. `verify` reads the text
after the first `</think>` up to `<|end|>` and compares it with the answer, whitespace-normalized.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dsv41.train.tokenizer import END_THINK, END_TURN, SPECIAL_TOKENS, Tok

FAMILIES = ("add", "mul", "sort", "copy")
END_TURN_ID = SPECIAL_TOKENS.index(END_TURN)
END_THINK_ID = SPECIAL_TOKENS.index(END_THINK)


@dataclass(frozen=True)
class Problem:
    family: str  # one of FAMILIES; also the dataset name for per-dataset caps and teachers
    question: str  # the user turn's text
    answer: str  # the exact answer (space-separated digits)
    digits: tuple[int, ...]  # the operands' digits, most significant first (reasoning is built from them)
    operand: tuple[int, ...] = ()  # the second operand (add: its digits; mul: the one digit)


def effort_level(b: int) -> int:
    """Detail level 0..3 of the worked solution for effort b in 1..100 (thresholds between 25/50/75/100)."""
    if not 1 <= b <= 100:
        raise ValueError(f"reasoning effort must be in 1..100, got {b}")
    return 0 if b < 38 else 1 if b < 63 else 2 if b < 88 else 3


def _spaced(ds) -> str:
    return " ".join(str(d) for d in ds)


def _number(ds) -> int:
    return int("".join(str(d) for d in ds)) if ds else 0


def _digits(n: int) -> tuple[int, ...]:
    return tuple(int(c) for c in str(n))


def make_problem(family: str, digits: int, rng: random.Random) -> Problem:
    """One problem of `family` with `digits` digits per operand (the difficulty knob, ≥ 1)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r} (families: {', '.join(FAMILIES)})")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    first = tuple([rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(digits - 1)])
    if family == "add":
        second = tuple([rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(digits - 1)])
        return Problem(family, f"add {_spaced(first)} + {_spaced(second)}",
                       _spaced(_digits(_number(first) + _number(second))), first, second)
    if family == "mul":
        m = rng.randint(2, 9)
        return Problem(family, f"mul {_spaced(first)} * {m}", _spaced(_digits(_number(first) * m)), first, (m,))
    if family == "sort":
        ds = tuple(rng.randint(0, 9) for _ in range(digits))
        return Problem(family, f"sort {_spaced(ds)}", _spaced(sorted(ds)), ds)
    ds = tuple(rng.randint(0, 9) for _ in range(digits))
    return Problem(family, f"copy {_spaced(ds)}", f"{_spaced(ds)} # {sum(ds) % 10}", ds)


def reasoning(p: Problem, level: int) -> str:
    """The worked solution at detail `level` (0 = none); each level's text contains the facts of the one below."""
    if level <= 0:
        return ""
    steps: list[str] = []
    if p.family in ("add", "mul"):
        a = list(reversed(p.digits))  # least significant first: columns in the order they are done
        b = list(reversed(p.operand)) if p.family == "add" else []
        carry = 0
        for i, x in enumerate(a):
            y = b[i] if i < len(b) else 0
            total = x + y + carry if p.family == "add" else x * p.operand[0] + carry
            op = f"{x} + {y} + {carry}" if p.family == "add" else f"{x} * {p.operand[0]} + {carry}"
            digit, carry = total % 10, total // 10
            steps.append(f"{op} = {_spaced(_digits(total))}" if level == 3 else
                         f"{digit} c {carry}" if level == 2 else f"c {carry}")
        if carry:
            steps.append(f"c {carry}" if level < 3 else f"carry {carry}")
    elif p.family == "sort":
        counts = [p.digits.count(d) for d in range(10)]
        if level == 1:
            steps = [str(len(p.digits))]
        elif level == 2:
            steps = [f"{d} x {n}" for d, n in enumerate(counts) if n]
        else:
            steps = [f"{d} x {n}" for d, n in enumerate(counts)]
    else:  # copy: running sum mod 10
        run = 0
        for i, d in enumerate(p.digits):
            run = (run + d) % 10
            if level == 3 or (level == 2 and i % 2 == 1) or i == len(p.digits) - 1:
                steps.append(f"{d} : {run}" if level == 3 else str(run))
    return " , ".join(steps)


def generate(families: tuple[str, ...] | list[str], n: int, digits: int | tuple[int, int], seed: int) -> list[Problem]:
    """n problems cycling through `families`; digits fixed or drawn uniformly from an inclusive (lo, hi)."""
    rng = random.Random(seed)
    lo, hi = (digits, digits) if isinstance(digits, int) else digits
    return [make_problem(families[i % len(families)], rng.randint(lo, hi), rng) for i in range(n)]


# ---------------------------------------------------------------------- chat format
def prompt_ids(tok: Tok, p: Problem, effort: int) -> list[int]:
    """The generation prompt: user turn, the effort line, `<|assistant|>`."""
    return tok.encode_chat([{"role": "user", "content": p.question}], reasoning_effort=effort)


def sft_example(tok: Tok, p: Problem, effort: int) -> tuple[list[int], int]:
    """(ids of prompt + worked reply + `<|end|>`, number of prompt tokens): train on ids[n_prompt:]."""
    prompt = prompt_ids(tok, p, effort)
    full = tok.encode_chat([{"role": "user", "content": p.question},
                            {"role": "assistant", "content": p.answer, "reasoning_effort": effort,
                             "reasoning_content": reasoning(p, effort_level(effort))}], add_generation_prompt=False)
    if full[:len(prompt)] != prompt:  # the template promises a byte-exact extension
        raise AssertionError("chat template: the reply does not extend the generation prompt")
    return full, len(prompt)


def split_reply(tok: Tok, output: list[int]) -> tuple[list[int], str | None]:
    """(reasoning token ids, answer text) of generated ids; answer None when `</think>` never came."""
    end = output.index(END_TURN_ID) if END_TURN_ID in output else len(output)
    out = output[:end]
    if END_THINK_ID not in out:
        return out, None
    k = out.index(END_THINK_ID)
    think = out[1:k] if out and out[0] == SPECIAL_TOKENS.index("<think>") else out[:k]
    return think, tok.decode(out[k + 1:], skip_special=True)


def verify(tok: Tok, p: Problem, output: list[int]) -> bool:
    """Exact check of a generated reply: the answer after `</think>` equals p.answer (whitespace-normalized)."""
    _, answer = split_reply(tok, output)
    return answer is not None and " ".join(answer.split()) == p.answer


def reasoning_length(tok: Tok, output: list[int]) -> int:
    """ℓ of the length reward: tokens between `<think>` and `</think>` (all of them when it never closes)."""
    return len(split_reply(tok, output)[0])
