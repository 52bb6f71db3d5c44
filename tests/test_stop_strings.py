"""Stop strings: matching, hold-back of possible stop prefixes, and streaming."""

from __future__ import annotations

import random

import pytest

from novainfer.engine.output_text import OutputTextState
from novainfer.engine.stop_strings import StopMatch, StopMatcher, find_stop, partial_stop_len
from tests._tokenizers import load_qwen2_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen2_tokenizer()


# ---------------------------------------------------------------- pure helpers


def naive_partial_stop_len(text: str, stops: list[str]) -> int:
    return max(
        (k for k in range(1, len(text) + 1) for s in stops if k < len(s) and s.startswith(text[-k:])),
        default=0,
    )


def test_partial_stop_len_examples():
    assert partial_stop_len("ABC xyz AB", ["ABCD"]) == 2
    assert partial_stop_len("ABC", ["ABCD"]) == 3
    assert partial_stop_len("ABCD", ["ABCD"]) == 0  # a whole stop string is not a proper prefix
    assert partial_stop_len("xyz", ["ABCD"]) == 0
    assert partial_stop_len("", ["ABCD"]) == 0
    assert partial_stop_len("今天天", ["天气"]) == 1
    assert partial_stop_len("aab", ["ab", "aabc"]) == 3
    assert partial_stop_len("anything", []) == 0


@pytest.mark.parametrize("alphabet", ["ab", "abc", "a天气"])
def test_partial_stop_len_matches_naive(alphabet):
    rng = random.Random(alphabet)
    for _ in range(3000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 12)))
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        assert partial_stop_len(text, stops) == naive_partial_stop_len(text, stops), (text, stops)


def test_find_stop_earliest_wins():
    assert find_stop("one two three", ["three", "two"]) == StopMatch(4, "two")
    assert find_stop("one two three", ["four"]) is None
    # Same start: the shorter one would have been completed first.
    assert find_stop("xabc", ["abc", "ab"]) == StopMatch(1, "ab")
    # Matches starting before search_start are not reported again.
    assert find_stop("two two", ["two"], search_start=1) == StopMatch(4, "two")
    assert StopMatch(4, "two").end == 7


def naive_find_stop(text: str, stops: list[str]) -> StopMatch | None:
    hits = [StopMatch(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return min(hits, key=lambda m: (m.start, len(m.stop)), default=None)


@pytest.mark.parametrize("alphabet", ["ab", "abc", "a天气"])
def test_matcher_fed_in_chunks_matches_naive(alphabet):
    """The automaton read chunk by chunk finds the first match ending in the chunk that completes
    one, as a search of the whole text up to that chunk would."""
    rng = random.Random(alphabet)
    for _ in range(1500):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 14)))
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        matcher, pos, found = StopMatcher(stops), 0, None
        while pos < len(text) and found is None:
            size = rng.randint(1, 4)
            found = matcher.feed(text[pos:pos + size], pos)
            if found is None:
                assert matcher.partial_len() == naive_partial_stop_len(text[:pos + size], stops)
            else:
                assert found == naive_find_stop(text[:pos + size], stops), (text, stops)
            pos += size
        if found is None:
            assert naive_find_stop(text, stops) is None, (text, stops)


# ---------------------------------------------------------- OutputTextState


def run_stream(tokenizer, text, stops, *, include=False, chunk_sizes=(1,), skip=True):
    """Streams ``text`` through an OutputTextState like the engine would.

    Returns (state, matched stop or None, deltas, number of steps fed).
    Checks on every step that the streamed text is a prefix of the text.
    """
    ids = tokenizer.encode(text)
    state = OutputTextState(
        tokenizer,
        tokenizer.encode("<|im_start|>assistant\n"),
        stop=stops,
        include_stop_str_in_output=include,
        skip_special_tokens=skip,
    )
    deltas = []
    matched = None
    pos = 0
    step = 0
    while pos < len(ids) and matched is None:
        size = chunk_sizes[step % len(chunk_sizes)]
        matched = state.append_tokens(ids[pos : pos + size])
        pos += size
        step += 1
        deltas.append(state.take_delta(finished=False))
        assert state.text.startswith("".join(deltas))
    deltas.append(state.take_delta(finished=True))
    assert "".join(deltas) == state.text
    return state, matched, deltas, step


def assert_stop_never_streamed(deltas: list[str], stop: str) -> None:
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert stop not in streamed, deltas


def test_stop_spanning_several_tokens(tokenizer):
    text = "Hello world, the weather today is nice."
    stop = "weather today"
    # " weather" and " today" are separate tokens.
    assert all(stop not in tokenizer.decode([i]) for i in tokenizer.encode(text))

    state, matched, deltas, _ = run_stream(tokenizer, text, [stop])
    assert matched == stop
    assert state.text == "Hello world, the "
    assert_stop_never_streamed(deltas, stop)

    state, matched, deltas, _ = run_stream(tokenizer, text, [stop], include=True)
    assert matched == stop
    assert state.text == "Hello world, the weather today"
    assert "".join(deltas) == "Hello world, the weather today"


