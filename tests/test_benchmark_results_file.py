"""benchmarks/results_file: a run never overwrites an earlier one of the same day; write_result writes it."""

from __future__ import annotations

import json

from benchmarks.results_file import dated_path, to_json, write_result


def test_dated_paths_count_up_and_never_reuse_a_file(tmp_path):
    folder = tmp_path / "new"
    first = dated_path(folder, "bench", "2026-01-02")
    assert folder.is_dir() and first.name == "bench-2026-01-02.json"
    first.write_text("{}")
    second = dated_path(folder, "bench", "2026-01-02")
    second.write_text("{}")
    assert second.name == "bench-2026-01-02-2.json"
    assert dated_path(folder, "bench", "2026-01-02").name == "bench-2026-01-02-3.json"
    assert dated_path(folder, "other", "2026-01-02").name == "other-2026-01-02.json"


def test_write_result_writes_the_json_at_the_next_dated_path(tmp_path, capsys):
    first = write_result(tmp_path, "bench", {"a": 1}, "2026-01-02")
    second = write_result(tmp_path, "bench", {"a": 2}, "2026-01-02")
    assert [first.name, second.name] == ["bench-2026-01-02.json", "bench-2026-01-02-2.json"]
    assert json.loads(first.read_text()) == {"a": 1} and json.loads(second.read_text()) == {"a": 2}
    assert f"wrote {second}" in capsys.readouterr().out


def test_to_json_keeps_rows_of_scalars_on_one_line_and_round_trips():
    result = {"a": 1, "steps": [[1.5, 64, 0, 64, 0], [2.0, 64, 3, 63, 1]], "names": ["x", "y, z"],
              "runs": [{"b": None, "empty": [], "nested": {}}], 3: "int key"}
    text = to_json(result)
    assert json.loads(text) == json.loads(json.dumps(result))
    lines = text.splitlines()
    assert '  [1.5, 64, 0, 64, 0],' in lines and '  [2.0, 64, 3, 63, 1]' in lines  # a row per line
    assert ' "names": ["x", "y, z"],' in lines and lines[0] == "{" and lines[-1] == "}"
