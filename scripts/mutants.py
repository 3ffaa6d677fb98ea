"""Mutation check: do the tests notice when a core claim breaks?

Each entry of `scripts/mutants.toml` is one small edit of the source (a "mutant"): a file, an exact
original text that must occur exactly once in it, its replacement, a description and the test node
ids that must catch it. For every mutant this script copies the repository (`src/`, `tests/`, config
files; data folders are symlinked) to a temporary folder, applies the edit there and runs
`python -m pytest -x -q <nodes>` with `PYTHONPATH=<tmp>/src`. A mutant is

  caught    the named tests fail (the claim is guarded),
  survived  they pass (a gap: the tests cannot see this break),
  stale     its original text no longer occurs exactly once (the code moved: update the entry),
  invalid   the edit does not compile (not a semantic mutation),
  error     pytest could not run the nodes (wrong node ids), or a timeout.

Before the mutants, a baseline run of every named node on the unmodified copy must pass (otherwise a
"caught" would mean nothing). The exit status is 0 only when every mutant is caught and the baseline
passes. Adding a mutant = adding one `[[mutant]]` entry.

    python scripts/mutants.py             # the whole list, 2 workers
    python scripts/mutants.py --list      # what is in it
    python scripts/mutants.py --only 'rope-*' --only kl-direction-reversed -j 1
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FILE = HERE / "mutants.toml"
REQUIRED = ("name", "file", "original", "replacement", "description", "tests")
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)  # node ids may hold spaces


class ConfigError(ValueError):
    """A malformed mutants file."""


@dataclass
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    description: str
    tests: list[str]
    kind: str = ""


@dataclass
class Settings:
    copy: list[str] = field(default_factory=lambda: ["src", "tests", "pyproject.toml"])
    link: list[str] = field(default_factory=list)
    forbidden_tests: list[str] = field(default_factory=list)
    timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the test runs
    plugins: list[str] = field(default_factory=list)  # pytest plugins to load (-p NAME), e.g. with autoload off


@dataclass
class Result:
    name: str
    status: str  # caught | survived | stale | invalid | error
    seconds: float = 0.0
    detail: str = ""  # the catching test, or why not
    output: str = ""


def load(path: Path) -> tuple[Settings, list[Mutant]]:
    """Parse and validate the mutants file; ConfigError names the offending entry."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    raw = data.get("settings", {})
    unknown = set(raw) - set(Settings.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{path}: unknown [settings] keys {sorted(unknown)}")
    settings = Settings(**raw)
    mutants, seen = [], set()
    for i, entry in enumerate(data.get("mutant", [])):
        where = f"{path}: mutant #{i + 1} ({entry.get('name', '?')})"
        missing = [k for k in REQUIRED if not entry.get(k)]
        if missing:
            raise ConfigError(f"{where}: missing {missing}")
        extra = set(entry) - set(Mutant.__dataclass_fields__)
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)}")
        if entry["name"] in seen:
            raise ConfigError(f"{where}: duplicate name")
        seen.add(entry["name"])
        if entry["original"] == entry["replacement"]:
            raise ConfigError(f"{where}: replacement equals the original")
        tests = entry["tests"]
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise ConfigError(f"{where}: tests must be a list of node ids")
        bad = [t for t in tests if t in settings.forbidden_tests]
        if bad:
            raise ConfigError(f"{where}: {bad} may not count as a catch (name semantic tests)")
        mutants.append(Mutant(**entry))
    if not mutants:
        raise ConfigError(f"{path}: no [[mutant]] entries")
    return settings, mutants


def select(mutants: list[Mutant], patterns: list[str]) -> list[Mutant]:
    if not patterns:
        return mutants
    wanted = [p for arg in patterns for p in arg.split(",") if p]
    chosen = [m for m in mutants if any(fnmatch.fnmatchcase(m.name, p) for p in wanted)]
    unmatched = [p for p in wanted if not any(fnmatch.fnmatchcase(m.name, p) for m in mutants)]
    if unmatched:
        raise ConfigError(f"--only: no mutant named {unmatched}")
    return chosen


