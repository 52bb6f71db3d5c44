"""core_api KV cells: visibility (sequence sets and positions), every kv_seq_* operation on its
boundaries, failure without side effects, context shifting and cell sharing.

Oracles: transformers on each sequence's tokens alone (at the positions they end up at), and the
cell dump checked against counts that follow from the operations."""

from __future__ import annotations

import pytest
import torch

from novainfer.core_api import Batch, KvStatus, Model
from tests.core_api_utils import decode_seqs, hf_logits_at
from tests.utils import hf_logits, random_ids, tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def path():
    return tiny_model()


@pytest.fixture(scope="module")
def models(path):
    return {a: Model.from_pretrained(path, device="cpu", n_ctx=64, n_seq_max=4, attention=a) for a in ("auto", "masked")}


@pytest.fixture(params=["auto", "masked"])
def model(request, models):
    """Each attention path, for the tests whose outcome goes through attention."""
    models[request.param].kv_clear()
    return models[request.param]


@pytest.fixture
def kv_model(models):
    """One model, for the tests of cell metadata alone."""
    models["auto"].kv_clear()
    return models["auto"]


def fill(model: Model, seq: int, tokens: list[int], start: int = 0) -> None:
    code, _ = decode_seqs(model, {seq: tokens}, {seq: start})
    assert code == 0, model.last_error


def positions(model: Model, seq: int) -> list[int]:
    return sorted(c.pos for c in model.kv_cells_dump(used_only=True) if seq in c.seq_ids)


def kv_state(model: Model):
    return ([c for c in model.kv_cells_dump()],
            [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in model.model.attention_layers()])


def assert_same_state(model: Model, state) -> None:
    cells, caches = state
    assert model.kv_cells_dump() == cells
    for layer, (k, v) in zip(model.model.attention_layers(), caches):
        assert torch.equal(layer.k_cache, k) and torch.equal(layer.v_cache, v)


# ---- visibility -----------------------------------------------------------------------------------
def test_two_sequences_in_one_batch_are_isolated(model, path, vocab_size):
    a, b = random_ids(0, 6, vocab_size), random_ids(1, 6, vocab_size)
    code, where = decode_seqs(model, {0: a, 1: b}, logits="all")
    assert code == 0, model.last_error
    torch.testing.assert_close(torch.stack([model.get_logits_ith(i) for i in where[1]]), hf_logits(path, b),
                               atol=ATOL, rtol=0)
    # Sequence 0 continues alone: it never saw sequence 1's cells.
    code, where = decode_seqs(model, {0: [7]})
    assert code == 0
    torch.testing.assert_close(model.get_logits_ith(where[0][0]), hf_logits(path, a + [7])[-1], atol=ATOL, rtol=0)


