"""scripts/mutants.py's own mechanics on a toy repository: caught, survived, stale, invalid, the baseline
guard, --only / --list / --check, bad lists refused with exit 2 — and the project's list is well formed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutants.py"

TOY_SRC = '''
def add(a, b):
    return a + b


def unused():
    return 1
'''

TOY_TEST = '''
from toy import add


def test_add():
    assert add(2, 3) == 5
'''

TOY_LIST = '''
[settings]
copy = ["src", "tests", "pyproject.toml"]
forbidden_tests = ["tests/test_toy.py::test_golden"]
timeout = 60

[[mutant]]
name = "add-subtracts"
file = "src/toy/__init__.py"
original = "return a + b"
replacement = "return a - b"
description = "caught by test_add"
tests = ["tests/test_toy.py::test_add"]

[[mutant]]
name = "unused-changes"
file = "src/toy/__init__.py"
original = "return 1"
replacement = "return 2"
description = "no test looks: survives"
tests = ["tests/test_toy.py::test_add"]

[[mutant]]
name = "gone"
file = "src/toy/__init__.py"
original = "return a * b"
replacement = "return a / b"
description = "the original text is not there: stale"
tests = ["tests/test_toy.py::test_add"]

[[mutant]]
name = "broken-syntax"
file = "src/toy/__init__.py"
original = "return a + b"
replacement = "return a +"
description = "does not compile: invalid"
tests = ["tests/test_toy.py::test_add"]
'''


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    (tmp_path / "src" / "toy").mkdir(parents=True)
    (tmp_path / "src" / "toy" / "__init__.py").write_text(TOY_SRC)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(TOY_TEST)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    (tmp_path / "mutants.toml").write_text(TOY_LIST)
    return tmp_path


def statuses(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("caught", "survived", "stale", "invalid", "error"):
            out[parts[2]] = parts[0]
    return out


def test_statuses_and_exit_code(toy: Path):
    res = run("--root", str(toy), "--file", str(toy / "mutants.toml"), "-j", "2", cwd=toy)
    assert res.returncode == 1, res.stdout + res.stderr
    assert statuses(res.stdout) == {"add-subtracts": "caught", "unused-changes": "survived", "gone": "stale",
                                    "broken-syntax": "invalid"}, res.stdout
    assert "tests/test_toy.py::test_add" in res.stdout  # the catching test is named
    assert "baseline" in res.stdout and "4 mutants" in res.stdout
    # the source tree itself is never touched
    assert (toy / "src" / "toy" / "__init__.py").read_text() == TOY_SRC


def test_only_list_and_check(toy: Path):
    args = ("--root", str(toy), "--file", str(toy / "mutants.toml"))
    res = run(*args, "--only", "add-*", cwd=toy)
    assert res.returncode == 0 and statuses(res.stdout) == {"add-subtracts": "caught"}, res.stdout + res.stderr
    res = run(*args, "--list", cwd=toy)
    assert res.returncode == 0 and "unused-changes" in res.stdout and "4 mutants" in res.stdout
    res = run(*args, "--check", cwd=toy)
    assert res.returncode == 1 and "stale: gone" in res.stdout
    res = run(*args, "--only", "nope", cwd=toy)
    assert res.returncode == 2 and "nope" in res.stderr


def test_a_failing_baseline_invalidates_the_run(toy: Path):
    (toy / "tests" / "test_toy.py").write_text(TOY_TEST.replace("== 5", "== 6"))
    res = run("--root", str(toy), "--file", str(toy / "mutants.toml"), "--only", "add-subtracts", cwd=toy)
    assert res.returncode == 2 and "baseline FAILED" in res.stdout, res.stdout


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('tests = ["tests/test_toy.py::test_add"]\n\n[[mutant]]\nname = "unused-changes"',
                         'tests = ["tests/test_toy.py::test_golden"]\n\n[[mutant]]\nname = "unused-changes"'),
     "may not count"),
    (lambda t: t.replace('name = "gone"', 'name = "add-subtracts"'), "duplicate name"),
    (lambda t: t.replace('description = "caught by test_add"\n', ""), "missing ['description']"),
    (lambda t: t + "\n[[mutant]]\nname = 'x'\n", "missing"),
])
def test_bad_lists_are_refused(toy: Path, edit, message):
    bad = toy / "bad.toml"
    bad.write_text(edit(TOY_LIST))
    res = run("--root", str(toy), "--file", str(bad), "--list", cwd=toy)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_the_project_list_applies_and_names_semantic_tests():
    """Every curated mutant's original text occurs exactly once, and ≥ 30 model / recipe mutants exist."""
    res = run("--check", cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    listing = run("--list", cwd=ROOT).stdout
    n = int(listing.strip().splitlines()[-1].split()[0])
    assert n >= 30, listing[-200:]
    assert textwrap.dedent("test_golden_tiny_loss_curve") not in listing


def test_the_baseline_gets_one_timeout_per_fifty_nodes():
    """The baseline runs every named node in one pytest, so its timeout grows with them: one per-mutant timeout for
    up to 50 nodes, then one more for each 50 (a single timeout for the 160 nodes of the project's list made its
    baseline time out beside the mutants' workers)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mutants
    finally:
        sys.path.remove(str(SCRIPT.parent))
    settings = mutants.Settings(copy=["src"], timeout=300)
    assert [mutants.baseline_timeout(settings, n) for n in (1, 50, 51, 160)] == [300, 300, 600, 1200]