def test_stop_ends_inside_a_token(tokenizer):
    # "天天" spans the tokens "今天" and "天气"; the text is cut mid-token.
    text = "你好，世界！今天天气很好。"
    state, matched, deltas, _ = run_stream(tokenizer, text, ["天天"])
    assert matched == "天天"
    assert state.text == "你好，世界！今"
    assert_stop_never_streamed(deltas, "天天")


@pytest.mark.parametrize("include", [False, True])
def test_chinese_stop_string(tokenizer, include):
    text = "你好，世界！今天天气很好。"
    state, matched, deltas, _ = run_stream(tokenizer, text, ["天气"], include=include)
    assert matched == "天气"
    assert state.text == ("你好，世界！今天天气" if include else "你好，世界！今天")
    if not include:
        assert_stop_never_streamed(deltas, "天气")


def test_prefix_that_does_not_complete_is_released(tokenizer):
    text = "ABC xyz ABCD and more"
    state, matched, deltas, steps = run_stream(tokenizer, text, ["ABCD"])
    assert matched == "ABCD"
    assert state.text == "ABC xyz "
    # Tokens: "ABC", " xyz", " ABC", "D". The first "ABC" is held back until
    # " xyz" shows that it does not start the stop string.
    assert deltas[0] == ""
    assert deltas[1] == "ABC xyz"
    assert deltas[2] == " "
    assert steps == 4
    assert_stop_never_streamed(deltas, "ABCD")


def test_held_back_tail_is_released_when_finished(tokenizer):
    state, matched, deltas, _ = run_stream(tokenizer, "The answer is AB", ["ABCD"])
    assert matched is None
    assert state.text == "The answer is AB"
    assert "".join(deltas[:-1]) == "The answer is "
    assert deltas[-1] == "AB"


def test_earliest_of_several_stops_wins(tokenizer):
    text = "你好，世界！今天天气很好。"
    state, matched, _, _ = run_stream(tokenizer, text, ["很好", "世界", "天气"])
    assert matched == "世界"
    assert state.text == "你好，"

    # Both complete in the same chunk: still the one that starts first.
    state, matched, _, _ = run_stream(tokenizer, text, ["很好", "天气"], chunk_sizes=(len(text),))
    assert matched == "天气"
    assert state.text == "你好，世界！今天"


def test_stop_inside_split_emoji(tokenizer):
    text = "🦜🧬𝔘𝔫𝔦 parrots"
    state, matched, deltas, _ = run_stream(tokenizer, text, ["🧬"])
    assert matched == "🧬"
    assert state.text == "🦜"
    assert all("\ufffd" not in d for d in deltas)


def test_special_token_as_stop_string(tokenizer):
    text = "Sure.<|im_end|>trailing"
    state, matched, _, _ = run_stream(tokenizer, text, ["<|im_end|>"], skip=False)
    assert matched == "<|im_end|>"
    assert state.text == "Sure."
    # Skipped special tokens have no text, so they cannot match.
    state, matched, _, _ = run_stream(tokenizer, text, ["<|im_end|>"], skip=True)
    assert matched is None
    assert state.text == "Sure.trailing"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_agree_with_reference(tokenizer, seed, include):
    rng = random.Random(seed)
    texts = [
        "ABC xyz ABCD and more",
        "你好，世界！今天天气很好。",
        "def f(x):\n    return x  # END\n",
        "Good job 🙂👍 — 好的🙂 ok👍!",
        "🦜🧬𝔘𝔫𝔦 parrots",
    ]
    stop_sets = [["ABCD", "more"], ["天气"], ["# END", "\n\n"], ["👍 —", "好的"], ["🧬𝔘", "rot"], ["nomatch"]]
    for text in texts:
        for stops in stop_sets:
            chunk_sizes = tuple(rng.randint(1, 4) for _ in range(8))
            state, matched, deltas, _ = run_stream(tokenizer, text, stops, include=include, chunk_sizes=chunk_sizes)
            # Reference: cut the whole text at the first stop string.
            hits = [(text.find(s), s) for s in stops if s in text]
            if not hits:
                assert matched is None
                assert state.text == text
                continue
            start, stop = min(hits, key=lambda h: (h[0], len(h[1])))
            assert matched == stop, (text, stops, chunk_sizes)
            assert state.text == text[: start + len(stop) if include else start]
            if not include:
                assert_stop_never_streamed(deltas, stop)


def test_append_after_stop_raises(tokenizer):
    state = OutputTextState(tokenizer, [], stop=["world"])
    assert state.append_tokens(tokenizer.encode("hello world")) == "world"
    assert state.text == "hello "
    with pytest.raises(RuntimeError, match="world"):
        state.append_tokens(tokenizer.encode(" again"))


def test_invalid_stop_strings(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        OutputTextState(tokenizer, [], stop=["ok", ""])
    with pytest.raises(TypeError, match="sequence of strings"):
        OutputTextState(tokenizer, [], stop="END")


def test_streaming_more_after_finished_is_rejected(tokenizer):
    state = OutputTextState(tokenizer, [], stop=["ABCD"])
    state.append_tokens(tokenizer.encode("xx AB"))
    assert state.take_delta(finished=True) == "xx AB"
    state.append_tokens(tokenizer.encode("CD"))
    with pytest.raises(RuntimeError, match="already streamed"):
        state.take_delta(finished=False)
