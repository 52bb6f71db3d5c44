"""Speculative decoding's parts on their own: configuration, n-gram proposals, rejection sampling.

Oracles: a straightforward per-request loop for the n-gram lookup and the greedy verification, and
the target distribution itself for rejection sampling (a chi-square test per emitted position).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from novainfer.sample.rejection_sampler import greedy_verify, rejection_sample
from novainfer.spec_decode.config import SpeculativeConfig
from novainfer.spec_decode.ngram_proposer import NgramProposer, propose_ngram


# ---- configuration ---------------------------------------------------------------------------------
def test_config_accepts_vllm_keys():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 5})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 5)
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": "some/dir", "num_speculative_tokens": 3})
    assert draft.model == "some/dir"
    # The batch-size cut-off: 8 unless given, None (speculate at any batch size) accepted.
    assert cfg.disable_by_batch_size == 8
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                        "disable_by_batch_size": None}).disable_by_batch_size is None


@pytest.mark.parametrize("values, named", [
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "lookahead"),
    ({"method": "medusa", "num_speculative_tokens": 4}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
])
def test_config_refuses_bad_values_by_name(values, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_dict(values)


# ---- n-gram proposals ------------------------------------------------------------------------------
def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix, copied one at a time
    from the growing sequence (so a copy that reaches the end goes on with the tokens it copied)."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start:start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens):]
    return []


def _random_histories(rng: random.Random) -> list[list[int]]:
    batch = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    return batch + [[7] * 5, [1, 2, 3, 1, 2, 3, 1, 2], [5]]  # a run, a cycle, a single token


@pytest.mark.parametrize("seed", range(5))
def test_ngram_proposals_equal_a_per_request_search(seed):
    rng = random.Random(seed)
    min_n, max_n, k = rng.choice([(1, 3), (2, 4), (1, 1), (3, 5)]) + (rng.randint(1, 5),)
    batch = _random_histories(rng)
    width = max(len(t) for t in batch) + 3
    ids = np.full((len(batch), width), 9, dtype=np.int32)  # padding that matches nothing known
    for row, tokens in enumerate(batch):
        ids[row, :len(tokens)] = tokens
    out = propose_ngram(ids, np.array([len(t) for t in batch]), min_n, max_n, k)
    for row, tokens in enumerate(batch):
        want = reference_ngram(tokens, min_n, max_n, k)
        n = int(out.num_tokens[row])
        assert out.token_ids[row, :n].tolist() == want, (row, tokens)
        assert (out.token_ids[row, n:] == -1).all()


def test_ngram_prefers_the_longest_match():
    # "1 2 3" occurred before followed by 8; "3" alone more recently followed by 5.
    tokens = [1, 2, 3, 8, 3, 5, 1, 2, 3]
    out = propose_ngram(np.array([tokens]), np.array([len(tokens)]), 1, 3, 2)
    assert out.token_ids[0].tolist() == [8, 3]


def test_a_cycle_proposes_k_tokens_by_an_overlapping_copy():
    tokens = [4, 1, 2, 3, 1, 2, 3, 1, 2]  # period 3: the continuation of "3 1 2" reaches the end
    out = propose_ngram(np.array([tokens]), np.array([len(tokens)]), 1, 3, 7)
    assert out.token_ids[0].tolist() == [3, 1, 2, 3, 1, 2, 3]


def test_proposer_history_follows_growing_and_replaced_requests():
    """The persistent history gives what a search over each request's whole list gives, while the
    requests grow, leave, come back and have their ids reused by other requests; a request with a
    token still being sampled gets the search's continuation past its guess of that token."""
    rng = random.Random(0)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3})
    proposer = NgramProposer(config)
    live = {f"r{i}": [rng.randrange(3) for _ in range(rng.randint(1, 5))] for i in range(6)}
    for _ in range(60):
        ids = rng.sample(sorted(live), rng.randint(1, len(live)))  # some sit a call out
        ahead = [rng.randrange(2) for _ in ids]
        got = proposer.propose(ids, [live[rid] for rid in ids], ahead)
        assert got == [reference_ngram(live[rid], 1, 3, 3 + n)[n:] for rid, n in zip(ids, ahead)]
        for rid in ids:
            live[rid].extend(rng.randrange(3) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.2:  # a request ends and its id comes back with other tokens
            live[rng.choice(sorted(live))] = [rng.randrange(3) for _ in range(rng.randint(1, 300))]


# ---- rejection sampling ----------------------------------------------------------------------------
def _inputs(batch: int, k: int, vocab: int, generator: torch.Generator, one_hot: bool):
    target = torch.rand(batch, k + 1, vocab, generator=generator) ** 3
    target /= target.sum(-1, keepdim=True)
    if one_hot:
        draft_probs = None
        drafts = torch.randint(vocab, (batch, k), generator=generator)
    else:
        draft_probs = torch.rand(batch, k, vocab, generator=generator) ** 3
        draft_probs /= draft_probs.sum(-1, keepdim=True)
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, k)
    return target, drafts, draft_probs


