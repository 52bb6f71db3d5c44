"""Bad input raises an error that names the culprit, and the engine keeps serving afterwards.

Also: the request status state machine, request timestamps, parallel configuration checks and
requests too large for the KV cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.config import ParallelConfig, normalize_parallel_config
from novainfer.core.sched.request import InvalidStatusTransition, Request, RequestStatus
from novainfer.outputs import RequestMetrics
from tests.utils import hf_greedy, random_ids

MAX_MODEL_LEN = 48
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), block_size=4, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def good_prompt(vocab_size):
    return random_ids(7, 11, vocab_size)


@pytest.fixture(scope="module")
def expected(model_dir, good_prompt):
    return hf_greedy(model_dir, good_prompt, GREEDY.max_tokens)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert not engine.engine_core.scheduler.requests and not engine.engine_core.scheduler.waiting and not engine.engine_core.scheduler.running
    assert not engine.output_processor.parents and not engine.output_processor.children


def assert_still_serves(llm: LLM, good_prompt, expected) -> None:
    assert_no_leaks(llm)
    [out] = llm.generate({"prompt_token_ids": good_prompt}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    assert_no_leaks(llm)


# ---------------------------------------------------------------- bad prompts


def test_prompt_longer_than_max_model_len(llm, good_prompt, expected):
    too_long = (good_prompt * 5)[:MAX_MODEL_LEN + 3]
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": too_long}, GREEDY, use_tqdm=False)
    message = str(info.value)
    assert str(MAX_MODEL_LEN + 3) in message and str(MAX_MODEL_LEN) in message and "max_model_len" in message
    assert_still_serves(llm, good_prompt, expected)


def test_prompt_of_exactly_max_model_len_gives_one_token(llm, good_prompt):
    prompt = (good_prompt * 5)[:MAX_MODEL_LEN]
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, []], ids=["empty-str", "empty-ids", "empty-list"])
def test_empty_prompt(llm, good_prompt, expected, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.llm_engine.add_request("empty", prompt, GREEDY)
    assert_still_serves(llm, good_prompt, expected)


@pytest.mark.parametrize("bad_id", ["vocab", -1, 1.5, "7", True], ids=["vocab", "negative", "float", "str", "bool"])
def test_out_of_vocab_or_non_int_token_id(llm, vocab_size, good_prompt, expected, bad_id):
    bad_id = vocab_size if bad_id == "vocab" else bad_id
    with pytest.raises(ValueError, match="prompt_token_ids") as info:
        llm.generate({"prompt_token_ids": good_prompt[:3] + [bad_id]}, GREEDY, use_tqdm=False)
    assert repr(bad_id) in str(info.value)
    assert_still_serves(llm, good_prompt, expected)


def test_bad_prompt_types(llm, good_prompt, expected):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "hello"}, GREEDY, use_tqdm=False)
    for not_prompts in (None, 42):
        with pytest.raises(TypeError, match=f"prompts must be .*got {type(not_prompts).__name__}"):
            llm.generate(not_prompts, GREEDY, use_tqdm=False)
    # Any iterable of prompts is a batch.
    assert len(llm.generate((p for p in ["hello", "there"]), GREEDY, use_tqdm=False)) == 2
    with pytest.raises(TypeError, match="prompt"):
        llm.llm_engine.add_request("bad-type", 3.5, GREEDY)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.llm_engine.add_request("bad-params", {"prompt_token_ids": good_prompt}, {"temperature": 0})
    assert_still_serves(llm, good_prompt, expected)


def test_one_bad_prompt_fails_the_batch_and_leaves_nothing_behind(llm, vocab_size, good_prompt, expected):
    batch = [{"prompt_token_ids": good_prompt}, {"prompt_token_ids": good_prompt[:5]},
             {"prompt_token_ids": [vocab_size + 5]}, {"prompt_token_ids": good_prompt}]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(batch[:2], [GREEDY], use_tqdm=False)  # one SamplingParams for two prompts
    with pytest.raises(ValueError, match="prompt"):
        list(llm.generate_stream([{"prompt_token_ids": good_prompt}, ""], GREEDY))
    assert_still_serves(llm, good_prompt, expected)
    # The good prompts of the failed batch work as a batch of their own.
    outs = llm.generate([batch[0], batch[3]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


def test_duplicate_request_id(llm, good_prompt, expected):
    engine = llm.llm_engine
    engine.add_request("dup", {"prompt_token_ids": good_prompt}, GREEDY)
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", {"prompt_token_ids": good_prompt[:4]}, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["dup"]
    assert finished[0].outputs[0].token_ids == expected
    assert_still_serves(llm, good_prompt, expected)


# ---------------------------------------------------------------- bad sampling parameters

BAD_SAMPLING_PARAMS = [
    ("temperature", dict(temperature=-1)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=2)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("max_tokens", dict(max_tokens=0)),
    ("n", dict(n=0)),
    ("logprobs", dict(logprobs=50)),
    ("logprobs", dict(logprobs=-1)),
    ("min_tokens", dict(min_tokens=10, max_tokens=5)),
    ("min_tokens", dict(min_tokens=-1)),
    ("temperature", dict(temperature=float("nan"))),
    ("n", dict(n=2.0)),
    ("top_k", dict(top_k=True)),
    ("seed", dict(seed="1")),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[1])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("ignore_eos", dict(ignore_eos="yes")),
]


@pytest.mark.parametrize("field,kwargs", BAD_SAMPLING_PARAMS,
                         ids=[f"{f}={list(k.values())}" for f, k in BAD_SAMPLING_PARAMS])
def test_out_of_range_sampling_params_name_the_field(field, kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value)


def test_good_sampling_params_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=0, presence_penalty=2, frequency_penalty=-2,
                   repetition_penalty=0.01, max_tokens=1, n=1, logprobs=20, min_tokens=1)
    assert SamplingParams(top_k=-1).top_k == 0


# ---------------------------------------------------------------- engine arguments


def test_unknown_engine_argument_is_a_type_error_naming_it(model_dir):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(str(model_dir), gpu_memory_utilisation=0.5)


@pytest.mark.parametrize("kwargs,error,field", [
    (dict(block_size=3), ValueError, "block_size"),
    (dict(num_gpu_blocks_override=0), ValueError, "num_gpu_blocks_override"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_batched_tokens=-1), ValueError, "max_num_batched_tokens"),
    (dict(max_model_len=10 ** 6), ValueError, "max_model_len"),
    (dict(dtype="float8"), ValueError, "dtype"),
])
def test_bad_engine_argument_values(model_dir, kwargs, error, field):
    with pytest.raises(error, match=field):
        LLM(str(model_dir), **kwargs)


# ---------------------------------------------------------------- parallel configuration


def test_unimplemented_executor_backend(model_dir):
    with pytest.raises(NotImplementedError, match="ray"):
        LLM(str(model_dir), distributed_executor_backend="ray")


def test_unknown_executor_backend(model_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend") as info:
        LLM(str(model_dir), distributed_executor_backend="foo")
    assert "'foo'" in str(info.value)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_tensor_parallel_size(size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        normalize_parallel_config(ParallelConfig(tensor_parallel_size=size))


def test_parallel_config_device_ids():
    with pytest.raises(ValueError, match="duplicate"):
        normalize_parallel_config(ParallelConfig(tensor_parallel_size=2, tensor_parallel_device_ids=[0, 0]))
    with pytest.raises(ValueError, match="tensor_parallel_device_ids"):
        normalize_parallel_config(ParallelConfig(tensor_parallel_size=1, tensor_parallel_device_ids=[0, 1]))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        normalize_parallel_config(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(NotImplementedError, match="nnodes"):
        normalize_parallel_config(ParallelConfig(nnodes=2))
    cfg = normalize_parallel_config(ParallelConfig())
    assert cfg.world_size == 1 and cfg.tensor_parallel_device_ids == [0] and cfg.use_single_process_tp
    cfg = normalize_parallel_config(ParallelConfig(tensor_parallel_device_ids=[3]), torch.device("cpu"))
    assert cfg.tensor_parallel_device_ids == [3]


# ---------------------------------------------------------------- KV cache capacity


def test_request_too_large_for_the_whole_kv_cache(model_dir, vocab_size):
    small = LLM(str(model_dir), block_size=4, num_gpu_blocks_override=4)  # 16 tokens in all
    prompt = random_ids(3, 20, vocab_size)
    with pytest.raises(ValueError) as info:
        small.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert "16" in str(info.value) and "20" in str(info.value) and "KV cache" in str(info.value)
    assert_no_leaks(small)
    # A prompt that fits but whose output cannot: the context is capped by what the cache holds,
    # and the request ends with "length" instead of waiting forever.
    [out] = small.generate({"prompt_token_ids": prompt[:14]}, GREEDY, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 16 - 14
    assert completion.token_ids == hf_greedy(model_dir, prompt[:14], 2)
    assert_no_leaks(small)


# ---------------------------------------------------------------- request status and timestamps


def make_request() -> Request:
    return Request("r", [5, 6, 7], SamplingParams(), max_tokens=4)


@pytest.mark.parametrize("path,illegal", [
    ([], RequestStatus.PREEMPTED),  # WAITING -> PREEMPTED
    ([], RequestStatus.FINISHED_LENGTH_CAPPED),  # never ran, cannot hit its length
    ([RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED], RequestStatus.RUNNING),
    ([RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED], RequestStatus.WAITING),
    ([RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED], RequestStatus.FINISHED_STOPPED),
    ([RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED], RequestStatus.FINISHED_LENGTH_CAPPED),
    ([RequestStatus.RUNNING], RequestStatus.RUNNING),
    ([RequestStatus.RUNNING], RequestStatus.FINISHED_IGNORED),
    ([RequestStatus.RUNNING, RequestStatus.PREEMPTED], RequestStatus.WAITING),
    ([RequestStatus.RUNNING, RequestStatus.PREEMPTED], RequestStatus.PREEMPTED),
])
def test_illegal_status_transitions_raise(path, illegal):
    request = make_request()
    for status in path:
        request.set_status(status)
    before = request.status
    with pytest.raises(InvalidStatusTransition) as info:
        request.set_status(illegal)
    assert before.name in str(info.value) and illegal.name in str(info.value)
    assert request.status == before  # unchanged


def test_legal_status_lifecycle():
    request = make_request()
    assert request.status == RequestStatus.WAITING and not request.is_finished()
    for status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.RUNNING,
                   RequestStatus.FINISHED_STOPPED):
        request.set_status(status)
    assert request.is_finished() and request.get_finished_reason() == "stop"
    assert request.metrics.finished_time is not None and request.metrics.first_scheduled_time is not None
    waiting = make_request()
    waiting.set_status(RequestStatus.FINISHED_ABORTED)  # aborted before it ever ran
    assert waiting.get_finished_reason() == "abort" and waiting.metrics.first_scheduled_time is None


def test_an_output_keeps_the_times_it_was_made_with():
    live = RequestMetrics(**{f.name: float(i + 1) for i, f in enumerate(dataclasses.fields(RequestMetrics))})
    kept = live.snapshot()
    assert kept == live and kept is not live  # every field copied
    live.last_token_time = 99.0
    assert kept.last_token_time == 4.0


def test_timestamps_are_set_and_ordered(llm, good_prompt):
    [out] = llm.generate({"prompt_token_ids": good_prompt}, GREEDY, use_tqdm=False)
    m = out.metrics
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
    assert None not in times
    assert times == sorted(times)
    # An aborted request that never ran has an arrival and a finish time only.
    engine = llm.llm_engine
    engine.add_request("never-ran", {"prompt_token_ids": good_prompt}, GREEDY)
    [aborted] = engine.abort_request("never-ran")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.metrics.first_scheduled_time is None and aborted.metrics.first_token_time is None
    assert aborted.metrics.arrival_time <= aborted.metrics.finished_time
    assert_no_leaks(llm)
