"""benchmarks/frontend.py on CPU: the synthetic core outputs are what the output processor turns
into each request's tokens, and every case is timed and recorded."""

from __future__ import annotations

import json

from benchmarks import frontend as bench
from novainfer.core.messages import EngineCoreRequest
from novainfer.engine.output_processor import OutputProcessor
from novainfer.sampling_params import RequestOutputKind, SamplingParams
from novainfer.tiny_model import get_tiny_model_dir


def test_step_messages_give_each_request_one_token_per_step_and_its_logprob_rows():
    args = bench.parse_args(["--requests", "3", "--steps", "4", "--logprobs", "2"])
    messages = bench.step_messages(args, with_logprobs=True)
    processor = OutputProcessor(None)
    params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, logprobs=2)
    for i in range(3):
        processor.add_request(f"r{i}", None, [5], RequestOutputKind.FINAL_ONLY,
                              [EngineCoreRequest(f"r{i}", [5], params, 4, 0.0)])
    finals = [out for m in messages for out in processor.process_outputs(m)[0]]
    assert sorted(o.request_id for o in finals) == ["r0", "r1", "r2"] and all(o.finished for o in finals)
    for out in finals:
        row = int(out.request_id[1:])
        completion = out.outputs[0]
        assert completion.token_ids == [m.token_ids[row] for m in messages]
        ids, values, _ = zip(*(m.logprobs_blocks[0].arrays() for m in messages))
        assert [next(iter(position)) for position in completion.logprobs] == [int(i[row, 0]) for i in ids]
        assert len(completion.logprobs) == 4 and all(len(p) <= 3 for p in completion.logprobs)


def test_records_every_case(tmp_path):
    report = bench.main(["--tokenizer", str(get_tiny_model_dir()), "--requests", "4", "--steps", "6", "--repeats", "1",
                         "--text-tokens", "40", "--text-buckets", "2", "--results-dir", str(tmp_path),
                         "--output", "frontend"])
    assert len(report["steps"]) == 8 and all(row["ms_per_step"] > 0 for row in report["steps"])
    assert {(r["outputs"], r["text"], r["logprobs"]) for r in report["steps"]} == {
        (o, t, lp) for o in ("at the end", "delta every step") for t in (False, True) for lp in (None, 5)}
    assert len(report["text"]) == 4 and all(len(r["us_per_token_by_position"]) == 2 for r in report["text"])
    assert set(report["logprobs_format_us_per_token"]) == {"chat", "completion"}
    assert json.loads((tmp_path / "frontend.json").read_text())["steps"] == report["steps"]
