"""The benchmark scripts, end to end on the tiny model on CPU: they count what was produced and
compare NovaInfer with transformers on the same requests (whose greedy tokens are the oracle)."""

from __future__ import annotations

import json

import pytest

from benchmarks import latency, throughput
from benchmarks.architectures import get_architecture


def test_architecture_preset_rejects_unknown_names_and_fields():
    assert get_architecture("qwen2-1.5b", {"num_hidden_layers": 2}).num_hidden_layers == 2
    with pytest.raises(ValueError, match="qwen2-0.5b"):  # lists the presets that exist
        get_architecture("qwen2-0.6b")
    with pytest.raises(ValueError, match="num_layers"):
        get_architecture("qwen2-0.5b", {"num_layers": 2})


def test_throughput_against_continuous_batching(tmp_path):
    results = throughput.main(["--num-seqs", "5", "--max-input", "40", "--min-output", "3", "--max-output", "12",
                               "--repeats", "1", "--peer", "continuous-batching", "--profile", "--profile-steps", "2",
                               "--results-dir", str(tmp_path), "--output", "run"])
    assert json.loads((tmp_path / "run.json").read_text())["output_tokens_per_s"] == results["output_tokens_per_s"]
    total = results["workload"]["total_output_tokens"]
    assert results["novainfer"]["output_tokens"] == total
    assert results["peer"]["output_tokens"] == total  # each request got its own max_new_tokens
    assert results["peer"]["greedy_agreement_with_novainfer"]["identical_requests"] == 5
    decode = results["novainfer"]["profile"]["decode_profile"]
    assert decode["batch_size"] == 5 and decode["top"]
    assert results["command"].startswith("python benchmarks/throughput.py --num-seqs 5")


def test_latency_times_both_sides(tmp_path):
    results = latency.main(["--input-len", "16", "--output-len", "6", "--warmup", "1", "--repeats", "2",
                            "--results-dir", str(tmp_path), "--output", "run"])
    for side in (results["novainfer"], results["peer"]):
        assert len(side["runs"]) == 2
        for run in side["runs"]:
            assert run["num_tokens"] == 6 and 0 < run["ttft_s"] < run["total_s"]
    assert results["peer"]["greedy_outputs_identical"]
