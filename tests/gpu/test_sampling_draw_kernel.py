"""The fused whole-vocabulary draw and the candidate draw (Triton, novainfer.sample.ops) against the
torch sampler they replace on CUDA. On a GPU, or on CPU tensors under ``TRITON_INTERPRET=1``.

Oracles: for the same Exp(1) noise, the torch path's token (min_tokens, penalties, then argmax for
greedy rows and the exponential race over softmax(logits / temperature) for the others; top-k,
top-p and min-p masks on sorted candidates); the log-sum-exp of the raw logits
(``torch.logsumexp``, within 1e-5 absolute: float32 sums in another order and ``exp``/``log``
within a few ulps). On a GPU
also: the sampler's CUDA path gives the CPU sampler's tokens for seeded and greedy rows, logprobs
equal to a float64 ``log_softmax`` of the logits within 5e-5 absolute (a float32 sum of 152k terms
whose largest ones dominate is good to about sqrt(V) ulps: 1.9e-5 was seen against float32 torch),
and draws that follow the distribution (the bounds of tests/test_sampler.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from novainfer.sample import Sampler, SamplingMetadata  # noqa: E402
from novainfer.sample.ops import draw_candidates, draw_nucleus, draw_whole_vocabulary, warm_up_draw  # noqa: E402
from novainfer.sample.rng import exponential_noise_torch  # noqa: E402
from novainfer.sample.state import SamplingStateTable  # noqa: E402
from novainfer.sample.sampler import (  # noqa: E402
    _min_p_probs, apply_penalties_and_min_tokens, mask_sorted_top_k_top_p, random_sample, sampling_probs)
from novainfer.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.triton_env import DEVICE, DTYPES, INTERPRET, MARKS  # noqa: E402
from tests.test_sampler import NUM_DRAWS, PROBS, TEMPERED, TOLERANCE, renormalized  # noqa: E402

pytestmark = MARKS

# Under the interpreter: a small vocabulary cut into several chunks with a partial last one.
VOCAB, BLOCK = (1000, 256) if INTERPRET else (151_936, 4096)
LSE_ATOL = 1e-5
LOGPROB_ATOL = 5e-5
STOP_IDS = [3, 700, VOCAB - 1]

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0),  # ties across chunks
    SamplingParams(temperature=0.0, repetition_penalty=2.0),  # a tie made by the penalty
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, seed=7),
    SamplingParams(temperature=0.8, repetition_penalty=1.1, seed=8),
    SamplingParams(temperature=1.0, repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=0.6),
    SamplingParams(temperature=0.0, frequency_penalty=-0.3, presence_penalty=1.5),
    SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=STOP_IDS, seed=9),
    SamplingParams(temperature=0.9),  # all but three logits -inf
]


def batch(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, SamplingMetadata]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(PARAMS), VOCAB, generator=generator) * 3
    top = logits.max() + 1
    logits[1, [BLOCK + 5, 2 * BLOCK + 9]] = top  # equal maxima in two chunks: the lower id wins
    logits[2] = logits[2].clamp(max=1.0)
    logits[2, 50], logits[2, 40] = 3.0, 1.5  # 3.0 / 2 (token 50 is in the prompt) ties 1.5 at a lower id
    logits[9] = float("-inf")
    logits[9, [2, BLOCK + 1, VOCAB - 2]] = torch.tensor([0.5, 0.0, 1.0])
    logits[8, STOP_IDS] = top  # forbidden by min_tokens
    # Row 7's output has token 10 three times and 20 once: 10 ends at top - 0.6, 20 at top - 1.2.
    logits[7, [10, 20, 30]] = torch.tensor([top, top, top - 1.0])
    prompts = [torch.randint(0, VOCAB, (40,), generator=generator).tolist() for _ in PARAMS]
    prompts[2] = [50]
    # Few distinct tokens, so that some occur several times (counts above 1).
    outputs = [torch.randint(0, 60, (20,), generator=generator).tolist() for _ in PARAMS]
    outputs[8] = outputs[8][:2]
    outputs[2] = []
    outputs[7] = [10, 10, 10, 20]
    # The requests sit in table rows neither in order nor contiguous: the fused draw reads each
    # row's penalty state where the table keeps it.
    table = SamplingStateTable(VOCAB, torch.device(DEVICE))
    rows = [3 * i + 2 for i in reversed(range(len(PARAMS)))]
    table.add_requests(rows, PARAMS, prompts, outputs)
    metadata = table.gather(np.asarray(rows, dtype=np.int64), np.asarray([len(o) for o in outputs], dtype=np.int64))
    return logits.to(dtype), metadata


def step_keys(metadata: SamplingMetadata, seed: int) -> torch.Tensor:
    rows = metadata.temperature.shape[0]
    keys = torch.randint(0, 2**32, (rows,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return torch.where(metadata.is_seeded, metadata.noise_keys, keys)


def torch_draw(logits: torch.Tensor, metadata: SamplingMetadata, keys: torch.Tensor) -> torch.Tensor:
    """The torch sampler's token for each row, given each row's noise keys."""
    penalized = apply_penalties_and_min_tokens(logits.float(), metadata)
    noise = exponential_noise_torch(keys, torch.arange(VOCAB, device=keys.device))
    drawn = random_sample(sampling_probs(penalized, metadata), noise)
    return torch.where(metadata.is_greedy, penalized.argmax(dim=-1), drawn)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
def test_draw_equals_the_torch_path_for_the_same_noise(dtype):
    for seed in range(3):
        logits, metadata = batch(dtype, seed)
        keys = step_keys(metadata, seed)
        tokens, lse, recorded = draw_whole_vocabulary(logits.to(DEVICE), metadata, keys, with_lse=True, block=BLOCK)
        assert not recorded  # not asked to
        expected = torch_draw(logits.to(DEVICE), metadata, keys)
        assert tokens.dtype == torch.int64
        assert tokens.tolist() == expected.tolist()
        assert tokens[1].item() == BLOCK + 5 and tokens[2].item() == 40
        assert tokens[7].item() == 10 and tokens[8].item() not in STOP_IDS
        assert tokens[9].item() in (2, BLOCK + 1, VOCAB - 2)
        torch.testing.assert_close(lse.cpu(), torch.logsumexp(logits.float(), dim=-1), rtol=0, atol=LSE_ATOL)

        without_lse, none, _ = draw_whole_vocabulary(logits.to(DEVICE), metadata, keys, with_lse=False, block=BLOCK)
        assert none is None and torch.equal(without_lse, tokens)


def test_a_recording_draw_updates_the_penalty_state_as_record_sampled_does():
    """With ``record`` the draw's last launch adds each row's token to its table row's output counts
    and seen mask, also where two step rows share a table row. Oracle: a second table of the same
    requests, the torch path's tokens recorded by SamplingStateTable.record_sampled, over several
    steps (each step's penalties read what the steps before recorded)."""
    generator = torch.Generator().manual_seed(4)
    params = [p for p in PARAMS if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
    prompts = [torch.randint(0, VOCAB, (30,), generator=generator).tolist() for _ in params]
    outputs = [torch.randint(0, 60, (10,), generator=generator).tolist() for _ in params]
    rows = [2 * i + 1 for i in range(len(params))]
    tables = [SamplingStateTable(VOCAB, torch.device(DEVICE), seed=1) for _ in range(2)]
    for table in tables:
        table.add_requests(rows, params, prompts, outputs)
    step_rows = np.asarray(rows + rows[:2], dtype=np.int64)  # two table rows sampled twice in the step
    for step in range(3):
        logits = (torch.randn(len(step_rows), VOCAB, generator=generator) * 3).to(DEVICE)
        positions = np.full(len(step_rows), 10 + step, dtype=np.int64)
        metadata = [table.gather(step_rows, positions) for table in tables]
        tokens, _, recorded = draw_whole_vocabulary(logits, metadata[0], metadata[0].noise_keys, with_lse=False,
                                                    block=BLOCK, record=True)
        expected = torch_draw(logits, metadata[1], metadata[1].noise_keys)
        assert recorded and tokens.tolist() == expected.tolist()
        tables[1].record_sampled(metadata[1], expected)
        assert torch.equal(tables[0].output_counts, tables[1].output_counts)
        assert torch.equal(tables[0].seen_mask, tables[1].seen_mask)


def test_all_greedy_rows_need_no_keys():
    logits, metadata = batch(torch.float32, 0)
    greedy = [SamplingParams(temperature=0.0)] * len(PARAMS)
    metadata = SamplingMetadata.from_requests(greedy, [[]] * len(greedy), [[]] * len(greedy), DEVICE, VOCAB)
    tokens, _, _ = draw_whole_vocabulary(logits.to(DEVICE), metadata, None, with_lse=False, block=BLOCK)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_a_draw_after_the_warm_up_reads_each_per_row_value_from_its_own_tensor():
    """The warm-up passes one tensor as both temperature and repetition penalty, for one row; later
    one-row draws must still read each from its own tensor (a launch kept from the warm-up's call
    could not tell them apart). Two close logits, temperature 0.05 against a penalty of 8 (which a
    confused draw would take as the temperature), twenty noise keys: each token the torch path's."""
    warm_up_draw(torch.zeros(1, VOCAB, device=DEVICE))
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 10], logits[0, 20] = 3.0, 2.9
    params = [SamplingParams(temperature=0.05, repetition_penalty=8.0)]
    metadata = SamplingMetadata.from_requests(params, [[]], [[]], DEVICE, VOCAB)
    for seed in range(20):
        keys = torch.randint(0, 2**32, (1,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        tokens, _, _ = draw_whole_vocabulary(logits.to(DEVICE), metadata, keys, with_lse=False, block=BLOCK)
        assert tokens.tolist() == torch_draw(logits.to(DEVICE), metadata, keys).tolist()


def test_draws_of_one_shape_read_each_steps_penalties_from_the_table():
    """The sampling table's per-row penalties are strided columns of its gathered parameters, which
    the draw takes as contiguous copies: two draws of one shape over other requests must each read
    their own (a launch kept from the first call must not keep reading its copy). Each row's
    argmax is three times in its output, so the penalties decide the token; oracle: the torch path."""
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, VOCAB, generator=generator) * 3).to(DEVICE)
    outputs = [[int(token)] * 3 for token in logits.argmax(dim=-1).tolist()]
    steps = [((0, 1), [(2.0, 0.0), (0.0, 2.0)]), ((2, 3), [(0.0, 0.0), (-2.0, 0.5)])]
    table = SamplingStateTable(VOCAB, torch.device(DEVICE), seed=1)
    keys = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    found = []
    for rows, penalties in steps:
        params = [SamplingParams(temperature=0.0, frequency_penalty=f, presence_penalty=p) for f, p in penalties]
        table.add_requests(list(rows), params, [[5, 6], [7, 8]], outputs)
        metadata = table.gather(np.asarray(rows, dtype=np.int64), np.zeros(2, dtype=np.int64))
        tokens, _, _ = draw_whole_vocabulary(logits, metadata, None, with_lse=False, block=BLOCK)
        assert tokens.tolist() == torch_draw(logits, metadata, keys).tolist()
        found.append(tokens.tolist())
    assert found[0] != found[1], "the two steps' penalties must give different tokens, or this test shows nothing"


CANDIDATE_PARAMS = [
    SamplingParams(temperature=0.0),  # the first candidate
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.2, top_k=3, seed=1),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=2),
    SamplingParams(temperature=0.8, top_k=1),
    SamplingParams(temperature=1.5, top_k=40, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=30, top_p=1e-6),  # the top candidate only
]