def make_copy(root: Path, settings: Settings) -> Path:
    """A temporary repository: the `copy` paths copied (without caches), the `link` paths symlinked."""
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-mutant-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for rel in settings.copy:
        src = root / rel
        if src.is_dir():
            shutil.copytree(src, tmp / rel, ignore=ignore, symlinks=True)
        elif src.exists():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / rel)
    for rel in settings.link:
        if (root / rel).exists():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(root / rel, tmp / rel)
    return tmp


def run_pytest(repo: Path, nodes: list[str], settings: Settings, timeout: float | None = None
               ) -> tuple[int | None, str]:
    """(pytest exit code or None on timeout, combined output) for `nodes` in `repo`; timeout: seconds (default the
    settings' per-mutant timeout)."""
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONDONTWRITEBYTECODE": "1",
           "OMP_NUM_THREADS": "1", "DSV41_TEST_THREADS": "1", **settings.env}
    plugins = [arg for name in settings.plugins for arg in ("-p", name)]
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plugins, *nodes]
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout or settings.timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def count_original(root: Path, m: Mutant) -> int:
    path = root / m.file
    return path.read_text().count(m.original) if path.is_file() else 0


def run_mutant(root: Path, m: Mutant, settings: Settings, keep: bool) -> Result:
    start = time.perf_counter()
    path = root / m.file
    text = path.read_text() if path.is_file() else None
    count = 0 if text is None else text.count(m.original)
    if count != 1:
        where = "file missing" if text is None else f"original text found {count} times"
        return Result(m.name, "stale", time.perf_counter() - start, where)
    mutated = text.replace(m.original, m.replacement)
    if path.suffix == ".py":
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as e:
            return Result(m.name, "invalid", time.perf_counter() - start, f"does not compile: {e}")
    repo = make_copy(root, settings)
    try:
        (repo / m.file).write_text(mutated)
        rc, out = run_pytest(repo, m.tests, settings)
    finally:
        if not keep:
            shutil.rmtree(repo, ignore_errors=True)
    seconds = time.perf_counter() - start
    if rc is None:
        return Result(m.name, "error", seconds, f"timeout after {settings.timeout:.0f} s", out)
    if rc == 0:
        return Result(m.name, "survived", seconds, "all named tests passed", out)
    failed = FAILED_LINE.findall(out)
    if rc in (1, 2) and failed:  # 1: tests failed; 2: interrupted (-x) or a collection error caused by the edit
        return Result(m.name, "caught", seconds, failed[0], out)
    return Result(m.name, "error", seconds, f"pytest exit {rc} without a failing test (node ids?)", out)


BASELINE_NODES_PER_TIMEOUT = 50  # the baseline runs every named node in one pytest: one timeout per this many


