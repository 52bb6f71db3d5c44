"""The Triton top-k (novainfer.sample.topk) against a stable descending sort, whose first k entries
are exactly the k largest values with the lowest ids first among equal ones: the kernel's stated
order. On a GPU, or on CPU tensors under ``TRITON_INTERPRET=1`` (a small vocabulary cut into
several chunks with a partial last one).

The sampler uses it on CUDA in place of ``torch.topk``; the GPU test checks that the sampler's
seeded top-k draws and logprobs then equal the CPU sampler's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from novainfer.sample import Sampler, SamplingMetadata  # noqa: E402
from novainfer.sample.sampler import LogprobsTensors  # noqa: E402
from novainfer.sample.topk import MAX_K, top_k, top_k_logprobs  # noqa: E402
from novainfer.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.triton_env import DEVICE, DTYPES, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS

VOCAB, BLOCK = (1000, 256) if INTERPRET else (151_936, 4096)
# Rows of more than four chunks at every k (a short row on the GPU, where 4096 slots per chunk
# group would make a slow test).
SMALL_VOCAB, SMALL_BLOCK = (1000, 64) if INTERPRET else (4000, 256)


def rows(dtype: torch.dtype, seed: int, vocab: int = VOCAB, block: int = BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=generator) * 3
    logits[1] = 0.5  # every value equal: the lowest ids
    logits[2] = float("-inf")  # fewer finite values than k: the -inf ones by lowest id
    logits[2, [5, block + 3, vocab - 1]] = torch.tensor([1.0, 2.0, 1.0])
    logits[3] = torch.randint(0, 4, (vocab,), generator=generator).float() - 2  # many ties, both signs
    logits[4, vocab - 7:] = logits[4].max() + 1  # the largest values in the partial last chunk
    return logits.to(dtype)


def expected(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


@pytest.mark.parametrize("vocab, block", [(VOCAB, BLOCK), (SMALL_VOCAB, SMALL_BLOCK)], ids=["block", "small_block"])
@pytest.mark.parametrize("dtype, k", [(dtype, k) for dtype in dict.fromkeys([torch.float32, *DTYPES])
                                      for k in (1, 5, 50)] + [(torch.float32, MAX_K)])
def test_top_k_equals_the_first_k_of_a_stable_descending_sort(dtype, k, vocab, block):
    """Rows of equal values give every chunk more than k entries at the threshold, so each appends
    its k largest; with the small block there are more than four chunks, so such a row's candidates
    take the merge's sort of all slots rather than of the first few."""
    logits = rows(dtype, k, vocab, block)
    values, ids = top_k(logits.to(DEVICE), k, block=block)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and values.shape == ids.shape == (6, k)
    want_values, want_ids = expected(logits, k)
    assert torch.equal(values.cpu(), want_values)
    assert torch.equal(ids.cpu(), want_ids)


