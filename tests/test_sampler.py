import dataclasses
import math

import pytest
import torch

from novainfer.sample import LogprobsTensors, Sampler, SamplingMetadata
from novainfer.sample.rng import exponential_noise, row_keys, seed_lanes, uniform_from_bits
from novainfer.sample.sampler import apply_penalties, draw_in_nucleus, inverse_cdf_sample, random_sample
from novainfer.sampling_params import SamplingParams


def build_metadata(params, vocab_size, outputs=None, prompts=None):
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        "cpu",
        vocab_size,
    )


def sample(logits, params, **kwargs):
    metadata = build_metadata(params, logits.shape[1], **kwargs)
    return Sampler()(logits, metadata)


# ---------------------------------------------------------------- greedy and truncation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(8, 200).to(dtype)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_truncation_to_one_token_equals_greedy_in_mixed_batch():
    torch.manual_seed(1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=0.999999),
        SamplingParams(temperature=1.0, top_k=1, seed=5),
        SamplingParams(temperature=1.0),  # plain random row, must not disturb the others
    ]
    for _ in range(20):
        logits = torch.randn(len(params), 500) * 3
        before = logits.clone()
        out = sample(logits, params).sampled_token_ids
        assert torch.equal(logits, before), "sampler must not modify its input"
        assert torch.equal(out[:5], logits[:5].argmax(-1))
        assert 0 <= out[5] < 500


def test_all_random_batch_with_top_k_one_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 1000)
    out = sample(logits, [SamplingParams(top_k=1, temperature=0.8)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- penalties


def naive_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for b, p in enumerate(params):
        for t in range(logits.shape[1]):
            count = outputs[b].count(t)
            if t in prompts[b] or count > 0:
                x = out[b, t].item()
                out[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            out[b, t] -= p.frequency_penalty * count
            out[b, t] -= p.presence_penalty * (1.0 if count > 0 else 0.0)
    return out


def test_penalties_match_naive_loop():
    torch.manual_seed(3)
    vocab = 10
    logits = torch.randn(4, vocab) * 2  # both signs, so both repetition branches run
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.7),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
        SamplingParams(),
    ]
    prompts = [[0, 1, 1, 9], [2, 3], [4, 4, 5], [0, 1, 2]]
    outputs = [[2, 2, 3], [3, 3, 3, 6], [5, 7, 7], [1, 1]]
    metadata = build_metadata(params, vocab, outputs=outputs, prompts=prompts)
    got = apply_penalties(logits, metadata)
    expected = naive_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, expected)
    # Row 1 has no repetition penalty: prompt-only tokens are untouched.
    assert got[1, 2] == logits[1, 2]
    # Row 0: a prompt-only token is penalized by repetition.
    assert got[0, 9] != logits[0, 9]
    assert torch.equal(got[3], logits[3])


def test_repetition_penalty_uses_prompt_tokens_in_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 0 only in the prompt: 3.0 / 2 = 1.5 < 2.5, so token 1 wins.
    assert sample(logits, [greedy], prompts=[[0]]).sampled_token_ids.item() == 1
    # No penalty: argmax.
    plain = SamplingParams(temperature=0.0)
    assert sample(logits, [plain], prompts=[[0]]).sampled_token_ids.item() == 0


def test_presence_and_frequency_only_use_output_tokens():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)]
    # In the prompt only: no change.
    assert sample(logits, params, prompts=[[0]]).sampled_token_ids.item() == 0
    # In the output: 3.0 - 1.0 < 2.5.
    assert sample(logits, params, outputs=[[0]]).sampled_token_ids.item() == 1
    freq = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    assert sample(logits, freq, outputs=[[0, 0]]).sampled_token_ids.item() == 0  # 2.6
    assert sample(logits, freq, outputs=[[0, 0, 0]]).sampled_token_ids.item() == 1  # 2.4


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_stop_and_eos_tokens():
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0, 0.0]])
    p = SamplingParams(temperature=0.0, stop_token_ids=[2], min_tokens=3)
    p.update_from_generation_config([1])
    assert sample(logits, [p], outputs=[[4]]).sampled_token_ids.item() == 3
    assert sample(logits, [p], outputs=[[4, 4, 4]]).sampled_token_ids.item() == 1

    torch.manual_seed(4)
    flat = torch.zeros(2000, 5)
    random = SamplingParams(stop_token_ids=[0, 4], min_tokens=1)
    out = sample(flat, [random] * 2000).sampled_token_ids
    assert not torch.isin(out, torch.tensor([0, 4])).any()


