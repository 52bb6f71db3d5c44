"""The prompt budget of steps that also decode (``max_mixed_step_tokens``), against a plain count."""

from __future__ import annotations

import pytest

from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.sched.scheduler import MIN_MIXED_PROMPT_CHUNK, Scheduler, SchedulerConfig
from novainfer.core.sched.request import Request
from novainfer.sampling_params import SamplingParams


def _scheduler(bound: int | None, max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max_num_seqs, max_model_len=4096,
                             max_mixed_step_tokens=bound)
    return Scheduler(config, KVCacheManager(4096, 16, enable_prefix_caching=False))


def _add(scheduler: Scheduler, rid: str, num_prompt: int) -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    scheduler.add_request(Request(rid, list(range(1, num_prompt + 1)), params, max_tokens=100))


def _run_step(scheduler: Scheduler) -> dict[str, int]:
    out = scheduler.schedule()
    sampled = [rid for rid, n in out.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens]
    scheduler.update_from_output(sampled, [[7]] * len(sampled))
    return out.num_scheduled_tokens


@pytest.mark.parametrize("bound", [None, 256])
def test_prompts_fill_a_decoding_step_only_up_to_the_bound(bound):
    scheduler = _scheduler(bound)
    for i in range(10):
        _add(scheduler, f"d{i}", 5)
    assert sum(_run_step(scheduler).values()) == 50  # no decodes yet: the whole budget
    _add(scheduler, "long", 3000)
    step = _run_step(scheduler)
    decodes = sum(1 for rid, n in step.items() if rid.startswith("d") and n == 1)
    assert decodes == 10
    assert step["long"] == (3000 if bound is None else bound - 10)
    while scheduler.requests["long"].num_computed_tokens < 3000:
        assert sum(_run_step(scheduler).values()) <= (4096 if bound is None else bound)


def test_prompts_still_flow_when_decodes_alone_fill_the_bound():
    scheduler = _scheduler(bound=32)
    for i in range(40):
        _add(scheduler, f"d{i}", 3)
    _run_step(scheduler)
    _add(scheduler, "late", 500)
    step = _run_step(scheduler)
    assert step["late"] == MIN_MIXED_PROMPT_CHUNK and sum(1 for n in step.values() if n == 1) == 40


def test_a_step_without_decodes_takes_the_whole_budget():
    scheduler = _scheduler(bound=256)
    _add(scheduler, "a", 3000)
    assert _run_step(scheduler) == {"a": 3000}


def test_the_bound_is_validated():
    with pytest.raises(ValueError, match="max_mixed_step_tokens"):
        SchedulerConfig(max_mixed_step_tokens=0)
