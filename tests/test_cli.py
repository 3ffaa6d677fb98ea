"""`python -m dsv41`: subcommands, JSON output, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv41.cli import SUBCOMMANDS, main
from dsv41.config import ConfigError, load_config


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def run_main(capsys):
    """`main(args)` in this process as a CompletedProcess (exit code, stdout, stderr): the CLI without a
    Python start-up per case (`_cli` keeps the `python -m dsv41` entry itself covered)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out.out, out.err)
    return run


def test_accounting_text_has_the_report_column() -> None:
    out = _cli("accounting", "--preset", "v41-flash")
    assert out.returncode == 0, out.stderr
    assert "report" in out.stdout and "diff" in out.stdout
    kv = next(ln for ln in out.stdout.splitlines() if ln.startswith("global KV bytes / token"))
    assert kv.split()[-3:-1] == ["890", "890"]


def test_accounting_json_keys() -> None:
    out = _cli("accounting", "--preset", "tiny", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for key in ("backbone_params", "engram_params", "active_params_prefill", "active_params_decode",
                "global_kv_bytes_per_token", "global_kv_by_source", "entry_bytes", "v4_flash", "decode_flops",
                "decode_flops_growth", "prefill_flops", "dspark_params", "vision_params"):
        assert key in r, key
    assert r["backbone_params"] > r["active_params_decode"] > r["active_params_prefill"] > 0


def test_config_file_and_hf_directory(tmp_path, run_main) -> None:
    flat = tmp_path / "flat.json"
    flat.write_text(load_config("tiny").to_json())
    out = run_main("accounting", "--config", str(flat), "--json")
    assert out.returncode == 0, out.stderr
    preset = json.loads(run_main("accounting", "--preset", "tiny", "--json").stdout)
    assert json.loads(out.stdout)["backbone_params"] == preset["backbone_params"]


def _bad(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("command", ["plan", "accounting"])
def test_malformed_configs_fail_in_one_line(tmp_path, command: str, run_main) -> None:
    tiny = load_config("tiny").to_dict()
    cases = [
        ({**tiny, "n_heads": 0}, "n_heads"),
        ({**tiny, "o_groups": 3}, "o_groups"),
        ({**tiny, "kv_source_layers": [0, 4]}, "kv_source_layers"),  # layer 0 is window-only
        ({**tiny, "moe_dim": 64}, "moe_dim"),
        ({"text_config": {"hidden_size": 64, "sliding_window": 0}}, "window_size"),  # HF layout
    ]
    for i, (data, field_name) in enumerate(cases):
        out = run_main(command, "--config", _bad(tmp_path, f"bad{i}.json", data))
        lines = out.stderr.splitlines()
        assert out.returncode == 2, (field_name, out.stderr)
        assert len(lines) == 1 and lines[0].startswith("dsv41: error: "), out.stderr
        assert f"'{field_name}'" in lines[0], lines[0]
        assert out.stdout == ""


def test_missing_file_and_bad_json_fail_in_one_line(tmp_path, run_main) -> None:
    for args in (["--config", str(tmp_path / "nope.json")], ["--preset", "no-such-preset"],
                 ["--config", _bad(tmp_path, "broken.json", "{not json")]):
        out = run_main("accounting", *args)
        assert out.returncode == 2
        assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("dsv41: error: "), out.stderr


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_for_each_subcommand(command: str, run_main) -> None:
    out = run_main(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: dsv41 {command}") and "examples:" in out.stdout


def test_top_level_help_lists_the_commands(capsys) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in SUBCOMMANDS)
    assert main([]) == 2  # a command is required


def test_main_in_process(capsys, tmp_path) -> None:
    assert main(["plan", "--preset", "tiny"]) == 0
    assert "full: [2, 4]" in capsys.readouterr().out
    assert main(["accounting", "--config", _bad(tmp_path, "b.json", {"dim": -1})]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'dim'" in err


class _Raises:
    """A subcommand whose run fails with `error` (registered by the test below)."""

    error: BaseException | None = None

    def add_parser(self, subparsers):
        return subparsers.add_parser("boom")

    def run(self, args):
        raise self.error


RAISES = _Raises()


@pytest.mark.parametrize("error, needle", [
    (ConfigError("'dim' must be positive,\n  got -1"), "'dim' must be positive, got -1"),
    (FileNotFoundError(2, "No such file or directory", "/data/shard-7.bin"), "'/data/shard-7.bin'"),
])
def test_any_command_failing_on_its_input_prints_one_line_and_exits_2(monkeypatch, run_main, error, needle):
    """Whatever subcommand raises a ConfigError or a FileNotFoundError: exit code 2, one `dsv41: error:` line on
    stderr naming the problem (a multi-line message collapsed), nothing on stdout, no traceback."""
    RAISES.error = error
    monkeypatch.setitem(SUBCOMMANDS, "boom", f"{__name__}:RAISES")
    out = run_main("boom")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error: ") and needle in lines[0], out.stderr