def test_tokens_in_several_sequences_are_seen_by_each(model, path, vocab_size):
    """A prompt decoded once with seq_id [0, 1, 2] in the same batch as sequence 2's own next token;
    sequence 3 in the batch sees none of it. Each sequence then continues on its own."""
    prompt, extra = random_ids(2, 5, vocab_size), random_ids(3, 3, vocab_size)
    batch = Batch.init(16, 3)
    for i, t in enumerate(prompt):
        batch.add(t, i, [0, 1, 2])
    batch.add(extra[0], len(prompt), [2], logits=True)  # sees the shared prompt: same batch, set overlap
    for i, t in enumerate(extra):
        batch.add(t, i, [3], logits=i == 2)  # sees only its own tokens
    assert model.decode(batch) == 0, model.last_error
    assert batch.n_tokens - len(prompt) - 1 == 3
    torch.testing.assert_close(model.get_logits_ith(len(prompt)), hf_logits(path, prompt + extra[:1])[-1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(model.get_logits_ith(-1), hf_logits(path, extra)[-1], atol=ATOL, rtol=0)
    assert model.kv_used_cells() == len(prompt) + 4  # the prompt's cells once, for three sequences
    for seq, token in ((0, 11), (1, 12)):
        code, where = decode_seqs(model, {seq: [token]})
        assert code == 0
        torch.testing.assert_close(model.get_logits_ith(0), hf_logits(path, prompt + [token])[-1], atol=ATOL, rtol=0)


# ---- kv_seq_* ---------------------------------------------------------------------------------------
def test_seq_rm_half_open_range_and_its_conventions(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(4, 10, vocab_size))
    assert kv_model.kv_seq_rm(0, 2, 5) == KvStatus.OK
    assert positions(kv_model, 0) == [0, 1, 5, 6, 7, 8, 9]  # p0 inclusive, p1 exclusive
    assert kv_model.kv_seq_rm(0, 8, -1) == KvStatus.OK  # negative p1: to the end
    assert positions(kv_model, 0) == [0, 1, 5, 6, 7]
    assert kv_model.kv_seq_rm(0, -1, 1) == KvStatus.OK  # negative p0: from 0
    assert positions(kv_model, 0) == [1, 5, 6, 7]
    assert (kv_model.kv_seq_pos_min(0), kv_model.kv_seq_pos_max(0)) == (1, 7)
    before = kv_model.kv_cells_dump()
    assert kv_model.kv_seq_rm(0, 20, 30) == KvStatus.OK  # matches nothing: nothing to do
    assert kv_model.kv_seq_rm(1, 0, -1) == KvStatus.OK  # a sequence with no cells
    assert kv_model.kv_seq_rm(0, 6, 6) == KvStatus.EMPTY_RANGE
    assert kv_model.kv_seq_rm(0, 7, 3) == KvStatus.EMPTY_RANGE
    assert kv_model.kv_seq_rm(4, 0, -1) == KvStatus.INVALID_SEQ and "n_seq_max" in kv_model.last_error
    assert kv_model.kv_cells_dump() == before
    assert kv_model.kv_seq_rm(-1, -1, -1) == KvStatus.OK  # any sequence, every position
    assert kv_model.kv_used_cells() == 0 and kv_model.kv_seq_pos_max(0) == -1 and kv_model.kv_seq_pos_min(0) == -1


def test_seq_rm_of_one_owner_keeps_shared_cells(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(5, 6, vocab_size))
    assert kv_model.kv_seq_cp(1, 0, 2, 4) == KvStatus.OK
    assert positions(kv_model, 1) == [2, 3]
    assert kv_model.kv_seq_rm(0, -1, -1) == KvStatus.OK
    assert kv_model.kv_used_cells() == 2 and positions(kv_model, 1) == [2, 3]  # still owned by sequence 1
    assert kv_model.kv_seq_rm(-1, 3, 4) == KvStatus.OK
    assert positions(kv_model, 1) == [2]


def test_freed_cells_are_reused(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(6, 40, vocab_size))
    fill(kv_model, 1, random_ids(7, 24, vocab_size))
    assert kv_model.kv_used_cells() == 64
    code, _ = decode_seqs(kv_model, {2: [5]})
    assert code == 1 and "no KV slot" in kv_model.last_error
    freed = {c.cell for c in kv_model.kv_cells_dump(used_only=True) if c.seq_ids == [0] and 10 <= c.pos < 14}
    assert kv_model.kv_seq_rm(0, 10, 14) == KvStatus.OK
    code, _ = decode_seqs(kv_model, {2: [5, 6, 7, 8]})
    assert code == 0, kv_model.last_error
    assert set(kv_model.last_token_cells) == freed


def test_seq_keep(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(8, 4, vocab_size))
    fill(kv_model, 1, random_ids(9, 3, vocab_size))
    kv_model.kv_seq_cp(2, 0)
    assert kv_model.kv_seq_keep(2) == KvStatus.OK
    assert kv_model.kv_used_cells() == 4 and positions(kv_model, 2) == [0, 1, 2, 3]
    assert kv_model.kv_seq_pos_max(0) == kv_model.kv_seq_pos_max(1) == -1
    assert kv_model.kv_seq_keep(-1) == KvStatus.INVALID_SEQ


def test_seq_cp_statuses(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(10, 5, vocab_size))
    assert kv_model.kv_seq_cp(0, 0) == KvStatus.OK and positions(kv_model, 0) == [0, 1, 2, 3, 4]
    assert kv_model.kv_seq_cp(1, 0, 3, 3) == KvStatus.EMPTY_RANGE
    assert kv_model.kv_seq_cp(1, 0, 9, 12) == KvStatus.OK and positions(kv_model, 1) == []
    assert kv_model.kv_seq_cp(1, -1) == KvStatus.INVALID_SEQ
    assert kv_model.kv_seq_cp(7, 0) == KvStatus.INVALID_SEQ
    assert kv_model.kv_seq_cp(1, 0, 4, -1) == KvStatus.OK and positions(kv_model, 1) == [4]
    assert kv_model.kv_used_cells() == 5
    with pytest.raises(ValueError, match="n_seq_max"):
        kv_model.kv_seq_pos_max(9)


def test_seq_add_range_statuses(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(11, 8, vocab_size))
    assert kv_model.kv_seq_add(0, 5, 5, 3) == KvStatus.EMPTY_RANGE
    assert kv_model.kv_seq_add(0, 20, -1, 3) == KvStatus.OK  # matches nothing
    assert kv_model.kv_seq_add(0, 0, -1, kv_model.max_position) == KvStatus.INVALID_POS
    assert "limit" in kv_model.last_error
    assert kv_model.kv_seq_add(-1, 0, -1, 1) == KvStatus.INVALID_SEQ
    assert positions(kv_model, 0) == list(range(8))
    assert kv_model.kv_seq_add(0, 4, 6, 10) == KvStatus.OK  # [4, 6) moves to 14, 15
    assert positions(kv_model, 0) == [0, 1, 2, 3, 6, 7, 14, 15]


@pytest.mark.parametrize("delta", [10, -3])
def test_seq_add_attention_at_the_new_positions(model, path, vocab_size, delta):
    """A whole sequence moved: keys re-rotated, queries at the new positions (transformers with
    those position ids as the oracle)."""
    tokens = random_ids(11, 8, vocab_size)
    fill(model, 0, tokens, start=5)
    assert model.kv_seq_add(0, -1, -1, delta) == KvStatus.OK
    assert positions(model, 0) == [p + delta for p in range(5, 13)]
    code, _ = decode_seqs(model, {0: [9]})
    assert code == 0
    expected = hf_logits_at(path, tokens + [9], list(range(5 + delta, 14 + delta)))[-1]
    torch.testing.assert_close(model.get_logits_ith(0), expected, atol=ATOL, rtol=0)


def test_seq_add_below_zero_removes_those_cells(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(12, 6, vocab_size))
    assert kv_model.kv_seq_add(0, 0, 4, -2) == KvStatus.OK
    assert positions(kv_model, 0) == [0, 1, 4, 5]  # 0 and 1 went below zero and left; 2, 3 -> 0, 1
    assert kv_model.kv_used_cells() == 4


def test_seq_add_on_shared_cells_moves_only_that_sequence(model, path, vocab_size):
    prompt = random_ids(13, 5, vocab_size)
    fill(model, 0, prompt)
    model.kv_seq_cp(1, 0)
    assert model.kv_seq_add(1, 0, -1, 3) == KvStatus.OK
    assert positions(model, 0) == [0, 1, 2, 3, 4] and positions(model, 1) == [3, 4, 5, 6, 7]
    assert model.kv_used_cells() == 10  # sequence 1 got its own copies
    code, where = decode_seqs(model, {0: [21], 1: [22]})
    assert code == 0
    torch.testing.assert_close(model.get_logits_ith(where[0][0]), hf_logits(path, prompt + [21])[-1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(model.get_logits_ith(where[1][0]),
                               hf_logits_at(path, prompt + [22], list(range(3, 9)))[-1], atol=ATOL, rtol=0)


def test_seq_add_of_shared_cells_without_room_changes_nothing(kv_model, vocab_size):
    fill(kv_model, 0, random_ids(14, 40, vocab_size))
    kv_model.kv_seq_cp(1, 0)
    fill(kv_model, 2, random_ids(15, 20, vocab_size))
    state = kv_state(kv_model)
    assert kv_model.kv_seq_add(1, 0, -1, 2) == KvStatus.OOM_SLOT and "free cells" in kv_model.last_error
    assert_same_state(kv_model, state)


def test_a_failing_operation_reports_internal_error_and_keeps_the_metadata(kv_model, vocab_size, monkeypatch):
    fill(kv_model, 0, random_ids(21, 5, vocab_size))
    kv_model.kv_seq_cp(1, 0)
    before = kv_model.kv_cells_dump()

    def fail(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(kv_model, "_rotate", fail)
    assert kv_model.kv_seq_add(1, 0, -1, 2) == KvStatus.INTERNAL_ERROR
    assert "device lost" in kv_model.last_error
    assert kv_model.kv_cells_dump() == before


# ---- resource exhaustion -------------------------------------------------------------------------
def test_full_cache_returns_1_and_changes_nothing(model, path, vocab_size):
    prompt = random_ids(16, 60, vocab_size)
    fill(model, 0, prompt)
    state = kv_state(model)
    code, _ = decode_seqs(model, {1: random_ids(17, 5, vocab_size)})
    assert code == 1 and model.n_outputs() == 0
    assert_same_state(model, state)
    code, _ = decode_seqs(model, {0: [3]})  # one sequence may still take every remaining cell
    assert code == 0
    torch.testing.assert_close(model.get_logits_ith(0), hf_logits(path, prompt + [3])[-1], atol=ATOL, rtol=0)


def test_aborted_decode_commits_nothing(model, path, vocab_size):
    prompt = random_ids(18, 6, vocab_size)
    fill(model, 0, prompt)
    before = model.kv_cells_dump()
    calls = []
    model.set_abort_callback(lambda: calls.append(1) or len(calls) > 2)  # abort inside the forward pass
    try:
        code, _ = decode_seqs(model, {0: [4, 5]})
    finally:
        model.set_abort_callback(None)
    assert code == 2 and "abort" in model.last_error
    assert model.kv_cells_dump() == before
    code, _ = decode_seqs(model, {0: [4]})
    assert code == 0
    torch.testing.assert_close(model.get_logits_ith(0), hf_logits(path, prompt + [4])[-1], atol=ATOL, rtol=0)


# ---- what the operations are for ------------------------------------------------------------------
def test_continuations_share_the_prompt_cells(model, path, vocab_size):
    prompt = random_ids(20, 12, vocab_size)
    fill(model, 0, prompt)
    for seq in (1, 2, 3):
        assert model.kv_seq_cp(seq, 0) == KvStatus.OK
    continuations = {seq: random_ids(30 + seq, 3, vocab_size) for seq in range(4)}
    code, where = decode_seqs(model, continuations, logits="all")
    assert code == 0, model.last_error
    cells = model.kv_cells_dump(used_only=True)
    assert len(cells) == len(prompt) + 12
    assert sum(c.seq_ids == [0, 1, 2, 3] for c in cells) == len(prompt)
    for seq, cont in continuations.items():
        expected = hf_logits(path, prompt + cont)[-3:]
        got = torch.stack([model.get_logits_ith(i) for i in where[seq]])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# ---- the cell metadata's own bookkeeping ---------------------------------------------------------
def test_cell_metadata_bookkeeping_against_a_plain_scan():
    """KvCells keeps each sequence's cells in position order and searches free cells from a lower
    bound, chunk by chunk; after random decodes and removals over a cache of several search chunks,
    both equal what a plain scan of the metadata gives."""
    import numpy as np

    from novainfer.core_api.kv_cells import KvCells

    rng = np.random.default_rng(0)
    kv = KvCells(n_ctx=20_000, n_seq_max=5)
    next_pos = np.zeros(5, dtype=np.int64)
    for step in range(300):
        n = int(rng.integers(1, 600))
        free = kv.free_cells(n)
        assert free.tolist() == np.flatnonzero(~kv.used)[:n].tolist()
        if len(free) == n:
            token_seqs = np.zeros((n, 5), dtype=bool)
            token_seqs[np.arange(n), rng.integers(0, 5, n)] = True
            token_seqs[:, 4] |= rng.random(n) < 0.2  # some tokens in two sequences
            positions = np.empty(n, dtype=np.int64)
            for i in range(n):  # each token right after the latest of its sequences
                positions[i] = next_pos[token_seqs[i]].max()
                next_pos[token_seqs[i]] = positions[i] + 1
            kv.commit(free, positions, token_seqs)
        seq = int(rng.integers(0, 5))
        if step % 3 == 0:  # a removal (the sorted rows of touched sequences are rebuilt when read)
            lo = int(rng.integers(0, max(1, next_pos[seq])))
            kv.remove(seq if step % 2 else None, kv.cells_in_range(seq, lo, lo + int(rng.integers(1, 400))))
        for s in range(5):
            cells = np.flatnonzero(kv.seqs[s])
            assert kv.seq_cells(s).tolist() == cells[np.argsort(kv.pos[cells], kind="stable")].tolist()
        expected_max = [int(kv.pos[kv.seqs[s]].max()) if kv.seqs[s].any() else -1 for s in range(5)]
        assert kv.pos_max_of(np.arange(5)).tolist() == expected_max
