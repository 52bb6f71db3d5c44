"""``TorchReferenceBackend`` (paged, varlen, GQA) and ``TorchSDPABackend`` (its fused variant, the
CPU default) against a naive per-sequence, per-query loop: every test runs with each.

Every test states its step as sequences of ``(start_pos, query_len, block_table)`` over full
per-sequence Q/K/V; the metadata is built here with plain loops, the prefix tokens' K/V are
written into the paged cache by hand, and unused cache slots hold large random garbage that must
never leak into the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from novainfer.attention.backends import AttentionMetadata, TorchReferenceBackend, TorchSDPABackend
from novainfer.config import CacheConfig, ModelConfig
from novainfer.worker.model_runner import ModelRunner, SequenceInput
from tests.utils import tiny_model

NUM_KV_HEADS, HEAD_DIM = 2, 8
SCALE = HEAD_DIM ** -0.5
ATOL = 2e-5
GQA_RATIOS = [1, 2, 4]
BLOCK_SIZES = [1, 4, 16]
BACKEND = TorchReferenceBackend  # the backend under test, set per test by ``backend``


@pytest.fixture(autouse=True, params=[TorchReferenceBackend, TorchSDPABackend], ids=["torch", "sdpa"])
def backend(request, monkeypatch):
    monkeypatch.setattr(f"{__name__}.BACKEND", request.param)
    return request.param


@dataclass
class Seq:
    q: torch.Tensor  # [L, Hq, D] for every token of the sequence
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor


def make_seq(length: int, ratio: int, gen: torch.Generator) -> Seq:
    return Seq(torch.randn(length, NUM_KV_HEADS * ratio, HEAD_DIM, generator=gen),
               torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen),
               torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen))


def naive_attention(seq: Seq, positions: range) -> torch.Tensor:
    """Causal softmax attention of the queries at ``positions`` over keys 0..position, float64."""
    num_heads = seq.q.shape[1]
    group = num_heads // seq.k.shape[1]
    out = torch.empty(len(positions), num_heads, HEAD_DIM, dtype=torch.float64)
    for row, pos in enumerate(positions):
        for h in range(num_heads):
            kv = h // group  # query head h reads kv head h // group
            keys = seq.k[:pos + 1, kv].double()  # the query's own token and every earlier one
            values = seq.v[:pos + 1, kv].double()
            scores = keys @ seq.q[pos, h].double() * SCALE
            weights = torch.exp(scores - scores.max())
            out[row, h] = (weights / weights.sum()) @ values
    return out


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def build_metadata(steps: list[tuple[int, int, list[int]]], block_size: int,
                   backend: TorchReferenceBackend | None = None) -> AttentionMetadata:
    """Metadata for sequences ``(start_pos, query_len, block_table)``, with plain loops (planned by
    ``backend``, else by a new backend under test)."""
    query_lens = [q for _, q, _ in steps]
    seq_lens = [s + q for s, q, _ in steps]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    width = max(len(t) for _, _, t in steps)
    tables = [list(t) + [0] * (width - len(t)) for _, _, t in steps]
    slots = [slot_of(t, pos, block_size) for (s, q, t) in steps for pos in range(s, s + q)]
    backend = backend or BACKEND()
    metadata = AttentionMetadata(
        num_tokens=starts[-1], num_seqs=len(steps), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=np.array(query_lens, dtype=np.int64), seq_lens_cpu=np.array(seq_lens, dtype=np.int64),
        backend=backend)
    backend.prepare(metadata)
    return metadata


def new_cache(num_blocks: int, block_size: int, seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches full of large garbage: any read of a slot that is not the sequence's shows up."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen) * 50, torch.randn(shape, generator=gen) * 50


def write_prefix(cache: tuple[torch.Tensor, torch.Tensor], seq: Seq, table: list[int], upto: int,
                 block_size: int) -> None:
    k_cache, v_cache = cache
    for pos in range(upto):
        k_cache[table[pos // block_size], pos % block_size] = seq.k[pos]
        v_cache[table[pos // block_size], pos % block_size] = seq.v[pos]


def run_step(cache, items: list[tuple[Seq, int, int, list[int]]], block_size: int) -> list[torch.Tensor]:
    """One backend call for ``(seq, start_pos, query_len, block_table)`` items; per-item outputs."""
    metadata = build_metadata([(s, q, t) for _, s, q, t in items], block_size)
    query = torch.cat([seq.q[s:s + q] for seq, s, q, _ in items])
    key = torch.cat([seq.k[s:s + q] for seq, s, q, _ in items])
    value = torch.cat([seq.v[s:s + q] for seq, s, q, _ in items])
    out = metadata.backend.forward(query, key, value, cache[0], cache[1], metadata, SCALE)
    assert out.shape == query.shape and out.dtype == query.dtype
    return list(out.split([q for _, _, q, _ in items]))


def blocks_needed(length: int, block_size: int) -> int:
    return -(-length // block_size)


def shuffled_tables(lengths: list[int], block_size: int, rng: random.Random, spare: int = 3):
    """Disjoint, non-contiguous, shuffled block tables drawn from a pool with unused blocks."""
    counts = [blocks_needed(n, block_size) for n in lengths]
    pool = list(range(sum(counts) + spare))
    rng.shuffle(pool)
    tables, i = [], 0
    for c in counts:
        tables.append(pool[i:i + c])
        i += c
    return tables, len(pool)


# ---- (a) isolation ------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_batched_sequences_are_isolated_and_match_naive(ratio, block_size):
    gen = torch.Generator().manual_seed(ratio * 100 + block_size)
    rng = random.Random(block_size)
    # (total length, tokens already cached): prefills, a chunk continuation, decodes.
    specs = [(6, 0), (1, 0), (13, 0), (11, 7), (9, 8), (20, 16)]
    seqs = [make_seq(n, ratio, gen) for n, _ in specs]
    tables, num_blocks = shuffled_tables([n for n, _ in specs], block_size, rng)

    def items(order):
        return [(seqs[i], specs[i][1], specs[i][0] - specs[i][1], tables[i]) for i in order]

    def fresh_cache():
        cache = new_cache(num_blocks, block_size)
        for (n, cached), seq, table in zip(specs, seqs, tables):
            write_prefix(cache, seq, table, cached, block_size)
        return cache

    batched = run_step(fresh_cache(), items(range(len(specs))), block_size)
    for i, ((n, cached), seq) in enumerate(zip(specs, seqs)):
        expected = naive_attention(seq, range(cached, n))
        torch.testing.assert_close(batched[i].double(), expected, rtol=0, atol=ATOL)
        alone = run_step(fresh_cache(), items([i]), block_size)[0]
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-6)

    order = list(range(len(specs)))
    random.Random(7).shuffle(order)
    permuted = run_step(fresh_cache(), items(order), block_size)
    for out, i in zip(permuted, order):
        torch.testing.assert_close(out, batched[i], rtol=0, atol=1e-6)


# ---- (b) causal masking -------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_later_tokens_do_not_affect_earlier_queries(ratio, block_size):
    gen = torch.Generator().manual_seed(ratio + block_size)
    length, changed = 15, 9
    seq = make_seq(length, ratio, gen)
    other = make_seq(7, ratio, gen)  # a neighbour in the batch
    table = list(range(blocks_needed(length, block_size)))
    other_table = list(range(len(table), len(table) + blocks_needed(7, block_size)))
    num_blocks = len(table) + len(other_table)
    before = run_step(new_cache(num_blocks, block_size),
                      [(seq, 0, length, table), (other, 0, 7, other_table)], block_size)

    edited = Seq(seq.q.clone(), seq.k.clone(), seq.v.clone())
    edited.k[changed:] += 5 * torch.randn(length - changed, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    edited.v[changed:] -= 5 * torch.randn(length - changed, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    edited.q[changed + 2] *= -3
    after = run_step(new_cache(num_blocks, block_size),
                     [(edited, 0, length, table), (other, 0, 7, other_table)], block_size)
    assert torch.equal(after[0][:changed], before[0][:changed])
    assert torch.equal(after[1], before[1])
    # Every query from the changed position on does see the change.
    diff = (after[0][changed:] - before[0][changed:]).abs().flatten(1).amax(dim=1)
    assert (diff > 1e-3).all()
    torch.testing.assert_close(after[0].double(), naive_attention(edited, range(length)), rtol=0, atol=ATOL)


# ---- (c) cached prefix / chunked prefill --------------------------------------------------------
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_computation_equals_one_shot(ratio, block_size):
    gen = torch.Generator().manual_seed(3 * ratio + block_size)
    length = 21
    seq = make_seq(length, ratio, gen)
    table = list(range(blocks_needed(length, block_size)))[::-1]  # reversed: not contiguous either
    one_shot = run_step(new_cache(len(table), block_size), [(seq, 0, length, table)], block_size)[0]
    torch.testing.assert_close(one_shot.double(), naive_attention(seq, range(length)), rtol=0, atol=ATOL)

    # Chunk boundaries mid-block and on a block boundary, then single-token decode steps.
    for cuts in ([7], [block_size, 2 * block_size + 3], [5, 17, 18, 19, 20]):
        cuts = sorted({c for c in cuts if 0 < c < length} | {length})
        cache = new_cache(len(table), block_size)
        pieces, start = [], 0
        for end in cuts:
            pieces.append(run_step(cache, [(seq, start, end - start, table)], block_size)[0])
            start = end
        torch.testing.assert_close(torch.cat(pieces), one_shot, rtol=0, atol=1e-5)


# ---- (d) non-contiguous, shuffled block tables --------------------------------------------------
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_shuffled_block_tables_with_shared_cache(ratio, block_size):
    gen = torch.Generator().manual_seed(5 * ratio + block_size)
    rng = random.Random(ratio * block_size)
    lengths = [17, 4, 33]
    seqs = [make_seq(n, ratio, gen) for n in lengths]
    tables, num_blocks = shuffled_tables(lengths, block_size, rng, spare=5)
    assert any(t != sorted(t) or (t and t[-1] - t[0] != len(t) - 1) for t in tables)
    cache = new_cache(num_blocks, block_size)
    # First step: a chunk of each sequence; second step: the rest, reading the first from the cache.
    first = [3, 4, 20]
    out1 = run_step(cache, [(s, 0, f, t) for s, f, t in zip(seqs, first, tables)], block_size)
    rest = [(s, f, n - f, t) for s, f, n, t in zip(seqs, first, lengths, tables) if n > f]
    out2 = run_step(cache, rest, block_size)
    for i, (seq, f, n) in enumerate(zip(seqs, first, lengths)):
        torch.testing.assert_close(out1[i].double(), naive_attention(seq, range(f)), rtol=0, atol=ATOL)
    for (seq, f, q, _), out in zip(rest, out2):
        torch.testing.assert_close(out.double(), naive_attention(seq, range(f, f + q)), rtol=0, atol=ATOL)


# ---- (e) K/V land at slot_mapping ---------------------------------------------------------------
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_keys_and_values_are_written_at_their_slots(ratio, block_size):
    gen = torch.Generator().manual_seed(7 * ratio + block_size)
    rng = random.Random(block_size + 1)
    specs = [(9, 0), (14, 6), (3, 2)]  # (length, cached)
    seqs = [make_seq(n, ratio, gen) for n, _ in specs]
    tables, num_blocks = shuffled_tables([n for n, _ in specs], block_size, rng)
    k_cache, v_cache = new_cache(num_blocks, block_size)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    run_step((k_cache, v_cache), [(s, c, n - c, t) for s, (n, c), t in zip(seqs, specs, tables)], block_size)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for seq, (n, cached), table in zip(seqs, specs, tables):
        for pos in range(cached, n):
            block, offset = table[pos // block_size], pos % block_size
            assert torch.equal(k_cache[block, offset], seq.k[pos])
            assert torch.equal(v_cache[block, offset], seq.v[pos])
            written[block, offset] = True
    assert int(written.sum()) == sum(n - c for n, c in specs)
    # Nothing else in the cache changed.
    assert torch.equal(k_cache[~written], k_before[~written])
    assert torch.equal(v_cache[~written], v_before[~written])


def test_bfloat16_cache_and_inputs():
    gen = torch.Generator().manual_seed(11)
    block_size, ratio = 4, 2
    seq = make_seq(10, ratio, gen)
    table = [2, 0, 1]
    k_cache, v_cache = (c.bfloat16() for c in new_cache(3, block_size))
    metadata = build_metadata([(0, 10, table)], block_size)
    out = metadata.backend.forward(seq.q.bfloat16(), seq.k.bfloat16(), seq.v.bfloat16(), k_cache, v_cache,
                                   metadata, SCALE)
    assert out.dtype == torch.bfloat16
    rounded = Seq(seq.q.bfloat16().float(), seq.k.bfloat16().float(), seq.v.bfloat16().float())
    torch.testing.assert_close(out.double(), naive_attention(rounded, range(10)), rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_backend_over_steps_that_grow_and_shrink(dtype):
    """A backend may keep what it allocates from call to call (the SDPA backend keeps its gather
    buffers): over steps that grow, shrink and grow again, each on caches of its own, every output
    is still the naive attention of its own sequence."""
    gen = torch.Generator().manual_seed(21)
    block_size, backend = 4, BACKEND()
    for step, lengths in enumerate([[30, 9, 17], [5], [3, 41, 2], [12, 12, 12, 12]]):
        seqs = [make_seq(n, 2, gen) for n in lengths]
        rounded = [Seq(*(x.to(dtype).float() for x in (seq.q, seq.k, seq.v))) for seq in seqs]
        tables, num_blocks = shuffled_tables(lengths, block_size, random.Random(step))
        cache = tuple(c.to(dtype) for c in new_cache(num_blocks, block_size, seed=step))
        prompt = len(lengths) - 1  # the last sequence computes its whole prompt, the others decode
        items = [(seq, 0 if i == prompt else n - 1, n if i == prompt else 1, table)
                 for i, (seq, n, table) in enumerate(zip(rounded, lengths, tables))]
        for seq, start, _, table in items:
            write_prefix(cache, seq, table, start, block_size)
        metadata = build_metadata([(start, q, table) for _, start, q, table in items], block_size, backend)
        query, key, value = (torch.cat([getattr(seq, name)[start:start + q] for seq, start, q, _ in items]).to(dtype)
                             for name in ("q", "k", "v"))
        out = backend.forward(query, key, value, cache[0], cache[1], metadata, SCALE)
        for got, (seq, start, q, _) in zip(out.split([q for _, _, q, _ in items]), items):
            torch.testing.assert_close(got.double(), naive_attention(seq, range(start, start + q)), rtol=0,
                                       atol=ATOL if dtype == torch.float32 else 2e-2)


# ---- the same through ModelRunner.prepare_inputs ------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_model_runner_metadata_drives_the_backend(block_size):
    runner = ModelRunner(ModelConfig(str(tiny_model())), CacheConfig(block_size=block_size), torch.device("cpu"),
                         attn_backend=BACKEND())
    gen = torch.Generator().manual_seed(block_size)
    specs = [(12, 5), (1, 0), (19, 0)]  # (length, cached)
    seqs = [make_seq(n, 2, gen) for n, _ in specs]
    tables, num_blocks = shuffled_tables([n for n, _ in specs], block_size, random.Random(3))
    cache = new_cache(num_blocks, block_size)
    for seq, (n, cached), table in zip(seqs, specs, tables):
        write_prefix(cache, seq, table, cached, block_size)
    model_input = runner.prepare_inputs(
        [SequenceInput([1] * (n - c), c, t, "none") for (n, c), t in zip(specs, tables)])
    metadata = model_input.metadata
    expected_positions = [p for n, c in specs for p in range(c, n)]
    assert model_input.positions.tolist() == expected_positions
    assert metadata.slot_mapping.tolist() == [slot_of(t, p, block_size)
                                              for (n, c), t in zip(specs, tables) for p in range(c, n)]
    query = torch.cat([s.q[c:n] for s, (n, c) in zip(seqs, specs)])
    key = torch.cat([s.k[c:n] for s, (n, c) in zip(seqs, specs)])
    value = torch.cat([s.v[c:n] for s, (n, c) in zip(seqs, specs)])
    out = metadata.backend.forward(query, key, value, cache[0], cache[1], metadata, SCALE)
    expected = torch.cat([naive_attention(s, range(c, n)) for s, (n, c) in zip(seqs, specs)])
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL)


# ---- prompt chunks grouped by size ---------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_chunks_are_grouped_with_bounded_padding(seed):
    """Every chunk in exactly one group; no group's padded problem is more than twice its real work
    (one long prompt no longer pads 63 short ones to its length)."""
    from novainfer.attention.backends.torch_ref import _similar_size_groups

    rng = np.random.default_rng(seed)
    query_lens = np.concatenate([rng.integers(2, 300, 63), [1515], np.ones(20, dtype=np.int64)])
    seq_lens = query_lens + rng.integers(0, 500, len(query_lens))
    prompts = np.flatnonzero(query_lens > 1)
    groups = _similar_size_groups(prompts, query_lens, seq_lens)
    assert sorted(np.concatenate(groups).tolist()) == prompts.tolist()
    for group in groups:
        padded = len(group) * query_lens[group].max() * seq_lens[group].max()
        assert padded <= 2 * (query_lens[group] * seq_lens[group]).sum()
    assert len(groups) < 20


def test_decodes_of_very_different_lengths_are_grouped_with_bounded_padding():
    """Decodes whose contexts range from a few tokens to a few hundred are attended in groups whose
    padded keys are at most twice the keys they need (one group padded every context to the
    longest), and each still equals naive attention."""
    block_size, gen = 4, torch.Generator().manual_seed(7)
    lengths = [3, 300, 5, 280, 9, 150, 2, 310, 140, 6]
    seqs = [make_seq(n, 2, gen) for n in lengths]
    tables, num_blocks = shuffled_tables(lengths, block_size, random.Random(5))
    cache = new_cache(num_blocks, block_size)
    for seq, n, table in zip(seqs, lengths, tables):
        write_prefix(cache, seq, table, n - 1, block_size)
    outs = run_step(cache, [(seq, n - 1, 1, table) for seq, n, table in zip(seqs, lengths, tables)], block_size)
    for seq, n, out in zip(seqs, lengths, outs):
        torch.testing.assert_close(out.double(), naive_attention(seq, range(n - 1, n)), rtol=0, atol=ATOL)
    metadata = build_metadata([(n - 1, 1, table) for n, table in zip(lengths, tables)], block_size)
    groups = metadata.backend_data.groups
    assert len(groups) > 1
    for group in groups:
        needed = sum(lengths[i] for i in group.token_index.tolist())
        assert group.num_seqs * group.max_ctx <= 2 * needed, (group.num_seqs, group.max_ctx)
