"""The persistent sampling table: rows written once per request, token counts kept on the device
across steps, rows reused and grown, logprobs packed for one host copy.

Oracles: a straightforward penalty loop over each request's whole history, and log_softmax of the
logits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from novainfer.sample import LogprobsTensors, Sampler, SamplingStateTable
from novainfer.sample.state import copy_to_device
from novainfer.sample.rng import row_keys, seed_lanes
from novainfer.sample.sampler import apply_min_tokens, apply_penalties
from novainfer.sampling_params import SamplingParams
from tests.test_sampler import naive_penalties

VOCAB = 40


PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.6),
    SamplingParams(temperature=0.9, seed=4, frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(temperature=1.0),  # no penalties, sharing steps with rows that have them
    SamplingParams(temperature=1.2, top_k=5, repetition_penalty=0.7, frequency_penalty=-0.4, presence_penalty=1.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=4, stop_token_ids=[1, 2, 3]),
]


def test_penalties_follow_the_whole_history_across_steps_row_reuse_and_growth():
    """Requests join (some with outputs already, as after preemption), leave, and their rows are
    reused by others while the table grows; every step's penalized logits equal the reference over
    each request's prompt and every token it generated, with counts updated on the device only."""
    rng = random.Random(0)
    torch.manual_seed(0)
    table = SamplingStateTable(VOCAB, torch.device("cpu"), num_rows=2)
    sampler = Sampler()
    live: dict[int, dict] = {}  # row -> request
    free_rows = list(range(40))
    checked = 0
    for step in range(30):
        # Some requests leave; new ones take the freed rows (lowest first, so rows are reused).
        for row in [r for r in live if rng.random() < 0.15]:
            del live[row]
            free_rows.append(row)
        free_rows.sort()
        joining = []
        for _ in range(rng.randint(0, 3) if live else 3):
            row = free_rows.pop(0)
            request = {"params": rng.choice(PARAMS),
                       "prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))],
                       "output": [rng.randrange(VOCAB) for _ in range(rng.choice((0, 0, 3)))]}
            live[row] = request
            joining.append(row)
        table.add_requests(joining, [live[r]["params"] for r in joining], [live[r]["prompt"] for r in joining],
                           [list(live[r]["output"]) for r in joining])
        rows = sorted(live, key=lambda _: rng.random())  # any order of rows in a step
        params = [live[r]["params"] for r in rows]
        positions = np.array([len(live[r]["output"]) for r in rows], dtype=np.int64)
        metadata = table.gather(np.array(rows, dtype=np.int64), positions)
        logits = torch.randn(len(rows), VOCAB) * 3
        if not metadata.no_penalties:
            expected = naive_penalties(logits, params, [live[r]["prompt"] for r in rows],
                                       [live[r]["output"] for r in rows])
            penalized = [i for i, p in enumerate(params) if p.has_penalties]
            got = apply_penalties(logits, metadata)
            torch.testing.assert_close(got[penalized], expected[penalized])
            checked += 1
        sampled = sampler(logits, metadata).sampled_token_ids
        table.record_sampled(metadata, sampled)
        for row, token in zip(rows, sampled.tolist()):
            live[row]["output"].append(token)
    assert checked > 20 and table.num_rows > 2


def test_min_tokens_mask_follows_the_output_position():
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2, 7, VOCAB + 5])  # beyond V: ignored
    p.update_from_generation_config([0])
    other = SamplingParams(temperature=0.0, stop_token_ids=[2])
    table = SamplingStateTable(VOCAB, torch.device("cpu"))
    table.add_requests([3, 5], [p, other], [[1], [1]], [[], []])
    logits = torch.zeros(2, VOCAB)
    for position, blocked in ((0, True), (2, True), (3, False)):
        metadata = table.gather(np.array([5, 3]), np.array([position, position]))
        out = apply_min_tokens(logits, metadata)
        assert not out[0].isinf().any()  # the row without min_tokens
        assert out[1].isinf().nonzero().flatten().tolist() == ([0, 2, 7] if blocked else [])
        if not blocked:
            assert metadata.min_tokens_mask is None  # the stage is skipped altogether


def test_logprobs_pack_into_one_tensor_and_back():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    table = SamplingStateTable(VOCAB, torch.device("cpu"))
    params = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_k=6, logprobs=1)]
    table.add_requests([0, 1, 2], params, [[1]] * 3, [[]] * 3)
    out = Sampler()(logits, table.gather(np.arange(3), np.zeros(3, dtype=np.int64)))
    packed = out.logprobs.pack()
    assert packed.dtype == torch.int64 and packed.shape == (3, 1 + 2 * 5)
    ids, values, ranks = LogprobsTensors.unpack(packed.numpy())
    reference = logits.log_softmax(-1)
    assert np.array_equal(ids, out.logprobs.token_ids.numpy()) and ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    assert values.dtype == np.float32 and np.array_equal(values, out.logprobs.logprobs.numpy())
    np.testing.assert_allclose(values, reference.gather(1, torch.from_numpy(ids)).numpy(), atol=1e-6)
    assert ranks.tolist() == out.logprobs.sampled_token_ranks.tolist()