@pytest.mark.parametrize("seed", range(3))
def test_candidate_draw_equals_the_torch_stages_for_the_same_noise(seed):
    """Oracle: Sampler._sample's torch stages on the same candidates (top-k, top-p and min-p masks,
    then the exponential race with the same noise), greedy rows the first candidate."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(CANDIDATE_PARAMS), VOCAB, generator=generator) * 2
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # equal maxima: the lowest id, as argmax
    values, ids = logits.sort(dim=-1, descending=True, stable=True)
    values, ids = values[:, :40], ids[:, :40]
    # The kernel's metadata on its device; the reference's on the CPU, with the candidates.
    metadata, reference = (SamplingMetadata.from_requests(CANDIDATE_PARAMS, [[]] * len(CANDIDATE_PARAMS),
                                                          [[]] * len(CANDIDATE_PARAMS), device, VOCAB)
                           for device in (DEVICE, "cpu"))
    keys = step_keys(metadata, seed)
    tokens = draw_candidates(values.to(DEVICE), ids.to(DEVICE), metadata, keys)

    probs = _min_p_probs(mask_sorted_top_k_top_p(values / reference.temperature.unsqueeze(1), reference.top_k,
                                                 reference.top_p), reference)
    choice = random_sample(probs, exponential_noise_torch(keys.cpu(), ids))
    expected = torch.where(reference.is_greedy, ids[:, 0], ids.gather(1, choice.unsqueeze(1)).squeeze(1))
    assert tokens.tolist() == expected.tolist()
    assert tokens[[0, 5, 7]].tolist() == [3, ids[5, 0].item(), ids[7, 0].item()]


NUCLEUS_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5, seed=3),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05, seed=4),
    SamplingParams(temperature=1.0),  # no cut: the whole-vocabulary draw stands
    SamplingParams(temperature=1.0, top_p=1e-6),  # the top token only
    SamplingParams(temperature=0.9, top_p=0.5),  # three equal maxima: the two lowest ids are kept
    SamplingParams(temperature=1.1, top_p=0.8, repetition_penalty=1.3, min_tokens=3, stop_token_ids=STOP_IDS),
    SamplingParams(temperature=2.0, top_p=0.3, min_p=0.9),  # flat: many passes
    SamplingParams(temperature=1.0, min_p=0.5, seed=5),  # flat: the min-p set at once
]
TIED = [2, BLOCK + 1, VOCAB - 2]


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize("seed", range(3))
def test_nucleus_draw_equals_the_torch_stages_for_the_same_noise(dtype, seed):
    """Oracle: the torch path's token (penalties, then top-p and min-p masks on the sorted
    vocabulary and the exponential race) for the same noise."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(NUCLEUS_PARAMS)
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    logits[6, 17] = logits[6].max() + 0.01  # the top token of the top-p 1e-6 row
    logits[7] = -30.0
    logits[7, TIED] = 5.0
    logits[9:] = torch.randn(2, VOCAB, generator=generator) * 0.1
    prompts = [torch.randint(0, VOCAB, (30,), generator=generator).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, 60, (2,), generator=generator).tolist() for _ in range(rows)]
    logits = logits.to(dtype).to(DEVICE)
    # Without penalties the kernel reads the logits in their own dtype; with them, float32 ones.
    without_penalties = [*NUCLEUS_PARAMS[:8], SamplingParams(temperature=1.1, top_p=0.8), *NUCLEUS_PARAMS[9:]]
    for params in (NUCLEUS_PARAMS, without_penalties):
        metadata = SamplingMetadata.from_requests(params, outputs, prompts, DEVICE, VOCAB)
        for step in range(4):
            keys = step_keys(metadata, 10 * seed + step)
            tokens = draw_nucleus(apply_penalties_and_min_tokens(logits, metadata), metadata, keys, block=BLOCK,
                                  pass_block=BLOCK)
            assert tokens.tolist() == torch_draw(logits, metadata, keys).tolist()
            assert tokens[6].item() == 17 and tokens[7].item() in TIED[:2]
            assert params[8].min_tokens == 0 or tokens[8].item() not in STOP_IDS


