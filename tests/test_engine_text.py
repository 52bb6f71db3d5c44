"""Text through the whole engine with the real Qwen2 tokenizer: stop strings, stop tokens,
min_tokens, streaming (Chinese text, multi-byte characters split across tokens) and chat.

A random model's text cannot be predicted, so each test first generates greedily without a
stop condition, picks its stop condition from that output, and regenerates: greedy decoding
gives the same tokens up to the point where the stop condition ends the output.
"""

from __future__ import annotations

import pytest
import torch

from novainfer import LLM, SamplingParams
from tests._tokenizers import load_qwen2_tokenizer
from tests.utils import hf_logits, qwen2_tokenizer_model

PROMPTS = ["今天天气很好，我们一起去", "北京是中国的首都，上海是", "你好，请问你叫什么名字？"]
NUM_TOKENS = 30
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen2_tokenizer()  # skips the module when the tokenizer is absent


@pytest.fixture(scope="module")
def model_dir(tokenizer):
    return qwen2_tokenizer_model()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def llm(model_dir, request):
    """Each test runs with each step fetched before the next is scheduled, and pipelined."""
    return LLM(str(model_dir), block_size=16, num_gpu_blocks_override=64, async_scheduling=request.param)


@pytest.fixture(scope="module")
def free_runs(llm):
    """Greedy outputs of every prompt without any stop condition."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {prompt: out.outputs[0] for prompt, out in zip(PROMPTS, outputs)}


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(llm, prompts, params) -> tuple[dict[str, list[str]], dict[str, list[list[int]]], dict]:
    """Runs generate_stream; returns per request id its text deltas, token deltas and final output."""
    deltas, token_deltas, final = {}, {}, {}
    for out in llm.generate_stream(prompts, params):
        assert out.request_id not in final, "output after the final one"
        [completion] = out.outputs
        deltas.setdefault(out.request_id, []).append(completion.delta_text)
        token_deltas.setdefault(out.request_id, []).append(completion.delta_token_ids)
        if out.finished:
            final[out.request_id] = out
    return deltas, token_deltas, final


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert not engine.engine_core.scheduler.requests and not engine.output_processor.parents


def pick_stop_string(tokenizer, ids: list[int], text: str) -> tuple[str, int]:
    """A 2-character stop string straddling a token boundary near the middle of ``text``.

    Returns the string and where it first occurs. Prefers Chinese, then other non-ASCII characters.
    """
    boundaries = set()
    for k in range(1, len(ids)):
        prefix = decode(tokenizer, ids[:k])
        if REPLACEMENT not in prefix and text.startswith(prefix):
            boundaries.add(len(prefix))
    candidates = []
    for b in sorted(boundaries):
        stop = text[b - 1:b + 1]
        if b < 2 or len(stop) != 2 or REPLACEMENT in stop or stop.isspace() or text.find(stop) != b - 1:
            continue
        candidates.append((not any(is_cjk(c) for c in stop), stop.isascii(), abs(b - len(text) / 2), stop, b - 1))
    assert candidates, f"no usable stop string in {text!r}"
    *_, stop, start = min(candidates)
    return stop, start


def is_cjk(char: str) -> bool:
    return "\u4e00" <= char <= "\u9fff"


def test_final_texts_decoded_together_equal_the_streamed_texts(llm, tokenizer):
    """LLM.generate decodes its final texts once every request finished, in batched calls; each
    equals the text streamed for the same (seeded) request and, where the tokens end on a whole
    character, the tokenizer's decode of the tokens."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=NUM_TOKENS, ignore_eos=True,
                             skip_special_tokens=i % 2 == 0) for i in range(2 * len(PROMPTS))]
    prompts = PROMPTS * 2
    outputs = llm.generate(prompts, params, use_tqdm=False)
    deltas, _, final = stream(llm, prompts, params)
    streamed = [final[rid] for rid in sorted(final, key=int)]
    for out, streamed_out, p in zip(outputs, streamed, params):
        [completion], [streamed_completion] = out.outputs, streamed_out.outputs
        assert completion.token_ids == streamed_completion.token_ids
        assert completion.text == "".join(deltas[streamed_out.request_id]) == streamed_completion.text
        whole = tokenizer.decode(completion.token_ids, skip_special_tokens=p.skip_special_tokens,
                                 clean_up_tokenization_spaces=False)
        if not whole.endswith(REPLACEMENT):
            assert completion.text == whole
    assert_no_leaks(llm)


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stop_string_streaming_and_final_text(llm, tokenizer, free_runs, prompt):
    free = free_runs[prompt]
    assert len(free.token_ids) == NUM_TOKENS and free.finish_reason == "length"
    stop, start = pick_stop_string(tokenizer, free.token_ids, free.text)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop])

    deltas, token_deltas, final = stream(llm, prompt, params)
    [(rid, out)] = final.items()
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.text == free.text[:start]
    assert stop not in completion.text
    assert "".join(deltas[rid]) == completion.text
    for delta in deltas[rid]:
        assert stop not in delta
        if REPLACEMENT not in completion.text:
            assert REPLACEMENT not in delta
    # The tokens are the free run's up to the one that completed the stop string.
    ids = completion.token_ids
    assert ids == free.token_ids[:len(ids)]
    assert stop in decode(tokenizer, ids) and stop not in decode(tokenizer, ids[:-1])
    assert [t for d in token_deltas[rid] for t in d] == ids

    # generate (not streaming) gives the same result.
    [plain] = llm.generate(prompt, params, use_tqdm=False)
    assert plain.outputs[0].text == completion.text
    assert plain.outputs[0].token_ids == ids
    assert plain.outputs[0].stop_reason == stop
    assert_no_leaks(llm)


