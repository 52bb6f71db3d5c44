"""Speculative decoding with a draft model end to end: greedy outputs equal those without it, token
for token, whatever the engine does to run the batch; bad draft models are refused by name.

Two drafts of the tiny random target (see test_spec_decode): the target itself, which must have
every draft accepted (its K/V cache, caught up after each step, must then hold exactly what the
target's holds: a wrong position anywhere shows up as a rejection), and a copy of the target cut to
its first layer, whose drafts are accepted part of the time (both verification paths run).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.draft_model import write_damped_copy, write_truncated_copy
from novainfer import LLM, SamplingParams
from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.sched.request import Request
from novainfer.core.sched.scheduler import Scheduler, SchedulerConfig
from novainfer.engine.arg_utils import EngineArgs
from novainfer.entrypoints.cli.args import add_engine_args, engine_args_from
from novainfer.tiny_model import build_tokenizer, cache_root, write_once
from novainfer.worker.cuda_graphs import GraphKey, StepGraphs
from novainfer.worker import draft_proposer
from novainfer.worker.draft_proposer import DraftModelProposer
from tests.test_spec_decode import (  # noqa: F401 (fixtures)
    CONFIGS,
    MAX_TOKENS,
    assert_stop_strings_end_requests_as_without_speculation,
    generate,
    plain_greedy,
    prompts,
    spec_model_dir,
)
from tests.test_step_graphs import emulated_graphs  # noqa: F401 (a fixture)
from tests.utils import SMALL_KV, hf_greedy, hf_logits, tiny_model


def truncated_copy(model_dir: Path, num_layers: int) -> Path:
    """A copy of a checkpoint with only its first ``num_layers`` decoder layers (embeddings, final
    norm and LM head kept): a draft that agrees with the target part of the time."""
    return write_once(cache_root() / f"{model_dir.name}-draft-of-{num_layers}-layers",
                      lambda out: write_truncated_copy(model_dir, out, num_layers))


def test_truncated_copy_keeps_the_first_layers_only(spec_model_dir, tmp_path):
    draft = truncated_copy(spec_model_dir, 1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert (draft / "tokenizer.json").read_bytes() == (spec_model_dir / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="num_layers"):
        write_truncated_copy(spec_model_dir, tmp_path, 3)


def test_damped_copy_scales_the_later_layers_output_projections_only(spec_model_dir, tmp_path):
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    original = tensors(spec_model_dir)
    damped = tensors(write_damped_copy(spec_model_dir, tmp_path / "damped", 1, 0.25))
    assert damped.keys() == original.keys()
    for name, tensor in original.items():
        later_output = ".layers.0." not in name and name.endswith(("o_proj.weight", "down_proj.weight"))
        expected = (tensor.float() * 0.25).to(tensor.dtype) if later_output else tensor
        assert torch.equal(damped[name], expected), name
    assert sum(".layers.1." in n and n.endswith("o_proj.weight") for n in damped) == 1


def draft_model(model: Path, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def drafts(spec_model_dir):
    return {"itself": spec_model_dir, "first_layer": truncated_copy(spec_model_dir, 1)}


def assert_acceptance(stats, draft: str) -> None:
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    if draft == "itself":
        assert 0 < accepted == drafted, f"drafted {drafted}, accepted {accepted}: the target drafting for itself"
    else:
        assert 0 < accepted < drafted, f"drafted {drafted}, accepted {accepted}: both paths should run"


@pytest.mark.parametrize("draft", ["itself", "first_layer"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_outputs_equal_those_without_speculation(prompts, plain_greedy, drafts, config, draft):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    k = 3 if draft == "itself" else 2
    completions, stats = generate(drafts["itself"], prompts, params, draft_model(drafts[draft], k), **CONFIGS[config])
    assert [c.token_ids for c in completions] == plain_greedy()
    assert all(c.finish_reason == "length" for c in completions)
    assert_acceptance(stats, draft)
    if config == "preemption":
        assert stats.num_preemptions_total > 0
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS


@pytest.mark.parametrize("config", ["chunked_prefill_budget_5", "preemption"])
def test_drafts_are_the_draft_models_greedy_continuations(monkeypatch, prompts, drafts, config):
    """Every proposal is what transformers' copy of the draft model continues the request's known
    tokens with, greedily: the draft's cache, caught up over prompt chunks, accepted drafts,
    rejected ones and recomputation after preemption, holds the K/V of exactly those tokens."""
    recorded: list[tuple[list[int], list[int]]] = []
    propose = DraftModelProposer.propose

    def recording(self, target, so, sampled_req_ids):
        drafts_out = propose(self, target, so, sampled_req_ids)
        assert drafts_out.req_ids == list(sampled_req_ids)
        for rid, count, row in zip(sampled_req_ids, drafts_out.counts, drafts_out.token_ids.tolist()):
            assert all(t >= 0 for t in row[:count])
            recorded.append((list(target.requests[rid].token_ids), row[:count]))
        return drafts_out

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    _, stats = generate(drafts["itself"], prompts, params, draft_model(drafts["first_layer"], 3), **CONFIGS[config])
    assert_acceptance(stats, "first_layer")
    checked = [(known, d) for known, d in recorded if d]
    assert len(checked) > 20
    checked = checked[::len(checked) // 20]  # 20 or so, spread over the run, keep the test fast
    for known, proposed in checked:
        logits = hf_logits(drafts["first_layer"], known + proposed[:-1])[len(known) - 1:]
        chosen = logits.gather(1, torch.tensor(proposed).unsqueeze(1)).squeeze(1)
        # Within rounding of the best: a near-tie may go either way in another summation order.
        assert (logits.max(dim=1).values - chosen <= 1e-4).all(), (known, proposed, logits.argmax(dim=1).tolist())


def test_prefix_cache_hits_carry_the_draft_cache(spec_model_dir, prompts, plain_greedy):
    """Requests whose prompts extend earlier requests' sequences take their blocks from the prefix
    cache, the draft's K/V included: with the target as its own draft, every draft is still
    accepted, so those K/V were the right ones."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    llm = LLM(str(spec_model_dir), speculative_config=draft_model(spec_model_dir, 4), block_size=4,
              kv_cache_memory_bytes=SMALL_KV)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == plain_greedy()
    before = llm.llm_engine.get_stats()
    extended = [p + o.outputs[0].token_ids[:30] for p, o in zip(prompts, first)]
    second = llm.generate([{"prompt_token_ids": p} for p in extended], SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=8), use_tqdm=False)
    assert all(o.num_cached_tokens >= 28 for o in second)
    for prompt, out in zip(extended[:3], second[:3]):
        assert out.outputs[0].token_ids == hf_greedy(spec_model_dir, prompt, 8)
    after = llm.llm_engine.get_stats()
    drafted = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    assert 0 < accepted == drafted