def test_top_k_candidates_and_the_full_vocabulary_draw_the_same_seeded_token():
    """Sampling among the top-k candidates and over the whole vocabulary (top-k masked after a
    sort) draw the same token for a seeded row: the noise is keyed by token id."""
    torch.manual_seed(2)
    table = SamplingStateTable(VOCAB, torch.device("cpu"))
    with_top_k = SamplingParams(temperature=0.8, top_k=7, top_p=0.9, seed=11)
    without = SamplingParams(temperature=0.8, top_p=0.9, seed=11)  # forces the full-vocabulary path
    table.add_requests([0, 1], [with_top_k, without], [[1], [1]], [[], []])
    sampler = Sampler()
    agree = 0
    for position in range(200):
        logits = torch.randn(1, VOCAB) * 2
        candidates = table.gather(np.array([0]), np.array([position]))
        assert candidates.max_top_k == 7
        both = table.gather(np.array([0, 1]), np.array([position, position]))
        assert both.max_top_k is None and both.largest_top_k == 7 and candidates.largest_top_k == 7
        token = sampler(logits, candidates).sampled_token_ids.item()
        assert token in logits[0].topk(7).indices.tolist()
        assert sampler(logits.expand(2, -1), both).sampled_token_ids[0].item() == token
        agree += token == sampler(logits, table.gather(np.array([1]), np.array([position]))).sampled_token_ids.item()
    assert 0 < agree < 200  # the row without top-k is the same stream over a larger set


def test_step_noise_keys_are_the_torch_hash_of_each_rows_seed_and_position():
    """The table hashes the seeded rows' keys with numpy; oracle: rng.row_keys on torch tensors of
    the same seed lanes and positions (seeds at the ends of the accepted range included)."""
    seeds = [0, 1, 2**64 - 1, -(2**63), 123456789012345]
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in seeds]
    params.insert(2, SamplingParams(temperature=1.0))  # an unseeded row between them
    table = SamplingStateTable(VOCAB, torch.device("cpu"))
    table.add_requests(list(range(len(params))), params, [[]] * len(params), [[]] * len(params))
    rows, positions = np.array([5, 0, 2, 3, 1, 4]), np.array([0, 7, 3, 2**31 + 5, 1, 2**40])
    metadata = table.gather(rows, positions)
    lanes = torch.tensor([seed_lanes(params[row].seed) if params[row].seed is not None else (0, 0) for row in rows])
    expected = row_keys(lanes[:, 0], lanes[:, 1], torch.from_numpy(positions))
    seeded = metadata.is_seeded.tolist()
    assert seeded == [params[row].seed is not None for row in rows]
    assert metadata.noise_keys.dtype == torch.int64
    assert metadata.noise_keys[metadata.is_seeded].tolist() == expected[metadata.is_seeded].tolist()


def test_unseeded_keys_are_fresh_each_step_and_follow_the_tables_seed():
    """Every random row gets a key each step: a seeded row's depends on its seed and position only,
    an unseeded row's is drawn anew (from a generator seeded like the engine, so two tables of one
    seed give the same sequence; without a seed, from torch's global generator)."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=9)]
    tables = [SamplingStateTable(VOCAB, torch.device("cpu"), seed=seed) for seed in (3, 3, 4)]
    for table in tables:
        table.add_requests([0, 1], params, [[]] * 2, [[]] * 2)
    rows, positions = np.array([0, 1]), np.array([5, 5])
    steps = [[table.gather(rows, positions).noise_keys.tolist() for _ in range(3)] for table in tables]
    assert steps[0] == steps[1] and [keys[0] for keys in steps[0]] != [keys[0] for keys in steps[2]]
    assert len({keys[0] for keys in steps[0]}) == 3  # the unseeded row's key changes every step
    assert {keys[1] for keys in steps[0] + steps[2]} == {keys[1] for keys in steps[0][:1]}  # the seeded one's does not
    # Unseeded tables draw their generator's seed from torch's: fresh per table, repeatable under manual_seed.
    keys = []
    for manual_seed in (5, 5, 6):
        torch.manual_seed(manual_seed)
        table = SamplingStateTable(VOCAB, torch.device("cpu"))
        table.add_requests([0], params[:1], [[]], [[]])
        keys.append(table.gather(rows[:1], positions[:1]).noise_keys.tolist())
    assert keys[0] == keys[1] != keys[2]


def test_a_step_over_the_same_rows_sees_what_joined_them_since():
    """Consecutive steps over the same rows reuse what they take from the rows alone; a request that
    takes over a row in between, or min_tokens that run out, change the next step's metadata."""
    table = SamplingStateTable(VOCAB, torch.device("cpu"))
    table.add_requests([0, 1], [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)], [[]] * 2, [[]] * 2)
    rows = np.array([0, 1])
    first = table.gather(rows, np.array([0, 0]))
    assert first.temperature.tolist() == [0.5, 1.0] and first.no_penalties and first.min_tokens_mask is None
    table.add_requests([1], [SamplingParams(temperature=0.8, repetition_penalty=1.3, min_tokens=2,
                                            stop_token_ids=[7])], [[4]], [[]])
    second = table.gather(rows, np.array([1, 1]))
    assert second.temperature.tolist() == [0.5, pytest.approx(0.8)] and second.all_random and not second.no_penalties
    assert second.min_tokens_mask[1, 7].item() and second.min_tokens_mask.sum().item() == 1
    assert table.gather(rows, np.array([2, 2])).min_tokens_mask is None  # position 2 reached min_tokens


