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


def write_result(folder: str | Path, name: str, result: dict, date: str | None = None) -> Path:
    """`result` as indented JSON at `dated_path(folder, name, date)`; prints and returns the path."""
    path = dated_path(folder, name, date)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path
