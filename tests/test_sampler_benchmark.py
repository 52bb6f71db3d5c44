"""benchmarks/sampler.py on CPU: a row per setting and batch size, and a sorting path that draws what
the sampler draws (so the two timings compare the same work)."""

from __future__ import annotations

import json

import torch

from benchmarks import sampler as bench
from novainfer.sample import Sampler, SamplingMetadata
from novainfer.sampling_params import SamplingParams


def test_records_one_row_per_setting_and_batch_size(tmp_path):
    settings = ["greedy", "topp0.95", "half-topk50-half-topp0.95"]
    report = bench.main(["--vocab-size", "300", "--batch-sizes", "1,4", "--settings", ",".join(settings),
                         "--warmup", "1", "--calls", "2", "--sorting-calls", "1", "--results-dir", str(tmp_path)])
    rows = report["results"]
    assert [(r["setting"], r["batch_size"]) for r in rows] == [(s, b) for s in settings for b in (1, 4)]
    assert all(r["sampler_ms"] > 0 and r["sorting_path_ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "sampler_cpu_v300.json").read_text())["results"] == rows


def test_the_sorting_path_draws_the_samplers_tokens_for_seeded_rows():
    """Oracle: the sampler's own torch stages, for the same seeded rows (counter-based noise)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.2,
                                                              seed=3)]
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(0)) * 3
    metadata = SamplingMetadata.from_requests(params, [[1, 2]] * len(params), [[3]] * len(params), "cpu", 300)
    assert bench.sorting_path(logits, metadata).tolist() == Sampler()(logits, metadata).sampled_token_ids.tolist()


def test_the_sorting_path_gives_the_samplers_logprobs():
    """Where rows ask for logprobs, the sorting path computes them too (so that its time counts the
    same work): the sampled tokens' and the top alternatives' logprobs and the sampled ranks."""
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, seed=4, logprobs=1)]
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(1)) * 3
    metadata = SamplingMetadata.from_requests(params, [[1, 2]] * len(params), [[3]] * len(params), "cpu", 300)
    tokens, logprobs, ranks = bench.sorting_path(logits, metadata)
    out = Sampler()(logits, metadata)
    assert tokens.tolist() == out.sampled_token_ids.tolist()
    torch.testing.assert_close(logprobs, out.logprobs.logprobs)
    assert ranks.tolist() == out.logprobs.sampled_token_ranks.tolist()
