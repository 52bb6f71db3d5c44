"""benchmarks/scheduler.py on CPU: its steps are the steady state it claims (every request decodes one
token per step, none finishes), and the figures are recorded."""

from __future__ import annotations

import json

import pytest

from benchmarks import scheduler as bench


@pytest.mark.parametrize("prefix_caching", ["on", "off"])
def test_every_timed_step_decodes_every_request_once(prefix_caching):
    args = bench.parse_args(["--requests", "6", "--prompt-len", "20", "--block-size", "4", "--warmup", "2",
                             "--steps", "5", "--repeats", "2", "--prefix-caching", prefix_caching])
    scheduler = bench.build_scheduler(args)
    assert len(scheduler.running) == 6 and not scheduler.waiting
    for _ in range(args.warmup + args.steps * args.repeats):
        before = {rid: len(r.output_token_ids) for rid, r in scheduler.requests.items()}
        so = scheduler.schedule()
        assert set(so.num_scheduled_tokens.values()) == {1} and len(so.num_scheduled_tokens) == 6
        assert len(so.scheduled_cached_reqs) == 6 and not so.scheduled_new_reqs
        scheduler.update_from_output(list(so.num_scheduled_tokens), [[7]] * 6)
        assert all(len(r.output_token_ids) == before[rid] + 1 for rid, r in scheduler.requests.items())
    assert len(scheduler.running) == 6  # room left for the timed steps


def test_records_the_best_run(tmp_path):
    report = bench.main(["--requests", "8", "--prompt-len", "10", "--warmup", "1", "--steps", "3", "--repeats", "2",
                         "--results-dir", str(tmp_path), "--output", "sched"])
    saved = json.loads((tmp_path / "sched.json").read_text())
    figures = saved["results"]
    assert saved["workload"]["requests"] == 8 and len(figures["step_us_all_runs"]) == 2
    assert figures["step_us"] == min(figures["step_us_all_runs"]) > 0
    assert figures["step_us"] == pytest.approx(figures["schedule_us"] + figures["update_from_output_us"], abs=0.2)