@pytest.mark.parametrize("verifier", ["rejection_sample", "greedy_verify"])
def test_greedy_accepts_exactly_the_argmax_matching_prefix(verifier):
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 200, 4, 5
    target, _, _ = _inputs(batch, k, vocab, g, True)
    argmax = target.argmax(-1)
    # Drafts that follow the argmax for a random number of positions, then differ.
    drafts = argmax[:, :k].clone()
    cut = torch.randint(0, k + 1, (batch,), generator=g)
    for b in range(batch):
        if cut[b] < k:
            drafts[b, cut[b]] = (drafts[b, cut[b]] + 1) % vocab
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    if verifier == "rejection_sample":
        out = rejection_sample(target, drafts, num_drafts, None, argmax, torch.ones(batch, dtype=torch.bool),
                               torch.rand(batch, k, generator=g), torch.ones(batch, vocab))
    else:  # drafts padded with -1 past each row's own
        padded = torch.where(torch.arange(k) < num_drafts.unsqueeze(1), drafts, -1)
        out = greedy_verify(argmax, padded)
    for b in range(batch):
        accepted = 0
        while accepted < num_drafts[b] and drafts[b, accepted] == argmax[b, accepted]:
            accepted += 1
        want = drafts[b, :accepted].tolist() + [int(argmax[b, accepted])]
        assert out.token_ids[b, :len(want)].tolist() == want
        assert int(out.num_tokens[b]) == len(want) and (out.token_ids[b, len(want):] == -1).all()


# Chi-square critical value for 5 degrees of freedom (6 tokens) at 1e-6: a correct sampler fails with
# probability 1e-6 per position; one that draws from the target instead of the residual after a
# rejection (or accepts with p instead of min(1, p/q)) is off by far more at this sample size.
CHI2_DF5_1E6 = 35.9


@pytest.mark.parametrize("one_hot", [True, False], ids=["ngram-one-hot", "draft-distribution"])
def test_emitted_tokens_follow_the_target_distribution(one_hot):
    g = torch.Generator().manual_seed(1)
    k, vocab, samples = 3, 6, 60_000
    target, _, draft_probs = _inputs(1, k, vocab, g, one_hot)
    target = target.expand(samples, -1, -1).contiguous()
    if one_hot:  # a fixed guess per position, as a deterministic proposer makes
        drafts = torch.tensor([[2, 0, 5]]).expand(samples, -1)
    else:
        draft_probs = draft_probs.expand(samples, -1, -1).contiguous()
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(samples, k)
    noise = torch.empty(samples, vocab).exponential_(generator=g)
    out = rejection_sample(target, drafts, torch.full((samples,), k), draft_probs, target.argmax(-1),
                           torch.zeros(samples, dtype=torch.bool), torch.rand(samples, k, generator=g), noise)
    for position in range(k + 1):
        reached = out.num_tokens > position
        tokens = out.token_ids[reached, position]
        observed = torch.bincount(tokens, minlength=vocab).double()
        expected = target[0, position].double() * reached.sum()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_DF5_1E6, f"position {position}: chi2 {chi2:.1f} over {int(reached.sum())} samples"
    # Acceptance must also be right: the first draft is accepted with probability sum_x min(p, q).
    q = torch.nn.functional.one_hot(torch.tensor(2), vocab).double() if one_hot else draft_probs[0, 0].double()
    rate = float((out.num_accepted >= 1).double().mean())
    assert abs(rate - float(torch.minimum(target[0, 0].double(), q).sum())) < 0.01


# ---- penalty state under speculation ---------------------------------------------------------------
def test_penalty_state_of_each_position_counts_the_drafts_before_it():
    """Rows of a verification step (request b's positions 0..n_b, in order) are scored with the
    output counts and seen tokens of the request plus its drafts before that position; after the
    step, the table counts exactly the emitted tokens. Oracle: per-row recounts with collections."""
    from collections import Counter

    import numpy as np

    from novainfer.sample.rejection_sampler import add_preceding_drafts
    from novainfer.sample.state import SamplingStateTable
    from novainfer.sampling_params import SamplingParams

    vocab = 12
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.2)
    prompts, outputs = [[1, 2], [3], [4, 4]], [[5, 5], [], [6]]
    drafts = [[7, 7, 5], [], [8, 9]]  # request 1 has none
    table = SamplingStateTable(vocab, torch.device("cpu"))
    table.add_requests([0, 1, 2], [params] * 3, prompts, outputs)
    num_drafts = np.array([len(d) for d in drafts])
    drafts_np = np.full((3, 3), -1, dtype=np.int64)
    for b, d in enumerate(drafts):
        drafts_np[b, :len(d)] = d
    request = np.repeat(np.arange(3), num_drafts + 1)
    position = np.concatenate([np.arange(n + 1) for n in num_drafts])
    metadata = table.gather(request, np.array([len(outputs[b]) for b in request]) + position)
    add_preceding_drafts(metadata, torch.from_numpy(drafts_np), num_drafts)
    for row, (b, j) in enumerate(zip(request, position)):
        emitted = outputs[b] + drafts[b][:j]
        counts = Counter(emitted)
        assert metadata.output_token_counts[row].tolist() == [counts[t] for t in range(vocab)], (b, j)
        assert metadata.seen_token_mask[row].tolist() == [t in set(prompts[b] + emitted) for t in range(vocab)]

    # The step emitted request 0's first two drafts and 6, request 1's 2, request 2's 8 and 1.
    emitted_tokens = [[7, 7, 6], [2], [8, 1]]
    # Positions after a request's emitted tokens repeat its last one, uncounted.
    sampled = torch.tensor([(emitted_tokens[b] + [emitted_tokens[b][-1]] * 4)[j] for b, j in zip(request, position)])
    table.record_sampled(metadata, sampled, torch.tensor([j < len(emitted_tokens[b])
                                                          for b, j in zip(request, position)]))
    for b in range(3):
        counts = Counter(outputs[b] + emitted_tokens[b])
        assert table.output_counts[b].tolist() == [counts[t] for t in range(vocab)]
        assert table.seen_mask[b].tolist() == [t in set(prompts[b] + outputs[b] + emitted_tokens[b])
                                               for t in range(vocab)]