def test_a_chunk_where_more_than_k_reach_the_threshold_gives_its_k_largest():
    """Most chunks append the few entries at or above the row's threshold; the second chunk's first
    half holds one value many times over (more than k entries reach the threshold), so that chunk
    appends its k largest instead, the lowest ids among the equal ones, beside a larger value
    in the third chunk."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) - 10
    logits[:, BLOCK:BLOCK + BLOCK // 2] = 10.0
    logits[1, 2 * BLOCK + 7] = 11.0
    values, got = top_k(logits.to(DEVICE), 5, block=BLOCK)
    want_values, want_ids = expected(logits, 5)
    assert torch.equal(got.cpu(), want_ids) and torch.equal(values.cpu(), want_values)
    assert want_ids[0].tolist() == list(range(BLOCK, BLOCK + 5)) and want_ids[1, 0].item() == 2 * BLOCK + 7


def test_rows_with_a_stride():
    wide = rows(torch.float32, 1)
    padded = torch.cat([wide, torch.zeros(6, 24)], dim=1)[:, :VOCAB]
    values, ids = top_k(padded.to(DEVICE), 7, block=BLOCK)
    assert torch.equal(ids.cpu(), expected(wide, 7)[1])


def test_a_shape_seen_before_repeats_its_launches_on_other_tensors():
    """On CUDA a repeated shape replays its kept launches (topk._Plan) with the new call's tensors:
    other values, a pointer off 16-byte alignment (another specialization, so another plan), a
    larger batch (its scratch replaces the arena the first plans were carved from) and then the
    first shape again; the same for logprobs given a sampled token and a log-sum-exp. A kept
    launch holds none of the tensors of the call that made it."""
    import gc
    import weakref

    calls = [(rows(torch.float32, 11), False), (rows(torch.float32, 12), False), (rows(torch.float32, 13), True),
             (torch.cat([rows(torch.float32, 14), rows(torch.float32, 15)]), False), (rows(torch.float32, 16), False)]
    for logits, off_alignment in calls:
        on_device = _off_alignment(logits) if off_alignment else logits.to(DEVICE)
        values, ids = top_k(on_device, 5, block=BLOCK)
        want_values, want_ids = expected(logits, 5)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(values.cpu(), want_values)
        sampled = want_ids[:, 3].contiguous()
        lse = torch.logsumexp(logits, dim=-1)
        out = LogprobsTensors(top_k_logprobs(on_device, sampled.to(DEVICE), 2, lse.to(DEVICE), block=BLOCK))
        assert torch.equal(out.token_ids.cpu(), torch.cat([sampled.unsqueeze(1), want_ids[:, :2]], dim=1))
        want_ranks = (logits > logits.gather(1, sampled.unsqueeze(1))).sum(dim=-1) + 1
        assert out.sampled_token_ranks.tolist() == want_ranks.tolist()
    first = rows(torch.float32, 17).to(DEVICE)
    gone = weakref.ref(first)
    top_k(first, 7, block=BLOCK)
    del first
    gc.collect()
    assert gone() is None, "a kept launch must not keep its first call's logits alive"


def _off_alignment(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` on the device, its data starting one element past a 16-byte boundary."""
    flat = torch.empty(logits.numel() + 1, dtype=logits.dtype, device=DEVICE)[1:]
    assert flat.data_ptr() % 16
    return flat.view(logits.shape).copy_(logits)


@pytest.mark.parametrize("k", [0, MAX_K + 1])
def test_k_out_of_range_raises(k):
    with pytest.raises(ValueError, match="k must be in"):
        top_k(torch.zeros(2, VOCAB, device=DEVICE), k)


