"""Incremental detokenization against the real Qwen2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import random

import pytest

from novainfer.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from novainfer.engine.output_text import OutputTextState
from tests._tokenizers import load_qwen2_tokenizer

TEXTS = {
    "english": "Hello world! The quick brown fox jumps over the lazy dog, twice.",
    "chinese": "你好，世界！今天天气很好。",
    "emoji_mixed": "Good job 🙂👍 — 好的🙂 ok👍!",
    "japanese": "こんにちは、世界。今日はいい天気ですね。",
    # Characters that Qwen2 splits into several byte-level tokens.
    "split_emoji": "🦜🧬𝔘𝔫𝔦 parrots",
    "split_chinese": "龘靐齉",
    "code": "def f(x):\n    if x:\n        return [i * 2 for i in x]\n\treturn None\n",
    "special_tokens": "<|im_start|>assistant\nSure, here it is.<|im_end|>\n<|im_end|>",
}

# Texts where some character is spread over several tokens.
SPLIT_TEXTS = ("split_emoji", "split_chinese")


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen2_tokenizer()


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    """Feeds ``ids`` in chunks of the given sizes (cycled) and returns every delta."""
    deltas = []
    pos = 0
    step = 0
    while pos < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)]
        deltas.append(detokenizer.add_tokens(ids[pos : pos + size]))
        pos += size
        step += 1
    return deltas


def check_deltas(tokenizer, ids: list[int], deltas: list[str], skip: bool) -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "\ufffd" not in expected
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas), deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_matches_full_decode(tokenizer, name, skip):
    ids = tokenizer.encode(TEXTS[name])
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    deltas = stream(detokenizer, ids, [1])
    check_deltas(tokenizer, ids, deltas, skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunks_match_full_decode(tokenizer, seed, skip):
    rng = random.Random(seed)
    for name in sorted(TEXTS):
        ids = tokenizer.encode(TEXTS[name])
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        chunk_sizes = [rng.randint(1, 4) for _ in range(len(ids))]
        deltas = stream(detokenizer, ids, chunk_sizes)
        check_deltas(tokenizer, ids, deltas, skip)


@pytest.mark.parametrize("name", SPLIT_TEXTS)
def test_incomplete_character_is_held_back(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    # The text must really contain a token that is not a whole character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)

    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detokenizer, ids, [1])
    held = [i for i, d in enumerate(deltas) if d == ""]
    assert held, deltas
    # The step after a held-back one releases the completed character.
    first = held[0]
    assert deltas[first + 1] == TEXTS[name][0]
    assert "".join(deltas) == TEXTS[name]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Done.<|im_end|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    deltas = stream(detokenizer, ids, [1])
    assert deltas[-1] == ("" if skip else "<|im_end|>")
    assert "".join(deltas) == ("Done." if skip else "Done.<|im_end|>")


def test_prompt_is_context_only(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay hi in Chinese 🙂<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode("你好！ Hello 🦜 there")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = stream(detokenizer, output, [1])
    assert "".join(deltas) == "你好！ Hello 🦜 there"
    assert deltas[0] == "你好"


def test_prompt_ending_inside_a_character_is_not_used_as_context(tokenizer):
    ids = tokenizer.encode("龘 is rare")
    # The prompt holds the first bytes of 龘, the output the remaining ones.
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:1])
    deltas = stream(detokenizer, ids[1:], [1])
    # The output is decoded on its own, so its orphan bytes become U+FFFD,
    # exactly as decoding the output ids alone does.
    assert "".join(deltas) == tokenizer.decode(ids[1:])
    assert "".join(deltas).endswith(" is rare")


def test_empty_add_returns_empty(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    assert detokenizer.add_tokens([]) == ""


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.decode_lengths.append(len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)


def test_cost_per_token_does_not_grow_with_output_length(tokenizer):
    text = " ".join(TEXTS.values()) * 20
    ids = tokenizer.encode(text)
    assert len(ids) > 1000
    counting = CountingTokenizer(tokenizer)
    prompt = tokenizer.encode("a fairly long prompt " * 50)
    detokenizer = IncrementalDetokenizer(counting, prompt, skip_special_tokens=False)
    assert "".join(stream(detokenizer, ids, [1])) == tokenizer.decode(ids)
    # Windows only span the last emitted tokens plus a few incomplete ones.
    assert max(counting.decode_lengths) <= 10


class SlowPath:
    """The tokenizer without its fast backend: the detokenizer falls back to decoding windows."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids, **kwargs):
        return self._tokenizer.decode(token_ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_decoder_agrees_with_windows_on_random_ids(tokenizer, seed, skip):
    """Random ids (byte tokens that leave characters unfinished or orphaned, special tokens,
    spaces) in random chunks, after a random prompt: the fast tokenizer's streaming decoder and
    the window algorithm return the same deltas, and the text is the full decode's, less an
    unfinished character at the end."""
    rng = random.Random(seed)
    special = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    byte_tokens = [i for i in range(200, 2000) if "\ufffd" in tokenizer.decode([i])][:50]
    pool = list(range(len(tokenizer))) + special * 200 + byte_tokens * 100
    prompt = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
    ids = [rng.choice(pool) for _ in range(400)]
    chunks = [rng.randint(1, 3) for _ in ids]
    fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    assert fast._stream is not None, "the Qwen2 tokenizer is a fast one: the streaming decoder must be used"
    slow = IncrementalDetokenizer(SlowPath(tokenizer), prompt, skip_special_tokens=skip)
    fast_deltas, slow_deltas = stream(fast, ids, chunks), stream(slow, ids, chunks)
    assert fast_deltas == slow_deltas
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    text = "".join(fast_deltas)
    assert full.startswith(text) and set(full[len(text):]) <= {"\ufffd"}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_deferred_text_equals_the_streamed_text(tokenizer, seed, skip):
    """A request that wants only its final text decodes once; at every length (ending inside a
    character or not) that text is what feeding the tokens step by step would have built."""
    rng = random.Random(seed)
    byte_tokens = [i for i in range(200, 2000) if "\ufffd" in tokenizer.decode([i])][:50]
    pool = list(range(len(tokenizer))) + byte_tokens * 300
    prompt = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
    ids = [rng.choice(pool) for _ in range(120)]
    streamed = OutputTextState(tokenizer, prompt, skip_special_tokens=skip)
    deferred = OutputTextState(tokenizer, prompt, skip_special_tokens=skip, defer=True)
    for token in ids:
        streamed.append_tokens([token])
        deferred.append_tokens([token])
        if rng.random() < 0.2:  # reads in between leave later reads right
            assert deferred.text == streamed.text
    assert deferred.text == streamed.text
    assert deferred.take_delta(finished=True) == streamed.text


def test_batched_final_decodes_equal_the_streamed_texts(tokenizer):
    """Final texts decoded together (``IncrementalDetokenizer.decode_outputs``: batched calls per
    special-token setting, a text ending inside a character redone alone) equal what feeding each
    request's tokens step by step builds, for requests of both settings, outputs that end inside a
    character, empty outputs and prompts that end inside one."""
    rng = random.Random(7)
    byte_tokens = [i for i in range(200, 2000) if "\ufffd" in tokenizer.decode([i])][:50]
    pool = list(range(len(tokenizer))) + byte_tokens * 300
    requests, expected, ends_inside = [], [], []
    for i in range(40):
        skip = i % 3 != 0
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        ids = [rng.choice(pool) for _ in range(rng.choice((0, 1, 30, 200)))]
        streamed = OutputTextState(tokenizer, prompt, skip_special_tokens=skip)
        deferred = OutputTextState(tokenizer, prompt, skip_special_tokens=skip, defer=True)
        for token in ids:
            streamed.append_tokens([token])
            deferred.append_tokens([token])
        requests.append(deferred.final_decode())
        expected.append(streamed.text)
        ends_inside.append(tokenizer.decode(prompt[-5:] + ids, skip_special_tokens=skip).endswith("\ufffd"))
    assert any(ends_inside) and not all(ends_inside)
    assert IncrementalDetokenizer.decode_outputs(requests) == expected


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_text_read_after_several_steps_equals_text_read_every_step(tokenizer, seed):
    """A streamed request whose reader is behind decodes several steps' tokens at once; at every
    read its text is what reading after each step gives, including reads that end inside a
    character (the batch is then decoded token by token)."""
    rng = random.Random(seed)
    byte_tokens = [i for i in range(200, 2000) if "\ufffd" in tokenizer.decode([i])][:50]
    pool = list(range(len(tokenizer))) + byte_tokens * 300
    prompt = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
    every_step = OutputTextState(tokenizer, prompt)
    batched = OutputTextState(tokenizer, prompt, token_texts=TokenTexts(tokenizer))
    every_deltas, batched_deltas = [], []
    for _ in range(150):
        token = rng.choice(pool)
        every_step.append_tokens([token])
        batched.append_tokens([token])
        every_deltas.append(every_step.take_delta(finished=False))
        if rng.random() < 0.3:
            batched_deltas.append(batched.take_delta(finished=False))
            assert "".join(batched_deltas) == "".join(every_deltas)
    batched_deltas.append(batched.take_delta(finished=True))
    every_deltas.append(every_step.take_delta(finished=True))
    assert "".join(batched_deltas) == "".join(every_deltas) == every_step.text


def test_deferred_text_is_not_used_with_stop_strings(tokenizer):
    """Stop strings must be searched as tokens arrive (the request ends there), deferred or not."""
    ids = tokenizer.encode("one two three four")
    state = OutputTextState(tokenizer, [], stop=[" three"], defer=True)
    stops = [state.append_tokens([t]) for t in ids[:3]]
    assert stops[-1] == " three" and state.text == "one two"


def test_token_texts_are_single_token_decodes(tokenizer):
    from novainfer.engine.detokenizer import TokenTexts

    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS.values())) * 2  # every id asked for twice: the second from the cache
    expected = [tokenizer.decode([i]) for i in ids]
    assert texts(ids[:7]) == expected[:7]  # a first batch of misses
    assert texts(ids) == expected  # hits and misses mixed, repeated ids within one call


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_ends_on_character_never_claims_a_text_that_ends_inside_one(tokenizer, skip_special_tokens):
    """Against the decoded text itself: whenever ``ends_on_character`` says yes, the decode of those
    ids ends on a whole character (special tokens skipped or not); it says yes for ordinary text."""
    texts = TokenTexts(tokenizer)
    rng = random.Random(7)
    byte_tokens = [i for i in range(200, 2000) if "\ufffd" in tokenizer.decode([i])][:50]
    pool = list(range(len(tokenizer))) + byte_tokens * 300 + tokenizer.all_special_ids * 300
    claims = 0
    for _ in range(3000):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        if texts.ends_on_character(ids):
            claims += 1
            text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            assert not text.endswith("\ufffd"), (ids, text)
    assert claims > 1000
    assert texts.ends_on_character(tokenizer.encode("Hello world")) and not texts.ends_on_character([])
    assert not texts.ends_on_character(tokenizer.encode("🦜")[:1])