# ---------------------------------------------------------------- seeded reproducibility


def run_seeded_request(layout, steps=20, vocab=64):
    """Sample `steps` tokens for every row of `layout`; return the "target" row's tokens."""
    params = [p for _, p in layout]
    outputs = [[] for _ in params]
    target = [name for name, _ in layout].index("target")
    sampler = Sampler()
    for step in range(steps):
        logits = torch.randn(len(params), vocab) * 2
        # The target sees the same logits whatever the batch; others get fresh noise.
        logits[target] = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))
        metadata = SamplingMetadata.from_requests(params, outputs, [[1, 2, 3]] * len(params), "cpu", vocab)
        tokens = sampler(logits, metadata).sampled_token_ids.tolist()
        for row, token in enumerate(tokens):
            outputs[row].append(token)
    return outputs[target]


def test_seed_gives_same_tokens_whatever_the_batch():
    torch.manual_seed(5)
    target = SamplingParams(temperature=1.0, seed=123)
    alone = run_seeded_request([("target", target)])
    others = [
        ("random", SamplingParams(temperature=0.9, top_p=0.9)),
        ("greedy", SamplingParams(temperature=0.0, repetition_penalty=1.3)),
        ("seeded", SamplingParams(temperature=1.0, seed=7, top_k=5)),
        ("penalized", SamplingParams(temperature=1.2, frequency_penalty=0.5, min_p=0.1)),
    ]
    first = run_seeded_request(others[:2] + [("target", target)] + others[2:])
    last = run_seeded_request(list(reversed(others)) + [("target", target)])
    assert alone == first == last
    assert len(set(alone)) > 5, "a temperature-1 row should not be near-deterministic"

    other_seed = run_seeded_request([("target", SamplingParams(temperature=1.0, seed=124))])
    assert other_seed != alone


def seeded_noise(seed, position, token_ids):
    lo, hi = seed_lanes(seed)
    keys = row_keys(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([position]))
    return exponential_noise(keys, torch.as_tensor(token_ids))[0]


def test_seeded_noise_is_a_function_of_seed_position_and_token():
    vocab = torch.arange(1000)
    noise = seeded_noise(123, 5, vocab)
    assert noise.dtype == torch.float32 and bool((noise > 0).all()) and bool(noise.isfinite().all())
    # The same token gets the same draw whichever other tokens are drawn with it.
    subset = torch.tensor([999, 3, 500])
    assert torch.equal(seeded_noise(123, 5, subset), noise[subset])
    # Another position, another seed (also seeds that differ only in their high 32 bits): other draws.
    for other in (seeded_noise(123, 6, vocab), seeded_noise(124, 5, vocab), seeded_noise(123 + 2**32, 5, vocab),
                  seeded_noise(-123, 5, vocab)):
        assert (other != noise).float().mean() > 0.99
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e (over 200k draws: standard errors ~0.003, ~0.001).
    draws = torch.cat([seeded_noise(7, pos, vocab) for pos in range(200)]).double()
    assert abs(draws.mean().item() - 1) < 0.015 and abs(draws.var().item() - 1) < 0.03
    assert abs((draws > 1).double().mean().item() - math.exp(-1)) < 0.005


def test_uniforms_of_the_extreme_hash_values_stay_inside_the_open_interval():
    """A uniform of exactly 1 (or 0) would give noise 0 (or inf), which wins (or loses) every draw."""
    uniform = uniform_from_bits(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert bool((uniform > 0).all()) and bool((uniform < 1).all()), uniform.tolist()
    noise = -torch.log(uniform)
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())


# ---------------------------------------------------------------- distributions

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
NUM_DRAWS = 60_000
# A frequency estimate has standard deviation sqrt(p(1-p)/N) <= sqrt(0.25/60000) ~= 0.00204,
# so 0.01 is at least 4.9 sigma (two-sided tail ~1e-6 per comparison). The global seed is
# fixed as well, so the test is deterministic.
TOLERANCE = 0.01
TEMPERED = torch.softmax(PROBS.log() / 0.5, -1)  # ~[0.73, 0.18, 0.07, 0.01, 0.003]