def test_each_step_reads_its_own_rows_through_the_reused_staging_buffer():
    check_each_step_reads_its_own_rows(torch.device("cpu"))


def check_each_step_reads_its_own_rows(device: torch.device) -> None:
    """A step's rows, flags and noise keys travel through the table's staging buffer, which every
    step reuses: steps alternating between compositions, and steps with more logits rows than the
    table has (a verification step repeats each request's row, growing the buffer), each read their
    own rows' parameters and keys. Each step's tensors are cloned on the device as a sampler would
    read them, before the next step, and checked at the end (nothing waits in between).
    Oracle: the parameters as given, rng.row_keys for the seeded row."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=1.3)]
    table = SamplingStateTable(VOCAB, device, num_rows=2, seed=0)
    table.add_requests([0, 1, 2], params, [[]] * 3, [[]] * 3)
    steps = []
    for rows in ([0, 1, 2], [2, 1], np.repeat([1, 2, 0], 5), [2, 1], [2, 1], [0, 1, 2]) * 2:
        rows = np.asarray(rows, dtype=np.int64)
        positions = np.arange(len(rows), dtype=np.int64) + len(steps)
        metadata = table.gather(rows, positions)
        read = [t.clone() for t in (metadata.rows, metadata.temperature, metadata.is_greedy, metadata.is_seeded,
                                    metadata.noise_keys)]
        steps.append((rows, positions, read))
    lo, hi = seed_lanes(3)
    for rows, positions, read in steps:
        rows_d, temperature, greedy, seeded, keys = (t.cpu() for t in read)
        assert rows_d.tolist() == rows.tolist()
        assert temperature.tolist() == pytest.approx([params[r].temperature or 1.0 for r in rows])
        assert greedy.tolist() == [r == 0 for r in rows]
        assert seeded.tolist() == [r == 1 for r in rows]
        expected = row_keys(torch.full((len(rows),), lo), torch.full((len(rows),), hi), torch.from_numpy(positions))
        assert keys[seeded].tolist() == expected[seeded].tolist()


def test_packed_copies_keep_each_array_and_align_it_to_16_bytes():
    """Triton kernels specialize on 16-byte pointer alignment: a view at an offset that depends on
    the batch size must not change it (a step's flags and keys are passed to the sampler's kernels)."""
    for batch in (1, 3, 5, 8):
        arrays = [np.arange(batch, dtype=np.int64), np.arange(batch) % 2 == 0, np.full(batch, 7, dtype=np.int64),
                  np.arange(batch * 3, dtype=np.float32).reshape(batch, 3)]
        views = copy_to_device(arrays, torch.device("cpu"))
        for array, view in zip(arrays, views):
            assert view.data_ptr() % 16 == 0
            assert np.array_equal(view.numpy(), array) and view.numpy().dtype == array.dtype


def test_rows_beyond_the_table_grow_it_and_bad_sizes_raise():
    table = SamplingStateTable(VOCAB, torch.device("cpu"), num_rows=1)
    table.add_requests([37], [SamplingParams(temperature=0.5, top_p=0.5)], [[1]], [[]])
    assert table.num_rows >= 38
    metadata = table.gather(np.array([37]), np.array([0]))
    assert metadata.temperature.tolist() == [0.5] and metadata.top_p.tolist() == [0.5]
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingStateTable(0, torch.device("cpu"))