def test_include_stop_str_in_output(llm, tokenizer, free_runs):
    prompt = PROMPTS[0]
    free = free_runs[prompt]
    stop, start = pick_stop_string(tokenizer, free.token_ids, free.text)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=True)
    deltas, _, final = stream(llm, prompt, params)
    [(rid, out)] = final.items()
    completion = out.outputs[0]
    assert completion.text == free.text[:start + len(stop)]
    assert completion.text.endswith(stop)
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert "".join(deltas[rid]) == completion.text
    [plain] = llm.generate(prompt, params, use_tqdm=False)
    assert plain.outputs[0].text == completion.text


def test_streaming_several_prompts_at_once(llm, tokenizer, free_runs):
    stops = [pick_stop_string(tokenizer, free_runs[p].token_ids, free_runs[p].text)[0] for p in PROMPTS]
    params = [
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stops[0]]),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stops[2], "never seen"],
                       include_stop_str_in_output=True),
    ]
    deltas, token_deltas, final = stream(llm, PROMPTS, params)
    assert len(final) == len(PROMPTS)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, reference in zip(sorted(final.values(), key=lambda o: int(o.request_id)), plain):
        rid = out.request_id
        completion = out.outputs[0]
        assert out.prompt == reference.prompt
        assert "".join(deltas[rid]) == completion.text == reference.outputs[0].text
        assert [t for d in token_deltas[rid] for t in d] == completion.token_ids == reference.outputs[0].token_ids
        if REPLACEMENT not in completion.text:
            assert all(REPLACEMENT not in d for d in deltas[rid])
    # Without a stop string, the text is the free run's (all 30 tokens).
    middle = plain[1].outputs[0]
    assert middle.text == free_runs[PROMPTS[1]].text and middle.finish_reason == "length"
    assert plain[2].outputs[0].text.endswith(stops[2])
    assert_no_leaks(llm)


def test_streamed_text_of_split_characters_has_no_replacement_char(llm, tokenizer):
    """Rare CJK characters and emoji take several byte-level tokens: nothing half-done is streamed."""
    text = "𠮷野家🥃龘靐齉"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "expected characters split over several tokens"
    prompt_ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    # Feed the split characters as the prompt's continuation: greedy output of the model then
    # follows; whatever it is, the streamed deltas must add up and never hold a half character
    # unless the final text does.
    deltas, _, final = stream(llm, {"prompt_token_ids": prompt_ids + ids[:-1]},
                              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    [(rid, out)] = final.items()
    completion = out.outputs[0]
    assert "".join(deltas[rid]) == completion.text
    if REPLACEMENT not in completion.text:
        assert all(REPLACEMENT not in d for d in deltas[rid])


# ---------------------------------------------------------------- stop tokens, length, min_tokens


def test_stop_token_ids(llm, tokenizer, free_runs):
    prompt = PROMPTS[0]
    free = free_runs[prompt]
    stop_id = free.token_ids[4]
    k = free.token_ids.index(stop_id) + 1  # where it first appears (the 5th token, or earlier)
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == free.token_ids[:k]
    assert completion.token_ids[-1] == stop_id
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id
    # Its text excludes the stop token's: it is the text of the tokens before it...
    before = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=k - 1, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0] if k > 1 else None
    assert completion.text == (before.text if before else "")
    # ...unless asked to include it.
    [included] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                                     stop_token_ids=[stop_id], include_stop_str_in_output=True),
                              use_tqdm=False)
    upto = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert included.outputs[0].text == upto.text
    assert included.outputs[0].token_ids == completion.token_ids


def test_max_tokens_finishes_with_length(llm, free_runs):
    prompt = PROMPTS[1]
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.token_ids == free_runs[prompt].token_ids[:7]
    assert free_runs[prompt].text.startswith(completion.text)


