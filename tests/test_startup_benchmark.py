"""benchmarks/startup.py on the tiny model: fresh processes, offline and served, a results file."""

from __future__ import annotations

import json

from benchmarks import startup


def test_records_first_and_later_starts_of_both_kinds(tmp_path):
    startup.main(["--model", "tiny", "--repeats", "2", "--results-dir", str(tmp_path), "--output", "startup"])
    results = json.loads((tmp_path / "startup.json").read_text())
    offline, served = results["offline"], results["served"]
    assert len(offline["runs"]) == len(served["runs"]) == 2
    for run in offline["runs"]:
        assert 0 < run["import_s"] <= run["ready_s"] <= run["process_wall_s"]
    for run in served["runs"]:
        assert 0 < run["listening_s"] <= run["healthy_s"]
    assert offline["first_start_empty_cache"] == offline["runs"][0]
    assert offline["later_starts_median"]["ready_s"] == offline["runs"][1]["ready_s"]
    assert results["commit"] and results["command"].startswith("python benchmarks/startup.py")