# ---------------------------------------------------------------- the sampler's CUDA path (GPU)


@pytest.mark.gpu
def test_cuda_sampler_gives_the_cpu_samplers_seeded_and_greedy_tokens_and_logprobs():
    params = [dataclasses.replace(p, logprobs=5 if i % 2 else None) for i, p in enumerate(PARAMS)]
    params[3] = dataclasses.replace(params[3], seed=11)  # every random row seeded: all comparable
    params[6] = dataclasses.replace(params[6], seed=12)
    params[9] = dataclasses.replace(params[9], seed=13)
    for seed in range(3):
        logits, _ = batch(torch.bfloat16, seed)
        generator = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, VOCAB, (40,), generator=generator).tolist() for _ in params]
        outputs = [torch.randint(0, VOCAB, (2,), generator=generator).tolist() for _ in params]
        results = {}
        for device in ("cpu", "cuda"):
            metadata = SamplingMetadata.from_requests(params, outputs, prompts, device, VOCAB)
            results[device] = Sampler()(logits.to(device), metadata)
        cpu, cuda = results["cpu"], results["cuda"]
        assert cuda.sampled_token_ids.tolist() == cpu.sampled_token_ids.tolist()
        cuda_ids, cpu_ids = cuda.logprobs.token_ids.cpu(), cpu.logprobs.token_ids
        assert cuda_ids[:, 0].tolist() == cpu_ids[:, 0].tolist()  # the sampled tokens'
        # The top alternatives are the largest logits, in order; among equal logits (the batch has
        # ties) either device may name another of the tied tokens.
        assert logits.gather(1, cuda_ids[:, 1:]).tolist() == logits.gather(1, cpu_ids[:, 1:]).tolist()
        assert all(len(set(row)) == len(row) for row in cuda_ids[:, 1:].tolist())
        assert cuda.logprobs.sampled_token_ranks.tolist() == cpu.logprobs.sampled_token_ranks.tolist()
        reference = logits.double().log_softmax(dim=-1).gather(1, cuda_ids).float()
        torch.testing.assert_close(cuda.logprobs.logprobs.cpu(), reference, rtol=0, atol=LOGPROB_ATOL)


