"""`dsv41 sft / rl / opd / merge`: bad input is one line on stderr and exit code 2 (no model is loaded for it)."""

from __future__ import annotations

from tests.conftest import load_script

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


def test_effort_tiers_script_asks_the_server_at_each_tier(tmp_path):
    """scripts/effort_tiers.py end to end on a tiny random policy: the server answers every problem at the
    three API tiers (low / high / max = 50 / 75 / 100) and the JSON has each tier's numbers; a missing
    checkpoint exits 2."""
    import json

    import torch

    from dsv41.posttrain.common import load_policy, save_policy

    script = load_script("scripts/effort_tiers.py")
    model, tok = load_policy(None, "tiny", torch.device("cpu"))
    save_policy(model, tok, tmp_path / "policy")
    assert script.main([str(tmp_path / "missing"), "--device", "cpu"]) == 2
    argv = [str(tmp_path / "policy"), "--device", "cpu", "--problems", "2", "--max-tokens", "4", "--digits", "2",
            "--out", str(tmp_path / "out")]
    assert script.main(argv) == 0
    report = json.loads((tmp_path / "out" / "effort_tiers.json").read_text())
    assert {name: t["effort"] for name, t in report["tiers"].items()} == {"low": 50, "high": 75, "max": 100}
    for t in report["tiers"].values():
        assert t["n"] == 2 and 1 <= t["completion_tokens_mean"] <= 4 and 0.0 <= t["accuracy"] <= 1.0, t
