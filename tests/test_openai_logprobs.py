"""The server's logprobs objects are plain data (a streamed chunk serializes them as they are) in
OpenAI's shapes: the OpenAI client's own types read them back unchanged, and so do the server's
response models."""

from __future__ import annotations

import math

from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from novainfer.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from novainfer.entrypoints.openai.protocol import ChatChoiceLogprobs, CompletionLogprobs
from novainfer.outputs import Logprob

# Position 1: the sampled token ("é", id 7) is outside the top 2; position 2: it is the top one.
TOKEN_IDS = [7, 3]
ENTRIES = [
    {7: Logprob(-4.0, 9, "é"), 3: Logprob(-0.25, 1, " the"), 4: Logprob(-1.5, 2, " a")},
    {3: Logprob(-0.1, 1, " cat"), 5: Logprob(-math.inf, 2, "!")},
]


def test_chat_logprobs_are_openais_shape():
    data = chat_logprobs(TOKEN_IDS, ENTRIES, 2, tokenizer=None)
    assert ChoiceLogprobs.model_validate(data).model_dump(exclude_unset=True) == data
    assert ChatChoiceLogprobs.model_validate(data).model_dump() == data
    first, second = data["content"]
    assert (first["token"], first["logprob"], first["bytes"]) == ("é", -4.0, [0xC3, 0xA9])
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [(" the", -0.25), (" a", -1.5)]
    # JSON has no -Infinity: a token of probability 0 gets the most negative finite float.
    assert [(t["token"], t["logprob"]) for t in second["top_logprobs"]] == [(" cat", -0.1), ("!", -3.0e38)]


def test_completion_logprobs_are_openais_shape():
    data = completion_logprobs(TOKEN_IDS, ENTRIES, 2, tokenizer=None, text_offset=10)
    assert Logprobs.model_validate(data).model_dump(exclude_unset=True) == data
    assert CompletionLogprobs.model_validate(data).model_dump() == data
    assert data["tokens"] == ["é", " cat"] and data["text_offset"] == [10, 11]
    assert data["token_logprobs"] == [-4.0, -0.1]
    # The sampled token is listed among the top ones even when it is not one of them.
    assert data["top_logprobs"] == [{" the": -0.25, " a": -1.5, "é": -4.0}, {" cat": -0.1, "!": -3.0e38}]