def test_nucleus_draw_ends_on_rows_of_nan_or_minus_infinity():
    """Broken logits (NaN anywhere, or every logit -inf) must not keep the checking passes going:
    each row still gets a token id of the vocabulary, and the other rows theirs."""
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0.9, top_p=0.5, min_p=0.2), SamplingParams(temperature=0.7, top_p=0.9)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, ::7] = float("nan")
    logits[1] = float("-inf")
    logits[2] = float("nan")
    metadata = SamplingMetadata.from_requests(params, [[]] * len(params), [[]] * len(params), DEVICE, VOCAB)
    keys = torch.randint(0, 2**32, (len(params),), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tokens = draw_nucleus(logits.to(DEVICE), metadata, keys, block=BLOCK, pass_block=BLOCK).cpu()
    assert all(0 <= t < VOCAB for t in tokens.tolist())
    assert tokens[3].item() == torch_draw(logits.to(DEVICE), metadata, keys)[3].item()


def test_every_kernel_path_gives_in_vocabulary_ids_for_rows_of_nan():
    """The same for a step through every kernel path at once (greedy, top-k candidates, the plain
    whole-vocabulary draw, the checking passes): NaN logits never yield an id past the vocabulary."""
    from novainfer.sample.sampler import _sample_with_kernels

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.8, top_k=5, min_p=0.1)]
    generator = torch.Generator().manual_seed(2)
    for every in (1, 3):
        logits = torch.randn(len(params), VOCAB, generator=generator)
        logits[:, ::every] = float("nan")
        metadata = SamplingMetadata.from_requests(params, [[]] * len(params), [[]] * len(params), DEVICE, VOCAB)
        tokens = _sample_with_kernels(logits.to(DEVICE), metadata).tolist()
        assert all(0 <= t < VOCAB for t in tokens), (every, tokens)