def oracle_with_min_tokens(model_dir, prompt_ids, stop_ids, min_tokens, max_tokens) -> list[int]:
    """Greedy decoding with transformers' logits: stop ids are banned until min_tokens outputs
    exist, and end the output (included) afterwards."""
    out: list[int] = []
    while len(out) < max_tokens:
        logits = hf_logits(model_dir, prompt_ids + out)[-1].clone()
        if len(out) < min_tokens:
            logits[list(stop_ids)] = float("-inf")
        token = int(torch.argmax(logits))
        out.append(token)
        if token in stop_ids:
            break
    return out


def test_min_tokens_holds_back_eos_and_stop_tokens(llm, tokenizer, model_dir, free_runs):
    prompt = PROMPTS[2]
    free = free_runs[prompt]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    eos_ids = set(llm.llm_engine.eos_token_ids)
    assert tokenizer.eos_token_id in eos_ids
    first = free.token_ids[0]
    # The first token the model wants is a stop token: without min_tokens the output ends at once.
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first]),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == [first] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == first

    # A later token of the free run, not seen before it: min_tokens below its position does not
    # change the tokens (it was never the argmax earlier), so the output stops right there.
    late_pos = next(i for i in range(5, NUM_TOKENS) if free.token_ids[i] not in free.token_ids[:i])
    late = free.token_ids[late_pos]
    # min_tokens with EOS among the stop token ids: neither EOS nor a stop id may end the output early.
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop_token_ids=[first, tokenizer.eos_token_id]),
         {first, tokenizer.eos_token_id}),
        (SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=3, stop_token_ids=[late]), {late}),
    ]
    outputs = llm.generate([prompt] * len(cases), [params for params, _ in cases], use_tqdm=False)
    for (params, stop_ids), out in zip(cases, outputs):
        completion = out.outputs[0]
        expected = oracle_with_min_tokens(model_dir, prompt_ids, stop_ids | eos_ids, params.min_tokens,
                                          params.max_tokens)
        assert completion.token_ids == expected
        assert len(completion.token_ids) >= params.min_tokens
        assert not (stop_ids | eos_ids) & set(completion.token_ids[:params.min_tokens])
        if expected[-1] in stop_ids | eos_ids:
            assert completion.finish_reason == "stop"
            assert completion.stop_reason == (expected[-1] if expected[-1] in stop_ids else None)
        else:
            assert completion.finish_reason == "length"
    # The second case is exactly the free run cut after the late stop token.
    assert outputs[1].outputs[0].token_ids == free.token_ids[:late_pos + 1]
    assert outputs[1].outputs[0].stop_reason == late
    assert_no_leaks(llm)


# ---------------------------------------------------------------- chat


def test_chat_applies_the_chat_template(llm, tokenizer):
    messages = [{"role": "user", "content": "你好"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 may return a BatchEncoding
        expected = expected["input_ids"]
    expected_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected_text.endswith("<|im_start|>assistant\n")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [out] = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt_token_ids == list(expected)
    assert out.prompt == expected_text
    assert len(out.outputs[0].token_ids) == 4
    # The chat reply is the plain generation from the templated prompt.
    [plain] = llm.generate({"prompt_token_ids": list(expected)}, params, use_tqdm=False)
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids

    # Several conversations at once.
    conversations = [messages, [{"role": "system", "content": "你是一个助手。"}, {"role": "user", "content": "北京"}]]
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == list(expected)
    second = tokenizer.apply_chat_template(conversations[1], tokenize=False, add_generation_prompt=True)
    assert outs[1].prompt == second
    assert outs[1].prompt_token_ids == tokenizer.encode(second, add_special_tokens=False)


def test_detokenize_false_gives_the_same_tokens_without_text(llm, free_runs):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output, prompt in zip(outputs, PROMPTS):
        completion = output.outputs[0]
        assert completion.token_ids == free_runs[prompt].token_ids
        assert completion.text == ""
        assert all(lp.decoded_token is None for entry in completion.logprobs for lp in entry.values())


def test_detokenize_false_rejects_stop_strings():
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["。"], detokenize=False)


def test_final_only_requests_produce_one_output(llm, free_runs):
    from novainfer import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final-only", PROMPTS[0], params)
    engine.add_request("cumulative", PROMPTS[0], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                ignore_eos=True))
    seen: dict[str, list] = {"final-only": [], "cumulative": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["cumulative"]) == NUM_TOKENS
    [final] = seen["final-only"]
    assert final.finished
    assert final.outputs[0].token_ids == free_runs[PROMPTS[0]].token_ids
    assert final.outputs[0].text == free_runs[PROMPTS[0]].text
