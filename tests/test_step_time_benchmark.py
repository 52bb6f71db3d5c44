"""benchmarks/step_time.py on the tiny model (CPU): it runs an eager decode step and records its figures."""

from __future__ import annotations

import json

from benchmarks import step_time


def test_step_time_records_host_time_and_op_counts(tmp_path):
    results = step_time.main(["--batch-size", "4", "--context", "9", "--warmup", "1", "--steps", "2",
                              "--profile-steps", "1", "--compile", "off", "--results-dir", str(tmp_path)])
    (row,) = results["variants"]
    assert row["compilation_level"] == 0 and row["compilations"] == 0
    assert 0 < row["host_ms"] <= row["wall_ms"]
    assert row["aten_ops"] > 0 and row["device_ms"] is None  # no kernel times on a CPU
    assert results["workload"]["batch_size"] == 4
    # Where the host time goes: the model's forward is the project's function with the most time.
    profile = row["host_profile"]
    assert profile["self_time"] and all(r["ms_per_step"] >= 0 for r in profile["self_time"])
    assert "models/decoder.py" in profile["project_cumulative_time"][0]["function"]
    assert json.loads((tmp_path / "step_time_cpu_tiny_b4.json").read_text())["variants"] == [row]


def test_step_time_runs_each_compilation_level_in_a_process_of_its_own(tmp_path):
    results = step_time.main(["--batch-size", "2", "--context", "5", "--warmup", "1", "--steps", "1",
                              "--profile-steps", "1", "--compile", "both", "--results-dir", str(tmp_path)])
    eager, compiled = results["variants"]
    assert (eager["compilation_level"], eager["compilations"]) == (0, 0)
    # Each row came back from the spawned process that ran its level; level 1 compiled there.
    assert compiled["compilation_level"] == 1 and compiled["compilations"] >= 1
    assert compiled["aten_ops"] < eager["aten_ops"]  # inductor's kernels replace the eager ops
