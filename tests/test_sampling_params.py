import math

import pytest

from novainfer.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert p.all_stop_token_ids == set()


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"n": 0}, "n", ">= 1"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.1}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 3.0}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": math.nan}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", ">= 0"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "<= max_tokens"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"stop": ""}, "stop", "non-empty"),
        ({"stop": ["ok", ""]}, "stop", "non-empty"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", ">= 0"),
    ],
)
def test_out_of_range_raises_value_error_naming_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert message.startswith(field)
    assert allowed in message
    assert "got" in message


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"n": True}, "n"),
        ({"seed": "42"}, "seed"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"stop": 7}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_wrong_type_raises_type_error_naming_field(kwargs, field):
    with pytest.raises(TypeError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted():
    SamplingParams(
        presence_penalty=-2, frequency_penalty=2, temperature=0, top_p=1, top_k=-1,
        min_p=1.0, max_tokens=None, min_tokens=5, logprobs=20,
    )
    SamplingParams(logprobs=0, min_tokens=16, max_tokens=16, top_p=1e-9)


def test_normalization():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]
    p = SamplingParams(temperature=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)


def test_greedy_resets_truncation_and_sampling_type():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=1)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_eos_ids_join_stop_set_unless_ignore_eos():
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config([2, 3])
    assert p.all_stop_token_ids == {2, 3, 5}
    assert p.stop_token_ids == [5]

    q = SamplingParams(stop_token_ids=[5], ignore_eos=True)
    q.update_from_generation_config([2])
    assert q.all_stop_token_ids == {5}


def test_clone_is_independent():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=9)
    c = p.clone()
    assert c == p and c is not p
    c.update_from_generation_config([2])
    c.stop.append("y")
    c.stop_token_ids.append(3)
    assert p.all_stop_token_ids == {1}
    assert p.stop == ["x"] and p.stop_token_ids == [1]


def test_seed_outside_64_bits_is_rejected():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=2**64 - 1)  # the largest a torch.Generator accepts