def renormalized(keep, probs=PROBS):
    p = probs * torch.tensor(keep, dtype=torch.float32)
    return p / p.sum()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), TEMPERED),
        (SamplingParams(top_k=2), renormalized([1, 1, 0, 0, 0])),
        # Cumulative 0.5, 0.75, 0.90: the smallest prefix reaching 0.8 has 3 tokens.
        (SamplingParams(top_p=0.8), renormalized([1, 1, 1, 0, 0])),
        # Threshold 0.1 * 0.5 = 0.05 drops only the 0.03 token.
        (SamplingParams(min_p=0.1), renormalized([1, 1, 1, 1, 0])),
        # Temperature comes first: on TEMPERED, 0.73 + 0.18 already reaches 0.85.
        (SamplingParams(temperature=0.5, top_p=0.85), renormalized([1, 1, 0, 0, 0], TEMPERED)),
        # Both sets: top-p 0.95 keeps four tokens (0.90 ranked before the fourth), min-p 0.2 three.
        (SamplingParams(top_p=0.95, min_p=0.2), renormalized([1, 1, 1, 0, 0])),
    ],
    ids=["temperature1", "temperature0.5", "top_k2", "top_p0.8", "min_p0.1", "temp_then_top_p", "top_p_and_min_p"],
)
@pytest.mark.parametrize("seeded", [False, True], ids=["global_generator", "seeded"])
def test_empirical_distribution(params, expected, seeded):
    torch.manual_seed(6)
    logits = PROBS.log().expand(NUM_DRAWS, -1).contiguous()
    # Seeded: every row has a seed of its own (counter-based noise), all at output position 0.
    rows = [dataclasses.replace(params, seed=row) for row in range(NUM_DRAWS)] if seeded else [params] * NUM_DRAWS
    tokens = sample(logits, rows).sampled_token_ids
    freq = torch.bincount(tokens, minlength=len(PROBS)).float() / NUM_DRAWS
    assert (freq - expected).abs().max().item() < TOLERANCE, (freq, expected)
    assert torch.all(freq[expected == 0] == 0), "a token outside the allowed set was sampled"


def test_seeded_rows_follow_the_distribution():
    # Every row draws counter-based noise of its own seed (the seeded path), at one position.
    num_rows = 10_000
    probs = PROBS.expand(num_rows, -1).contiguous()
    lanes = torch.tensor([seed_lanes(row) for row in range(num_rows)])
    keys = row_keys(lanes[:, 0], lanes[:, 1], torch.full((num_rows,), 3))
    tokens = random_sample(probs, exponential_noise(keys, torch.arange(5)))
    freq = torch.bincount(tokens, minlength=5).float() / num_rows
    # sigma <= sqrt(0.25 / 10000) = 0.005; 0.025 is 5 sigma.
    assert (freq - PROBS).abs().max().item() < 0.025


def test_inverse_cdf_draws_follow_the_masses_and_skip_massless_entries(monkeypatch):
    # Unseeded rows draw with one uniform per row: masses scattered over a row whose first and last
    # entries have none, unnormalized (the caller's min-p leaves rows so).
    torch.manual_seed(8)
    width, num_rows = 512, 30_000
    where, masses = torch.tensor([1, 200, 301, 509]), torch.tensor([0.2, 0.6, 0.3, 0.9])
    row = torch.zeros(width).index_copy_(0, where, masses)
    tokens = inverse_cdf_sample(row.expand(num_rows, -1).contiguous())
    freq = torch.bincount(tokens, minlength=width).float() / num_rows
    # sigma <= sqrt(0.25 / 30000) ~= 0.0029; 0.015 is 5 sigma.
    assert (freq[where] - masses / masses.sum()).abs().max().item() < 0.015
    assert freq.sum().item() == pytest.approx(1.0) and freq[where].sum().item() == pytest.approx(1.0)
    # The largest uniform still names an entry with mass; a row of NaNs (broken logits) a token.
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(*shape, 1.0 - 2.0 ** -53, **kw))
    assert inverse_cdf_sample((row * 3.7).unsqueeze(0)).tolist() == [509]
    assert 0 <= inverse_cdf_sample(torch.full((1, width), math.nan)).item() < width


@pytest.mark.parametrize("others", [SamplingParams(top_p=0.8), SamplingParams(temperature=0.5)],
                         ids=["top_p", "temperature"])
