"""FlatLogprobs reads exactly like the list of per-position dicts it replaces (built here the
straightforward way), including the sampled token appearing among the top alternatives."""

from __future__ import annotations

import random

import numpy as np
import pytest

from novainfer.outputs import FlatLogprobs, Logprob, LogprobsWindow, StepLogprobs, join_rows


def reference_position(ids: list[int], values: list[float], rank: int, texts: list) -> dict[int, Logprob]:
    entry = {ids[0]: Logprob(values[0], rank, texts[0])}
    for position in range(1, len(ids)):
        entry.setdefault(ids[position], Logprob(values[position], position, texts[position]))
    return entry


def as_float32(value: float) -> float:
    """The value a float32 logprob reads back as (how the engine's logprobs travel)."""
    return float(np.float32(value))


def random_positions(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    positions = []
    for _ in range(count):
        k = rng.randint(0, 5)
        top = rng.sample(range(50), k)
        sampled = rng.choice(top) if top and rng.random() < 0.5 else rng.randrange(50)
        ids = [sampled] + top
        values = [as_float32(-rng.random() * 5) for _ in ids]
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


def _block(positions: list[tuple], width: int) -> StepLogprobs:
    """The rows of ``positions`` (each with at least ``width`` entries) as one step block."""
    return StepLogprobs.of(width, [t for ids, _, _ in positions for t in ids[:width]],
                        [v for _, values, _ in positions for v in values[:width]], [rank for _, _, rank in positions])


@pytest.mark.parametrize("asked", [5, 2, 0])
def test_rows_of_step_blocks_read_like_appending_each_position(asked):
    """A request's positions added from rows of step blocks (several requests' rows in
    each, the request asking for fewer alternatives than the step holds, some steps joined) read as
    the positions appended one by one, cut to what it asked for."""
    rng = random.Random(asked)
    width = 6

    def position():
        top = rng.sample(range(50), width - 1)
        sampled = rng.choice(top) if rng.random() < 0.5 else rng.randrange(50)
        return [sampled] + top, [as_float32(-rng.random() * 5) for _ in range(width)], rng.randint(1, 40)

    mine = [position() for _ in range(9)]
    expected = FlatLogprobs(token_texts)
    for ids, values, rank in mine:
        expected.append_position(ids[:asked + 1], values[:asked + 1], rank)
    got = FlatLogprobs(token_texts, max_alternatives=asked)
    # Step 1: another request's 2 rows, then my 3; step 2: my 1 row after 4 others; steps 3 and 4
    # (joined, as when one message carries two steps): my 2 rows, then my last 3 at a narrower width.
    step1 = _block([position(), position()] + mine[0:3], width)
    step2 = _block([position() for _ in range(4)] + mine[3:4], width)
    step3, step4 = _block(mine[4:6], width), _block([position()] + mine[6:9], asked + 1)
    got.add_rows(step1, 2, 3)
    got.add_rows(step2, 4, 1)
    got.add_rows(join_rows((step3, 0, 2), (step4, 1, 3)), 0, 5)
    assert len(got) == 9 and got == expected and list(got) == list(expected)
    assert got[3:7] == expected[3:7] and got[-1] == expected[-1] and got[9:] == []
    assert got.cumulative_logprob == pytest.approx(sum(values[0] for _, values, _ in mine))
    assert got[3:7].cumulative_logprob == pytest.approx(sum(values[0] for _, values, _ in mine[3:7]))


@pytest.mark.parametrize("read_every", [1, 3, 100], ids=["streamed", "read-now-and-then", "read-at-the-end"])
def test_rows_through_a_window_read_like_rows_added_directly(monkeypatch, read_every):
    """Three requests' rows through one LogprobsWindow (flushing every 4 steps, and at a change of
    width) read exactly as the same rows added straight from each step's block, whenever they are
    read; taking a streamed request's new positions each time gives back every position once, and
    the cumulative logprob is the same sum to the last bit."""
    monkeypatch.setattr(LogprobsWindow, "MAX_BLOCKS", 4)
    rng = random.Random(read_every)
    window = LogprobsWindow()
    asked = [5, 2, 0]
    direct = [FlatLogprobs(token_texts, max_alternatives=a) for a in asked]
    windowed = [FlatLogprobs(token_texts, max_alternatives=a) for a in asked]
    taken = [[] for _ in asked]
    for step in range(23):
        width = 6 if step < 15 else 7  # a wider step block from step 15 on
        counts = [rng.choice([1, 1, 1, 3]) for _ in asked]
        rows = [(rng.sample(range(50), width), [as_float32(-rng.random() * 5) for _ in range(width)], rng.randint(1, 40))
                for _ in range(sum(counts) + 2)]  # two rows of other requests first
        block = _block(rows, width)
        first_window_row = window.add(block)
        first = 2
        for request, count in enumerate(counts):
            direct[request].add_rows(block, first, count)
            windowed[request].add_window_rows(window, first_window_row + first, count)
            first += count
        if step % read_every == 0:
            taken[0].append(windowed[0].take())
            assert windowed[1][:] == direct[1]
    assert windowed[1] == direct[1] and windowed[2] == direct[2] and len(windowed[2]) == len(direct[2])
    assert windowed[2][5:40] == direct[2][5:40] and windowed[2][-1] == direct[2][-1]
    taken[0].append(windowed[0].take())
    assert [position for part in taken[0] for position in part] == list(direct[0]) and len(windowed[0]) == 0
    for request in range(3):
        assert windowed[request].cumulative_logprob == direct[request].cumulative_logprob
        expected = 0.0
        for position in direct[request]:
            expected += next(iter(position.values())).logprob  # the sampled token comes first
        assert direct[request].cumulative_logprob == expected
