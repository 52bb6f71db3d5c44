"""The scheduler alone, driven by a fake runner: its per-step output messages (token deltas, finish
and stop reasons), stop conditions, preemption and async scheduling, against a plain reference."""

from __future__ import annotations

import random

import pytest

from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.sched.request import Request, RequestStatus
from novainfer.core.sched.scheduler import Scheduler, SchedulerConfig
from novainfer.outputs import StepLogprobs
from novainfer.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_model_len: int = 256, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=False))


def add(scheduler: Scheduler, rid: str, prompt_len: int, max_tokens: int = 100, **params) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **params)
    params.update_from_generation_config([EOS])
    request = Request(rid, list(range(10, 10 + prompt_len)), params, max_tokens=max_tokens)
    scheduler.add_request(request)
    return request


class FakeRunner:
    """Samples a scripted token per request (``script[rid]`` in order, then 7s) for every request
    whose whole known sequence a step computes, as the model runner does."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = {rid: list(tokens) for rid, tokens in (script or {}).items()}

    def schedule(self, scheduler: Scheduler):
        """Schedules a step; returns it and what it samples: the requests it gave a placeholder."""
        before = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
        so = scheduler.schedule()
        rids = [rid for rid in so.num_scheduled_tokens
                if scheduler.requests[rid].num_output_placeholders > before.get(rid, 0)]
        tokens = [[self.script[rid].pop(0) if self.script.get(rid) else 7] for rid in rids]
        return so, (rids, tokens)

    def step(self, scheduler: Scheduler):
        so, sampled = self.schedule(scheduler)
        return so, scheduler.update_from_output(*sampled)


def run_to_end(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> dict[str, list]:
    """Every output message per request, in order."""
    messages: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return messages
        _, outputs = runner.step(scheduler)
        for output in outputs:
            messages.setdefault(output.request_id, []).append(output)
    raise AssertionError("the requests did not finish")


def test_outputs_are_one_token_deltas_and_length_finishes_at_max_tokens():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=6, ignore_eos=True)
    add(scheduler, "b", 9, max_tokens=3, ignore_eos=True)
    messages = run_to_end(scheduler, FakeRunner({"a": [3, 4, 5], "b": [EOS, EOS, EOS]}))
    assert [m.new_token_ids for m in messages["a"]] == [[3], [4], [5], [7], [7], [7]]
    assert [m.finish_reason for m in messages["a"]] == [None] * 5 + ["length"]
    assert [m.new_token_ids for m in messages["b"]] == [[EOS]] * 3  # ignore_eos: EOS is a plain token
    assert messages["b"][-1].finish_reason == "length"
    # Only a request's first output carries its admission facts.
    assert messages["a"][0].first_scheduled_time is not None and messages["a"][0].num_cached_tokens == 0
    assert all(m.first_scheduled_time is None and m.num_cached_tokens == -1 for m in messages["a"][1:])
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.running and not scheduler.waiting


def test_eos_and_stop_token_ids_respect_min_tokens():
    scheduler = make_scheduler()
    add(scheduler, "eos", 4)
    add(scheduler, "early-eos", 4, min_tokens=3)
    add(scheduler, "stop-id", 4, stop_token_ids=[99])
    messages = run_to_end(scheduler, FakeRunner({"eos": [5, EOS], "early-eos": [EOS, EOS, EOS],
                                                 "stop-id": [5, 6, 99]}))
    last = {rid: (sum((m.new_token_ids for m in ms), []), ms[-1].finish_reason, ms[-1].stop_reason)
            for rid, ms in messages.items()}
    assert last == {"eos": ([5, EOS], "stop", None), "early-eos": ([EOS, EOS, EOS], "stop", None),
                    "stop-id": ([5, 6, 99], "stop", 99)}


def test_context_length_caps_a_request():
    scheduler = make_scheduler(max_model_len=12)
    add(scheduler, "a", 8, max_tokens=100, ignore_eos=True)
    messages = run_to_end(scheduler, FakeRunner())
    tokens = sum((m.new_token_ids for m in messages["a"]), [])
    assert len(tokens) == 12 - 8 and messages["a"][-1].finish_reason == "length"


def reference_stop(request: Request, tokens: list[int],
                   max_context_len: int) -> tuple[list[int], str | None, int | None]:
    """The stop conditions applied token by token, as plainly as they read: the tokens a request
    takes of ``tokens``, its finish reason and its stop reason."""
    params, num_outputs, num_tokens = request.sampling_params, request.num_output_tokens, request.num_tokens
    for index, token in enumerate(tokens):
        taken = index + 1
        if token in params.all_stop_token_ids and num_outputs + taken >= params.min_tokens:
            return tokens[:taken], "stop", token if token in params.stop_token_ids else None
        if num_outputs + taken >= request.max_tokens or num_tokens + taken >= max_context_len:
            return tokens[:taken], "length", None
    return list(tokens), None, None


@pytest.mark.parametrize("seed", range(8))
def test_steps_of_several_tokens_stop_as_token_by_token(seed):
    """Several tokens per request and step (speculative decoding's accepted drafts), against the
    stop conditions applied token by token: EOS and stop ids under min_tokens, max_tokens and the
    context limit, whichever comes first (a stop id before a limit reached at the same token)."""
    rng = random.Random(seed)
    scheduler = make_scheduler(max_model_len=rng.randint(12, 30))
    for i in range(8):
        max_tokens = rng.randint(1, 12)
        add(scheduler, f"r{i}", rng.randint(2, 10), max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(max_tokens, 4)), stop_token_ids=rng.sample([3, 4], rng.randint(0, 2)),
            ignore_eos=rng.random() < 0.3)
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        _, (rids, _) = FakeRunner().schedule(scheduler)
        tokens = [[rng.choice([EOS, 3, 4, 5, 6]) for _ in range(rng.randint(1, 4))] for _ in rids]
        requests = [scheduler.requests[rid] for rid in rids]
        expected = [reference_stop(r, t, scheduler.max_context_len) for r, t in zip(requests, tokens)]
        outputs_before = [list(r.output_token_ids) for r in requests]
        placeholders = [r.num_output_placeholders for r in requests]
        outputs = scheduler.update_from_output(rids, tokens)
        assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == expected
        for r, before, in_flight, (taken, _, _) in zip(requests, outputs_before, placeholders, expected):
            assert r.output_token_ids == before + taken and r.all_token_ids[r.num_prompt_tokens:] == r.output_token_ids
            assert r.num_output_placeholders == max(in_flight - len(taken), 0)
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_decode_tokens_of_a_step_equal_a_per_request_count(seed):
    """The engine core's count of a step's decode tokens (its step kinds, its prompt tokens): those of
    the requests the workers hold scheduled for their last token and all their drafts."""
    from novainfer.engine.core import _num_decode_tokens

    rng = random.Random(seed)
    scheduler = make_scheduler(budget=rng.randint(4, 24))
    for i in range(6):
        add(scheduler, f"r{i}", rng.randint(2, 20), ignore_eos=True)
    runner = FakeRunner()
    for _ in range(30):
        for r in scheduler.running:  # drafts for the decodes, as the engine core proposes them
            if r.num_computed_tokens == r.num_tokens_with_placeholders - 1:
                r.spec_token_ids = [5] * rng.randint(0, 3)
        so, (rids, tokens) = runner.schedule(scheduler)
        num_scheduled, spec_tokens = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
        assert _num_decode_tokens(so) == sum(num_scheduled[rid] for rid in so.scheduled_cached_reqs.req_ids
                                             if num_scheduled[rid] == 1 + len(spec_tokens.get(rid, ())))
        scheduler.update_from_output(rids, tokens, num_verified_drafts=[len(spec_tokens.get(rid, ())) for rid in rids])


def test_preempted_request_resumes_and_keeps_its_tokens():
    # 6 blocks of 4 tokens: two requests of 8-token prompts cannot both grow past 12 tokens.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    add(scheduler, "first", 8, max_tokens=10, ignore_eos=True)
    add(scheduler, "second", 8, max_tokens=10, ignore_eos=True)
    runner = FakeRunner({"first": list(range(100, 110)), "second": list(range(200, 210))})
    messages: dict[str, list[int]] = {"first": [], "second": []}
    resumed = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        so, outputs = runner.step(scheduler)
        resumed += [new.req_id for new in so.scheduled_new_reqs if new.output_token_ids]
        for output in outputs:
            messages[output.request_id] += output.new_token_ids
    assert scheduler.num_preemptions_total > 0 and "second" in resumed
    # Every request still gets exactly its scripted tokens, once each.
    assert messages == {"first": list(range(100, 110)), "second": list(range(200, 210))}
    assert scheduler.kv_cache_manager.usage == 0.0


def test_async_scheduling_places_placeholders_and_stops_at_the_limit():
    scheduler = make_scheduler()
    scheduler.config.async_scheduling = True
    request = add(scheduler, "a", 4, max_tokens=2, ignore_eos=True)
    runner = FakeRunner({"a": [5, 6]})
    _, first_sampled = runner.schedule(scheduler)  # the prompt; it samples token 1
    assert request.num_output_placeholders == 1
    second, second_sampled = runner.schedule(scheduler)  # scheduled before token 1 is known: it samples token 2
    assert second.num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 2
    # Token 2 takes it to max_tokens: nothing more is scheduled while the two are in flight.
    assert scheduler.schedule().is_empty
    [out1] = scheduler.update_from_output(*first_sampled)
    assert out1.new_token_ids == [5] and out1.finish_reason is None
    [out2] = scheduler.update_from_output(*second_sampled)
    assert out2.new_token_ids == [6] and out2.finish_reason == "length"
    assert not scheduler.has_unfinished_requests()


def test_tokens_of_a_request_finished_while_in_flight_are_dropped():
    scheduler = make_scheduler()
    add(scheduler, "a", 4, ignore_eos=True)
    add(scheduler, "b", 4, ignore_eos=True)
    _, sampled = FakeRunner().schedule(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(*sampled)
    assert [o.request_id for o in outputs] == ["b"]
    assert scheduler.schedule().finished_req_ids == {"a"}  # the workers are told to drop it


@pytest.mark.parametrize("first_row", [-1, 1])
def test_logprobs_travel_with_their_token(first_row):
    scheduler = make_scheduler()
    add(scheduler, "a", 4, max_tokens=1, ignore_eos=True)
    _, (rids, tokens) = FakeRunner().schedule(scheduler)
    block = StepLogprobs.of(2, [5, 1, 7, 3], [-0.1, -2.0, -0.5, -1.5], [1, 1])
    [out] = scheduler.update_from_output(rids, tokens, block, [first_row])
    assert out.new_logprobs == (None if first_row < 0 else (block, 1))



def test_steps_tell_the_workers_each_known_requests_progress_and_new_blocks():
    """A request the workers hold appears in a step's columns with its computed tokens before the
    step and the blocks it got in it; a new or resumed one appears among the new requests with all
    its blocks, never in both. Replaying the messages gives the KV cache manager's block tables,
    through block growth and a preemption."""
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    add(scheduler, "first", 8, max_tokens=10, ignore_eos=True)
    add(scheduler, "second", 8, max_tokens=10, ignore_eos=True)
    runner, tables = FakeRunner(), {}
    grew = resumed = 0
    while scheduler.has_unfinished_requests():
        computed = {rid: r.num_computed_tokens for rid, r in scheduler.requests.items()}
        so, _ = runner.step(scheduler)
        cached, new_ids = so.scheduled_cached_reqs, [new.req_id for new in so.scheduled_new_reqs]
        assert len(cached) == len(cached.new_block_ids) == len(cached.num_computed_tokens)
        assert sorted(cached.req_ids + new_ids) == sorted(so.num_scheduled_tokens)
        for new in so.scheduled_new_reqs:
            resumed += bool(new.output_token_ids)
            tables[new.req_id] = list(new.block_ids)
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            assert num_computed == computed[rid]
            grew += bool(new_blocks)
            tables[rid] += new_blocks
        for rid in so.num_scheduled_tokens:
            if rid in scheduler.requests:  # (a request that finished in this step has freed its blocks)
                assert tables[rid] == scheduler.kv_cache_manager.get_block_ids(rid)
    assert grew and resumed and scheduler.num_preemptions_total


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("lookahead,with_drafts", [(0, False), (3, True)])
def test_skipped_kv_cache_calls_change_nothing(monkeypatch, async_scheduling, prefix_caching, lookahead, with_drafts):
    """The scheduler calls ``allocate_slots`` for a running request only when a step goes past the
    tokens its blocks hold in place: the same steps and outputs as calling it every step, through
    chunked prefill, shared prefixes, preemption, lookahead slots, drafts and async scheduling."""

    def run() -> list:
        kv = KVCacheManager(24, 4, enable_prefix_caching=prefix_caching)
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64,
                                              async_scheduling=async_scheduling,
                                              num_lookahead_tokens=lookahead), kv)
        rng = random.Random(0)
        for i in range(10):
            params = SamplingParams(max_tokens=12 + i, ignore_eos=True)
            params.update_from_generation_config([EOS])
            prompt = [5] * 8 + list(range(10 + i, 10 + i + 3 + 2 * i))  # a shared 8-token prefix
            scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=12 + i))
        log, in_flight = [], None
        while scheduler.has_unfinished_requests():
            for r in scheduler.running:  # drafts for the decodes, as the engine proposes them
                r.spec_token_ids = []
                if with_drafts and r.num_computed_tokens == r.num_tokens_with_placeholders - 1:
                    room = min(r.max_tokens - r.num_output_tokens, scheduler.max_context_len - r.num_tokens)
                    r.spec_token_ids = [9] * max(min(rng.randrange(4), room - r.num_output_placeholders - 1), 0)
            before = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
            so = scheduler.schedule()
            rids = [rid for rid in so.num_scheduled_tokens
                    if scheduler.requests[rid].num_output_placeholders > before.get(rid, 0)]
            drafts = [len(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in rids]
            step = (rids, [[9] * rng.randrange(n + 1) + [7] for n in drafts], None, None, drafts)
            log.append((so, {rid: kv.get_block_ids(rid) for rid in so.num_scheduled_tokens}))
            if async_scheduling:
                step, in_flight = in_flight, step
            if step:
                log.append([(o.request_id, o.new_token_ids, o.finish_reason, o.num_cached_tokens)  # (no times)
                            for o in scheduler.update_from_output(*step)])
            assert len(log) < 2000
        return log + [scheduler.num_preemptions_total, kv.prefix_cache_stats]

    skipping = run()
    monkeypatch.setattr(KVCacheManager, "num_tokens_in_place", lambda *args: -1)  # a call every step
    assert skipping == run()
    assert skipping[-2]  # (the cache is small enough for preemptions)
