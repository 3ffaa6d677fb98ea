"""`dsv41 sft / rl / opd / merge`: bad input is one line on stderr and exit code 2 (no model is loaded for it)."""

from __future__ import annotations

from dsv41.cli import main


def test_bad_input_exits_2_with_one_line(capsys, tmp_path):
    cases = [
        ["sft", "--preset", "tiny", "--out", str(tmp_path / "a"), "--families", "add,juggle"],
        ["rl", "--preset", "tiny", "--out", str(tmp_path / "b"), "--digits", "x"],
        ["rl", "--preset", "tiny", "--out", str(tmp_path / "b"), "--efforts", "0,50"],
        ["sft", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "c")],
        ["opd", "--preset", "tiny", "--teacher", str(tmp_path / "none"), "--out", str(tmp_path / "d")],
        ["merge", str(tmp_path / "x"), str(tmp_path / "y"), "--out", str(tmp_path / "m")],
        ["merge", str(tmp_path), "--weights", "a", "--out", str(tmp_path / "m")],
        ["rl", "--preset", "tiny", "--out", str(tmp_path / "e"), "--steps", "0"],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.strip() and err.strip().count("\n") <= 1 or err.startswith("usage:"), (argv, err)
