"""benchmarks/results_file.dated_path: a run never overwrites an earlier one of the same day."""

from __future__ import annotations

from benchmarks.results_file import dated_path


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
