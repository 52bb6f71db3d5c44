"""FlatLogprobs reads exactly like the list of per-position dicts it replaces (built here the
straightforward way), including the sampled token appearing among the top alternatives."""

from __future__ import annotations

import random

import pytest

from novainfer.outputs import FlatLogprobs, Logprob


def reference_position(ids: list[int], values: list[float], rank: int, texts: list) -> dict[int, Logprob]:
    entry = {ids[0]: Logprob(values[0], rank, texts[0])}
    for position in range(1, len(ids)):
        entry.setdefault(ids[position], Logprob(values[position], position, texts[position]))
    return entry


def random_positions(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    positions = []
    for _ in range(count):
        k = rng.randint(0, 5)
        top = rng.sample(range(50), k)
        sampled = rng.choice(top) if top and rng.random() < 0.5 else rng.randrange(50)
        ids = [sampled] + top
        values = [-rng.random() * 5 for _ in ids]
        rank = top.index(sampled) + 1 if sampled in top else rng.randint(k + 1, 40)
        positions.append((ids, values, rank))
    return positions


def token_texts(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


@pytest.mark.parametrize("texts_of", [None, token_texts], ids=["no-text", "text"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reads_like_the_list_of_dicts(seed, texts_of):
    positions = random_positions(seed, 40)
    flat = FlatLogprobs(texts_of)
    for p in positions:
        flat.append_position(*p)
    expected = [reference_position(*p, texts_of(p[0]) if texts_of else [None] * len(p[0])) for p in positions]
    assert len(flat) == len(expected)
    assert list(flat) == expected and flat == expected
    assert [list(flat[i]) for i in range(len(flat))] == [list(e) for e in expected]  # sampled token first
    assert flat[-1] == expected[-1] and flat[-len(flat)] == expected[0]
    for start, stop in ((0, 0), (3, 17), (17, None), (None, 5), (-4, None)):
        part = flat[start:stop]
        assert isinstance(part, FlatLogprobs) and list(part) == expected[start:stop]
    with pytest.raises(IndexError, match="position 40 out of range for 40 positions"):
        flat[40]
    assert flat != expected[:-1] and flat != expected[:-1] + [{}]