def test_prefix_cache_hits_on_blocks_the_draft_skipped(spec_model_dir, prompts, plain_greedy):
    """While more requests run than ``disable_by_batch_size`` the draft computes nothing, so the
    blocks written then hold the target's K/V only. Requests that later hit them in the prefix
    cache, one at a time (so with drafts), have the draft compute those blocks first: with the
    target as its own draft every draft is accepted, there and when the same prefixes are hit
    again (the blocks now hold the draft's K/V too)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    llm = LLM(str(spec_model_dir), speculative_config=draft_model(spec_model_dir, 3, disable_by_batch_size=1),
              block_size=4, kv_cache_memory_bytes=SMALL_KV)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == plain_greedy()
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens_total == 0  # all ran together
    extended = [p + o.outputs[0].token_ids[:30] for p, o in zip(prompts, first)]
    for attempt in range(2):
        for prompt in extended[:3]:
            before = llm.llm_engine.get_stats()
            (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                temperature=0.0, ignore_eos=True, max_tokens=8), use_tqdm=False)
            assert out.num_cached_tokens >= 28
            assert out.outputs[0].token_ids == hf_greedy(spec_model_dir, prompt, 8)
            after = llm.llm_engine.get_stats()
            drafted = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
            accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
            assert 0 < accepted == drafted, (attempt, drafted, accepted)


def test_max_tokens_and_stops_inside_an_accepted_run(spec_model_dir, prompts, plain_greedy):
    """With every draft accepted, a step emits k + 1 tokens: max_tokens and stop token ids that fall
    inside such a run cut the output exactly where plain decoding ends it."""
    llm = LLM(str(spec_model_dir), speculative_config=draft_model(spec_model_dir, 5), kv_cache_memory_bytes=SMALL_KV)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for max_tokens in (1, 2, 7, 13):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        outputs = llm.generate(inputs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [t[:max_tokens] for t in plain_greedy()]
    expected, per_request = [], []
    for tokens in plain_greedy():
        stop = tokens[len(tokens) // 2]
        expected.append(tokens[:tokens.index(stop) + 1])
        per_request.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    outputs = llm.generate(inputs, per_request, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_greedy_logprobs_and_penalties_equal_those_without_speculation(spec_model_dir, prompts, drafts):
    """Logprobs and penalties are the verifier's (test_spec_decode checks them in detail): with a
    draft model's drafts too, tokens and logprobs are those without speculation."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=2,
                            frequency_penalty=0.05, presence_penalty=0.3, repetition_penalty=1.05)
    plain, _ = generate(spec_model_dir, prompts, params, kv_cache_memory_bytes=SMALL_KV)
    spec, stats = generate(spec_model_dir, prompts, params, draft_model(drafts["first_layer"], 3),
                           kv_cache_memory_bytes=SMALL_KV)
    assert_acceptance(stats, "first_layer")
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        for p_entries, s_entries in zip(p.logprobs, s.logprobs):
            assert list(s_entries) == list(p_entries)
            for token_id, entry in p_entries.items():
                assert s_entries[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_stop_strings_end_requests_as_without_speculation(spec_model_dir, prompts, drafts):
    assert_stop_strings_end_requests_as_without_speculation(spec_model_dir, prompts,
                                                            draft_model(drafts["first_layer"], 3))


@pytest.mark.parametrize("chains", [True, False])
def test_draft_steps_replay_graphs(request, monkeypatch, spec_model_dir, prompts, plain_greedy, chains):
    """With (CPU-emulated) CUDA graphs, the draft's proposals replay one chain graph each (or, with
    no chain graph captured, its decode graphs, one per forward), and outputs and full acceptance
    stay those of eager steps."""
    request.getfixturevalue("emulated_graphs")
    if not chains:
        monkeypatch.setattr(draft_proposer, "MAX_CHAIN_GRAPH_SEQS", 0)
    replayed_by: list[tuple[StepGraphs, GraphKey]] = []
    replay = StepGraphs.replay

    def recording(self, key):
        replayed_by.append((self, key))
        return replay(self, key)

    monkeypatch.setattr(StepGraphs, "replay", recording)
    llm = LLM(str(spec_model_dir), speculative_config=draft_model(spec_model_dir, 3), device="cpu", max_num_seqs=16,
              max_cudagraph_capture_size=64, kv_cache_memory_bytes=SMALL_KV)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy()
    assert_acceptance(llm.llm_engine.get_stats(), "itself")
    draft_graphs = llm.llm_engine.engine_core.executor.driver_worker.draft_runner.graphs
    draft_kinds = {key.kind for graphs, key in replayed_by if graphs is draft_graphs}
    assert draft_kinds == {"chain" if chains else "decode", "mixed"}  # proposals, and catch-ups of several tokens


def test_disable_by_batch_size(spec_model_dir, prompts, plain_greedy):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    completions, stats = generate(spec_model_dir, prompts, params,
                                  draft_model(spec_model_dir, 3, disable_by_batch_size=1),
                                  max_num_seqs=len(prompts), kv_cache_memory_bytes=SMALL_KV)
    assert [c.token_ids for c in completions] == plain_greedy()
    assert stats.spec_decode_num_draft_tokens_total == 0


ASYNC_DRAFT_CONFIGS = {
    "default": CONFIGS["default"], "preemption": CONFIGS["preemption"],
    # Steps of 16 tokens: the tokens the draft skipped do not fit one catch-up.
    "step_budget_16": dict(max_num_batched_tokens=16, kv_cache_memory_bytes=SMALL_KV),
}


@pytest.mark.parametrize("config", list(ASYNC_DRAFT_CONFIGS))
def test_async_scheduling_leaves_steps_above_the_cut_off_in_flight(monkeypatch, spec_model_dir, prompts,
                                                                   plain_greedy, drafts, config):
    """With async scheduling, steps while more requests run than ``disable_by_batch_size`` are left
    in flight and the draft skips them; the others run one at a time with drafts, once the draft has
    computed the tokens it skipped (over several steps where its step budget is small). The
    requests end at different lengths, so both kinds of step occur; the tokens are plain greedy,
    and a draft that is the target itself is accepted in full: its cache holds the K/V of exactly
    the requests' tokens throughout."""
    from novainfer.engine.core import EngineCore

    decisions = []
    can_pipeline = EngineCore._can_pipeline
    monkeypatch.setattr(EngineCore, "_can_pipeline",
                        lambda self, so: decisions.append(can_pipeline(self, so)) or decisions[-1])
    lengths = [MAX_TOKENS - 4 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    completions, stats = generate(drafts["itself"], prompts, params,
                                  draft_model(drafts["itself"], 3, disable_by_batch_size=3), async_scheduling=True,
                                  max_num_seqs=len(prompts), **ASYNC_DRAFT_CONFIGS[config])
    assert [c.token_ids for c in completions] == [out[:n] for out, n in zip(plain_greedy(), lengths)]
    assert True in decisions and False in decisions
    assert_acceptance(stats, "itself")
    if config == "preemption":
        assert stats.num_preemptions_total > 0


def test_lookahead_slots_are_held_but_not_computed():
    """The scheduler holds k slots past a request's scheduled tokens (where the draft writes its
    proposals' K/V), never past the context limit."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=12, num_lookahead_tokens=3), kv)
    scheduler.add_request(Request("r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=7), max_tokens=7))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].block_ids == kv.get_block_ids("r") and len(kv.get_block_ids("r")) == 2  # 5 + 3
    assert kv._requests["r"].num_tokens == 5
    for token in range(20, 26):
        scheduler.update_from_output(["r"], [[token]])
        scheduler.schedule()
    # 11 tokens known and scheduled: slots for 3 more would pass max_model_len 12.
    assert kv._requests["r"].num_tokens == 11 and len(kv.get_block_ids("r")) == 3


def test_cli_flag_configures_the_draft_model(spec_model_dir, drafts):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = json.dumps(draft_model(drafts["first_layer"], 3))
    config = engine_args_from(parser.parse_args(["--device", "cpu", "--speculative-config", flag]),
                              str(spec_model_dir)).create_engine_config()
    assert config.draft_model_config.model == str(drafts["first_layer"])
    assert config.draft_model_config.num_layers == 1 and config.model_config.num_layers == 2
    assert config.scheduler_config.num_lookahead_tokens == 3


@pytest.fixture(scope="module")
def other_tokenizer_model(spec_model_dir) -> Path:
    """The target's weights and config with a tokenizer trained to another vocabulary."""
    return write_once(cache_root() / f"{spec_model_dir.name}-other-tokenizer", lambda out: (
        shutil.copytree(spec_model_dir, out, dirs_exist_ok=True), build_tokenizer(out, vocab_size=600)))


@pytest.mark.parametrize("case", ["no_model", "missing_directory", "other_vocab_size", "other_tokenizer"])
def test_bad_draft_models_are_refused_naming_the_key(spec_model_dir, other_tokenizer_model, case):
    model, message = {
        "no_model": (None, r"speculative_config\['model'\] must name"),
        "missing_directory": (str(spec_model_dir / "absent"),
                              r"speculative_config\['model'\] .* cannot draft for the target: .*config.json"),
        "other_vocab_size": (str(tiny_model(std=0.1, vocab_size=768)),
                             r"speculative_config\['model'\] .* has vocab_size 768, the target .* has 740"),
        "other_tokenizer": (str(other_tokenizer_model),
                            r"speculative_config\['model'\] .* has another tokenizer .* token\(s\) differ"),
    }[case]
    config = {"method": "draft_model", "num_speculative_tokens": 2}
    if model is not None:
        config["model"] = model
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(spec_model_dir), device="cpu", speculative_config=config).create_engine_config()
