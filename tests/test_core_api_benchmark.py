"""benchmarks/core_api_decode.py end to end on the tiny model on CPU: both sides decode the same
greedy tokens, and the results file holds what was printed."""

from __future__ import annotations

import json

from benchmarks import core_api_decode


def test_core_api_decode_benchmark(tmp_path):
    results = core_api_decode.main(["--device", "cpu", "--num-seqs", "3", "--context", "12", "--steps", "3",
                                    "--warmup", "1", "--results-dir", str(tmp_path), "--output", "run"])
    assert json.loads((tmp_path / "run.json").read_text())["tokens_per_s"] == results["tokens_per_s"]
    assert results["engine"]["greedy_sequences_identical_to_core_api"] == "3/3"
    assert results["core_api"]["kv_cells_used"] == 3 * (12 + 1 + 3)
    assert results["command"].startswith("python benchmarks/core_api_decode.py --device cpu")