@pytest.mark.parametrize("num_logprobs", [0, 5])
@pytest.mark.parametrize("lse_given", [False, True], ids=["lse_computed", "lse_given"])
def test_logprobs_mode_gives_the_sampled_and_top_logprobs_and_ranks(num_logprobs, lse_given):
    """Oracles: the first n of a stable descending sort, ``torch.logsumexp`` of the logits (within
    1e-5: float32 sums in another order), ranks counted with ``>`` over the whole row."""
    logits = rows(torch.float16, 4)
    exact = logits.float()
    top_ids = exact.sort(dim=-1, descending=True, stable=True).indices
    # A top token, a tied one (row 1, every value equal), a -inf one (row 2), one outside the top
    # (row 3's values take four levels, about VOCAB / 4 tokens each: halfway down the sort is below
    # the top level for any vocabulary), the last id, -inf.
    sampled = torch.stack([top_ids[0, 0], top_ids[1, 9], top_ids[2, 2], top_ids[3, VOCAB // 2], top_ids[4, VOCAB - 1],
                           torch.tensor(VOCAB - 1)])
    lse = torch.logsumexp(exact, dim=-1)
    packed = top_k_logprobs(logits.to(DEVICE), sampled.to(DEVICE), num_logprobs,
                            lse.to(DEVICE) if lse_given else None, block=BLOCK)
    out = LogprobsTensors(packed)
    ids, logprobs, ranks = out.token_ids, out.logprobs, out.sampled_token_ranks
    # The kernel lays its tensor out as the torch path packs the three columns.
    assert torch.equal(packed, LogprobsTensors.of(ids.contiguous(), logprobs.contiguous(), ranks.contiguous()).pack())
    want_ids = torch.cat([sampled.unsqueeze(1), top_ids[:, :num_logprobs]], dim=1)
    assert ids.dtype == ranks.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(logprobs.cpu(), exact.gather(1, want_ids) - lse.unsqueeze(1), rtol=0, atol=1e-5)
    want_ranks = (exact > exact.gather(1, sampled.unsqueeze(1))).sum(dim=-1) + 1
    assert ranks.cpu().tolist() == want_ranks.tolist()
    # The data cover the cases above: the tied token shares the best rank, row 3's is outside the top.
    assert want_ranks[1].item() == 1 and want_ranks[3].item() > 5


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_greedy_logprobs_take_the_top_entry_as_the_token(num_logprobs):
    """Without a sampled token the logprobs mode's token is each row's argmax (lowest id among
    equal maxima, as ``torch.argmax``), of rank 1: what the mode gives when handed that argmax."""
    logits = rows(torch.float16, 5).to(DEVICE)
    argmax = logits.float().argmax(dim=-1)
    given = LogprobsTensors(top_k_logprobs(logits, argmax, num_logprobs, None, block=BLOCK))
    found = LogprobsTensors(top_k_logprobs(logits, None, num_logprobs, None, block=BLOCK))
    assert torch.equal(found.token_ids, given.token_ids)
    assert torch.equal(found.sampled_token_ranks, given.sampled_token_ranks)
    assert torch.equal(found.sampled_token_ids, argmax) and found.sampled_token_ranks.tolist() == [1] * logits.shape[0]
    torch.testing.assert_close(found.logprobs, given.logprobs, rtol=0, atol=0)


# ---------------------------------------------------------------- the sampler's CUDA path (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("penalty", [1.0, 1.2], ids=["raw_logits", "penalized_float32"])
def test_cuda_top_k_sampler_gives_the_cpu_samplers_seeded_tokens_and_logprobs(penalty):
    """Seeded top-k rows draw the counter-based noise of their candidates, so both devices pick the
    same token wherever they have the same candidates; the logits are distinct (no tie at the k-th
    place), so they do."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, VOCAB, generator=generator).mul(4)
    distinct = logits.sort(dim=-1, descending=True).values[:, :MAX_K + 1]
    assert bool((distinct[:, :-1] != distinct[:, 1:]).all())
    ks = [1, 5, 20, 50, 64, 100, MAX_K]
    params = [SamplingParams(temperature=0.9, top_k=ks[i % len(ks)], top_p=(0.8, 1.0)[i % 2], seed=i,
                             repetition_penalty=penalty, logprobs=(3, 20)[i % 2]) for i in range(64)]
    prompts = [torch.randint(0, VOCAB, (30,), generator=generator).tolist() for _ in params]
    results = {}
    for device in ("cpu", "cuda"):
        metadata = SamplingMetadata.from_requests(params, [[]] * len(params), prompts, device, VOCAB)
        results[device] = Sampler()(logits.to(device), metadata)
    cpu, cuda = results["cpu"], results["cuda"]
    assert cuda.sampled_token_ids.tolist() == cpu.sampled_token_ids.tolist()
    assert cuda.logprobs.token_ids.tolist() == cpu.logprobs.token_ids.tolist()
    assert cuda.logprobs.sampled_token_ranks.tolist() == cpu.logprobs.sampled_token_ranks.tolist()
    torch.testing.assert_close(cuda.logprobs.logprobs.cpu(), cpu.logprobs.logprobs, rtol=0, atol=5e-5)