def baseline_timeout(settings: Settings, n_nodes: int) -> float:
    """The baseline's timeout: the per-mutant timeout for each BASELINE_NODES_PER_TIMEOUT nodes it runs (one
    mutant's timeout for all of them made the 228-mutant run's baseline time out beside the mutants' workers)."""
    return settings.timeout * max(1, -(-n_nodes // BASELINE_NODES_PER_TIMEOUT))


def run_baseline(root: Path, mutants: list[Mutant], settings: Settings) -> Result:
    """Every named node must pass on an unmodified copy, importing the copy's own sources."""
    start = time.perf_counter()
    nodes = sorted({t for m in mutants for t in m.tests})
    repo = make_copy(root, settings)
    try:
        src = repo / "src"
        packages = sorted(d.name for d in src.iterdir() if (d / "__init__.py").exists()) if src.is_dir() else []
        for name in packages:  # an installed copy of the package must not shadow the mutated one
            probe = subprocess.run([sys.executable, "-c", f"import {name}, sys; sys.stdout.write({name}.__file__)"],
                                   cwd=repo, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
            if probe.returncode == 0 and not Path(probe.stdout).resolve().is_relative_to(repo.resolve()):
                return Result("baseline", "error", 0.0, f"the copy imports {name} from {probe.stdout}, not from itself")
        rc, out = run_pytest(repo, nodes, settings, baseline_timeout(settings, len(nodes)))
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    seconds = time.perf_counter() - start
    if rc == 0:
        return Result("baseline", "passed", seconds, f"{len(nodes)} nodes")
    why = "timeout" if rc is None else f"pytest exit {rc}: " + ", ".join(FAILED_LINE.findall(out)[:3])
    return Result("baseline", "error", seconds, why, out)


def print_list(mutants: list[Mutant]) -> None:
    width = max(len(m.name) for m in mutants)
    for m in mutants:
        print(f"{m.name:<{width}}  {m.file}")
        print(f"{'':<{width}}  {m.description}")
        for t in m.tests:
            print(f"{'':<{width}}    {t}")
    print(f"{len(mutants)} mutants")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/mutants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, default=DEFAULT_FILE, help=f"mutants list (default {DEFAULT_FILE.name})")
    p.add_argument("--root", type=Path, default=HERE.parent, help="repository root (default: this checkout)")
    p.add_argument("--list", action="store_true", help="print the mutants and the tests that must catch them")
    p.add_argument("--check", action="store_true", help="only check that every original text occurs exactly once")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run only these mutants (names or shell patterns; repeat or comma-separate)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel workers (default 2)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmodified run of the named tests")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (paths are printed)")
    p.add_argument("-v", "--verbose", action="store_true", help="print pytest's output for every mutant not caught")
    args = p.parse_args(argv)
    try:
        settings, mutants = load(args.file)
        mutants = select(mutants, args.only)
    except ConfigError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("mutants: -j must be at least 1", file=sys.stderr)
        return 2
    if args.list:
        print_list(mutants)
        return 0
    root = args.root.resolve()
    if args.check:
        stale = [(m.name, n) for m in mutants if (n := count_original(root, m)) != 1]
        for name, n in stale:
            print(f"stale: {name} — original text found {n} times")
        print(f"{len(mutants) - len(stale)} of {len(mutants)} mutants apply")
        return 1 if stale else 0
    t0 = time.perf_counter()
    width = max(len(m.name) for m in mutants)
    results: list[Result] = []
    baseline = None
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        jobs = {}
        if not args.no_baseline:
            jobs[pool.submit(run_baseline, root, mutants, settings)] = None
        for m in mutants:
            jobs[pool.submit(run_mutant, root, m, settings, args.keep)] = m
        for fut in as_completed(jobs):
            r = fut.result()
            if jobs[fut] is None:
                baseline = r
                print(f"{'baseline':<9} {r.seconds:6.1f}s  {r.detail}", flush=True)
                continue
            results.append(r)
            print(f"{r.status:<9} {r.seconds:6.1f}s  {r.name:<{width}}  {r.detail}", flush=True)
            if args.verbose and r.status != "caught" and r.output:
                print(r.output[-3000:], flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("caught", "survived", "stale", "invalid", "error")}
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every pytest run, summed (all workers)
    print(f"\n{len(results)} mutants in {wall:.0f} s with {args.jobs} workers "
          f"({usage.ru_utime + usage.ru_stime:.0f} s CPU in the test runs): "
          + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    for r in sorted(results, key=lambda r: r.name):
        if r.status != "caught":
            print(f"  {r.status}: {r.name} — {r.detail}")
    if baseline is not None and baseline.status != "passed":
        print(f"baseline FAILED ({baseline.detail}): the results above mean nothing\n{baseline.output[-3000:]}")
        return 2
    return 0 if counts["caught"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