MIXED_PARAMS = [SamplingParams(temperature=0.8, top_k=20, top_p=0.7, seed=1), SamplingParams(temperature=0.9, top_p=0.9,
                                                                                            seed=2),
                SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.7, top_k=5, min_p=0.2, seed=4),
                SamplingParams(temperature=1.1, min_p=0.05, seed=5)]


def test_kernels_of_a_step_mixing_rows_with_and_without_a_top_k_draw_the_torch_stages_tokens():
    """The kernels' routing of such a step (top-k candidates for some rows, the whole-vocabulary
    draw with checking passes for the others, whose passes skip the top-k rows), on a GPU or under
    the interpreter. Oracle: the sampler's torch stages (which sort the vocabulary) on CPU tensors,
    for the same seeded rows."""
    from novainfer.sample.sampler import _sample_with_kernels

    generator = torch.Generator().manual_seed(4)
    for step in range(3):
        logits = torch.randn(len(MIXED_PARAMS), VOCAB, generator=generator) * 3
        history = [torch.randint(0, VOCAB, (3,), generator=generator).tolist() for _ in MIXED_PARAMS]
        metadata = {device: SamplingMetadata.from_requests(MIXED_PARAMS, history, [[1, 2]] * len(MIXED_PARAMS),
                                                           device, VOCAB) for device in ("cpu", DEVICE)}
        kernels = _sample_with_kernels(logits.to(DEVICE), metadata[DEVICE])
        assert kernels.tolist() == Sampler._sample(logits, metadata["cpu"]).tolist(), step


