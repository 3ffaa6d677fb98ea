"""Where a benchmark writes its JSON: <folder>/<name>-<date>.json, or -2, -3, … when a run of the same day is there
(a second run never overwrites the first)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path


def dated_path(folder: str | Path, name: str, date: str | None = None) -> Path:
    """A new file path for benchmark `name` in `folder` (created), dated `date` (default today, ISO)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    date = date or dt.date.today().isoformat()
    path, k = folder / f"{name}-{date}.json", 2
    while path.exists():
        path, k = folder / f"{name}-{date}-{k}.json", k + 1
    return path


def to_json(result, indent: int = 1) -> str:
    """`result` as indented JSON, except that a list of scalars stays on one line: a per-step log of thousands of
    rows is a line per row, not a line per number (issue 19's step logs: 2.5 MB → 1.2 MB, and every result file
    travels to the GPU box with the checkout)."""

    def enc(value, depth: int) -> str:
        pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
        if isinstance(value, dict) and value:
            items = [f"{inner}{json.dumps(str(k))}: {enc(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(value, (list, tuple)) and value and any(isinstance(v, (dict, list, tuple)) for v in value):
            return "[\n" + ",\n".join(inner + enc(v, depth + 1) for v in value) + "\n" + pad + "]"
        return json.dumps(value, default=str)

    return enc(result, 0)


def write_result(folder: str | Path, name: str, result: dict, date: str | None = None) -> Path:
    """`result` as JSON (`to_json`) at `dated_path(folder, name, date)`; prints and returns the path."""
    path = dated_path(folder, name, date)
    path.write_text(to_json(result) + "\n")
    print(f"wrote {path}")
    return path