def test_a_step_mixing_top_k_rows_with_others_follows_each_rows_distribution(others):
    # Alternate rows keep two tokens (top-k) and draw from their own set: the candidates' path
    # and the whole-vocabulary draw serve one step together.
    torch.manual_seed(10)
    logits = PROBS.log().expand(NUM_DRAWS, -1).contiguous()
    tokens = sample(logits, [SamplingParams(top_k=2), others] * (NUM_DRAWS // 2)).sampled_token_ids
    expected = {"top_p": renormalized([1, 1, 1, 0, 0]), "temperature": TEMPERED}
    for half, want in ((tokens[0::2], renormalized([1, 1, 0, 0, 0])),
                       (tokens[1::2], expected["top_p" if others.top_p < 1 else "temperature"])):
        freq = torch.bincount(half, minlength=len(PROBS)).float() / len(half)
        # sigma <= sqrt(0.25 / 30000) ~= 0.0029; 0.015 is 5 sigma.
        assert (freq - want).abs().max().item() < 0.015, (freq, want)
        assert torch.all(freq[want == 0] == 0)


def test_a_small_top_p_over_a_flat_row_falls_back_to_sorting():
    # Eleven of 1,000 equal tokens form each row's set (ties rank by id): a draw lands there with
    # probability 0.011, so some of 64 rows is still outside after the redraws and the step sorts.
    torch.manual_seed(9)
    logits = torch.zeros(64, 1000)
    metadata = build_metadata([SamplingParams(top_p=0.0105)] * 64, 1000)
    assert draw_in_nucleus(logits, metadata) is None
    tokens = Sampler()(logits, metadata).sampled_token_ids
    assert tokens.max().item() <= 10


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(7)
    vocab = 30
    logits = torch.randn(4, vocab)
    logits[0, 0], logits[0, 1] = 6.0, 5.0
    params = [
        # Penalized away from its argmax: samples token 1, which has raw rank 2.
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.5, logprobs=0, seed=11),
    ]
    out = sample(logits.to(torch.bfloat16), params, prompts=[[0], [], [], []])
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    raw = logits.to(torch.bfloat16).float().log_softmax(-1)

    assert lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    assert lp.logprobs.dtype == torch.float32 and lp.token_ids.dtype == torch.int64
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])

    assert out.sampled_token_ids[0].item() == 1
    assert lp.sampled_token_ranks[0].item() == 2
    for b in range(4):
        sampled_lp = raw[b, out.sampled_token_ids[b]]
        assert lp.sampled_token_ranks[b].item() == int((raw[b] > sampled_lp).sum()) + 1


def test_logprobs_zero_returns_only_sampled_column():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)]).logprobs
    assert lp.token_ids.tolist() == [[2]]
    assert lp.sampled_token_ranks.tolist() == [1]
    expected = 2.0 - math.log(1 + math.e + math.e**2)
    assert abs(lp.logprobs.item() - expected) < 1e-6


# ---------------------------------------------------------------- metadata checks


def test_metadata_flags_and_shapes():
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(top_k=-1, logprobs=2)]
    md = build_metadata(params, 50)
    assert not md.all_greedy and not md.all_random
    assert md.no_top_k and md.no_top_p and md.no_min_p and md.no_penalties
    assert md.top_k.tolist() == [50, 50]
    assert md.output_token_counts is None and md.seen_token_mask is None
    assert md.max_num_logprobs == 2 and md.is_seeded is None and md.max_top_k is None
    assert md.noise_keys.shape == (2,)  # every row's key, the unseeded ones fresh

    md = build_metadata([SamplingParams(top_k=7, frequency_penalty=0.1)], 50, outputs=[[4, 4]])
    assert not md.no_top_k and md.top_k.tolist() == [7] and md.max_top_k == 7
    assert md.seen_token_mask is None  # repetition_penalty is 1
    assert md.output_token_counts[0, 4].item() == 2 and md.output_token_counts.sum().item() == 2


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError, match="len\\(prompt_token_ids\\)"):
        SamplingMetadata.from_requests([SamplingParams()], [[]], [], "cpu", 10)
    md = build_metadata([SamplingParams()], 10)
    with pytest.raises(ValueError, match="logits must have shape \\(1, 10\\)"):
        Sampler()(torch.zeros(1, 11), md)