@pytest.mark.gpu
def test_cuda_sampler_mixing_rows_with_and_without_a_top_k_gives_the_cpu_samplers_tokens():
    """A step where some random rows have a top-k and others a top-p, a min-p or nothing: the top-k
    rows draw among the Triton top-k's candidates, the others from the whole vocabulary with the
    checking passes. Oracle: the CPU sampler (which sorts the vocabulary) for the same seeded rows."""
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0.9, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=4), SamplingParams(temperature=1.1, min_p=0.05,
                                                                                          seed=5),
              SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.2, seed=6)]
    generator = torch.Generator().manual_seed(3)
    for step in range(4):
        logits = (torch.randn(len(params), VOCAB, generator=generator) * 3).to(torch.bfloat16)
        outputs = [torch.randint(0, VOCAB, (3,), generator=generator).tolist() for _ in params]
        tokens = {device: Sampler()(logits.to(device), SamplingMetadata.from_requests(
            params, outputs, [[1, 2]] * len(params), device, VOCAB)).sampled_token_ids.tolist()
            for device in ("cpu", "cuda")}
        assert tokens["cuda"] == tokens["cpu"], step


@pytest.mark.gpu
@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), TEMPERED),
    (SamplingParams(top_k=2), renormalized([1, 1, 0, 0, 0])),  # the top-k candidates' draw
    (SamplingParams(top_p=0.8), renormalized([1, 1, 1, 0, 0])),  # top-p alone: the checking passes
    (SamplingParams(min_p=0.25), renormalized([1, 1, 1, 0, 0])),  # 0.15 >= 0.25 * 0.5 > 0.07
    (SamplingParams(temperature=0.5, top_p=0.85), renormalized([1, 1, 0, 0, 0], TEMPERED)),
    (SamplingParams(top_k=4, top_p=0.8), renormalized([1, 1, 1, 0, 0])),
], ids=["temperature1", "temperature0.5", "top_k2", "top_p0.8", "min_p0.25", "temp_then_top_p",
                        "top_k4_top_p0.8"])
@pytest.mark.parametrize("seeded", [False, True], ids=["step_keys", "seeded"])
def test_cuda_draws_follow_the_distribution(params, expected, seeded):
    torch.manual_seed(6)
    logits = PROBS.log().expand(NUM_DRAWS, -1).contiguous().cuda()
    rows = [dataclasses.replace(params, seed=row) for row in range(NUM_DRAWS)] if seeded else [params] * NUM_DRAWS
    metadata = SamplingMetadata.from_requests(rows, [[]] * NUM_DRAWS, [[]] * NUM_DRAWS, "cuda", len(PROBS))
    tokens = Sampler()(logits, metadata).sampled_token_ids.cpu()
    freq = torch.bincount(tokens, minlength=len(PROBS)).float() / NUM_DRAWS
    assert (freq - expected).abs().max().item() < TOLERANCE, (freq, expected)
    assert torch.all(freq[expected == 0] == 0), "a token outside the allowed set was sampled"


@pytest.mark.gpu
def test_engine_tokens_with_penalties_recorded_in_the_draw_equal_those_recorded_by_the_table(monkeypatch):
    """The engine's decode steps with penalties record their tokens in the fused draw's last launch;
    with that turned off (SamplingStateTable.record_sampled records them instead) every seeded
    request gets the same tokens, over enough steps that each reads many recorded ones."""
    from novainfer import LLM
    from novainfer.sample import ops
    from tests.utils import random_ids, tiny_model

    settings = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5),
                dict(repetition_penalty=0.8, frequency_penalty=-0.4), dict(temperature=0.0, presence_penalty=1.2)]
    params = [SamplingParams(temperature=s.pop("temperature", 0.9), seed=i, max_tokens=48, ignore_eos=True, **s)
              for i, s in enumerate(settings * 2)]
    results = []
    for fused in (True, False):
        if not fused:
            draw = ops.draw_whole_vocabulary
            monkeypatch.setattr(ops, "draw_whole_vocabulary",
                                lambda *args, **kwargs: draw(*args, **{**kwargs, "record": False}))
        llm = LLM(str(tiny_model()), device="cuda", dtype="float32")
        vocab_size = llm.llm_engine.model_config.vocab_size
        outputs = llm.generate([{"prompt_token_ids": random_ids(i, 12, vocab_size)} for i in range(len(params))],
                               params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        llm.shutdown()
    assert results[0] == results[1]
