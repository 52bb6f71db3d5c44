"""Captured steps (decode graphs by batch size, mixed graphs by token count), emulated on a CPU.

On a CPU every "replay" runs the step eagerly from the same static, padded inputs a CUDA graph
reads, through the reference attention backend, which takes the same padding as the Triton one
(rows without a KV slot, sequences without query tokens, tokens of no sequence). So these tests
check the bucketing, the padding and the buffer handling of captured steps against plain eager
steps: padding never changes a real row's output, and the engine's tokens are the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.worker.cuda_graphs import GraphKey, StepGraphs, cudagraph_capture_sizes
from novainfer.worker.model_runner import ModelRunner, SequenceInput
from tests.test_model_parity import LOGITS_ATOL, block_tables_for, make_runner, random_prompts
from tests.utils import tiny_model


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Graph capture turned on for CPU runners; yields the keys every replay ran, in order."""
    replayed: list[GraphKey] = []
    replay = StepGraphs.replay

    def recording(self, key):
        replayed.append(key)
        return replay(self, key)

    monkeypatch.setattr(ModelRunner, "cuda_graphs_enabled", property(lambda self: True))
    monkeypatch.setattr(StepGraphs, "replay", recording)
    return replayed


def test_capture_sizes_cover_every_step_with_little_padding():
    sizes = cudagraph_capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    for n in range(1, 1025):  # padding at most doubles a small step and adds < 64 rows to others
        padded = next(s for s in sizes if s >= n)
        assert padded < 2 * n if n > 1 else padded == 1
        assert padded - n < 64
    assert cudagraph_capture_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_size"):
        cudagraph_capture_sizes(0)


def _mixed_step(vocab: int, block_size: int):
    """Three decoding sequences with context, a prompt chunk on a cached prefix, and a new prompt."""
    prompts = random_prompts(vocab, [9, 14, 5, 30, 7], seed=3)
    tables = block_tables_for([len(p) + 8 for p in prompts], block_size)
    prefill = [SequenceInput(p, 0, t, "none") for p, t in zip(prompts[:4], tables)]
    step = [SequenceInput([11], len(prompts[i]), tables[i]) for i in range(3)]
    step.append(SequenceInput(prompts[3][:3], len(prompts[3]), tables[3]))  # a chunk after 30 cached tokens
    step.append(SequenceInput(prompts[4], 0, tables[4]))
    return prefill, step


def test_padding_never_changes_the_rows_of_a_mixed_step(emulated_graphs):
    runner = make_runner(tiny_model(), block_size=4, num_blocks=256)
    runner.reserve_step_buffers(max_num_seqs=8, max_num_tokens=64)
    runner.capture_model(max_num_seqs=8, max_num_tokens=64)
    prefill, step = _mixed_step(runner.model_config.vocab_size, runner.block_size)
    runner.forward(prefill)  # (a 58-token step: the graph of 64)
    emulated_graphs.clear()
    with torch.inference_mode():
        staged = runner._stage(*runner._flatten(step))
        assert staged.graph_key == GraphKey("mixed", 16) and staged.num_tokens == 13
        graph_logits = runner._compute_logits(runner._load(staged)).clone()
        eager_logits = runner._compute_logits(runner.prepare_inputs(step))
    assert emulated_graphs == [GraphKey("mixed", 16)]
    assert graph_logits.shape == eager_logits.shape == (5, runner.model_config.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=LOGITS_ATOL)


def test_a_few_queries_per_sequence_run_as_decode_rows_with_the_eager_steps_logits(emulated_graphs):
    """A step of several query tokens per sequence over cached context (a verification of drafts)
    replays a decode graph with one row per token, and its logits are the eager step's."""
    runner = make_runner(tiny_model(), block_size=4, num_blocks=256)
    runner.capture_model(max_num_seqs=8, max_num_tokens=64)
    vocab = runner.model_config.vocab_size
    prompts = random_prompts(vocab, [9, 14, 6], seed=5)
    tables = block_tables_for([len(p) + 4 for p in prompts], runner.block_size)
    runner.forward([SequenceInput(p, 0, t, "none") for p, t in zip(prompts, tables)])
    queries = random_prompts(vocab, [3, 1, 4], seed=6)
    step = [SequenceInput(q, len(p), t, "all") for q, p, t in zip(queries, prompts, tables)]
    emulated_graphs.clear()
    with torch.inference_mode():
        staged = runner._stage(*runner._flatten(step))
        assert staged.graph_key == GraphKey("decode", 8) and staged.num_seqs == staged.num_tokens == 8
        graph_logits = runner._compute_logits(runner._load(staged)).clone()
        eager_logits = runner._compute_logits(runner.prepare_inputs(step))
    assert emulated_graphs == [GraphKey("decode", 8)]
    assert graph_logits.shape == eager_logits.shape == (8, vocab)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("graphs", ["chain", "decode", "none"])
def test_a_chain_of_greedy_forwards_equals_one_forward_at_a_time(request, graphs):
    """``greedy_chain`` (a draft's proposals) gives, for each row, the tokens of one-token greedy
    forwards run one at a time, for as many forwards as the row writes, and leaves the same KV
    cache: a row past its forwards (here one with none) writes nothing more. Replayed as one chain
    graph, as decode-graph replays, or eagerly."""
    length, num_forwards = 3, np.array([3, 1, 0, 2])
    reference, runner = (make_runner(tiny_model(), block_size=4, num_blocks=256) for _ in range(2))
    if graphs != "none":
        replayed = request.getfixturevalue("emulated_graphs")
        runner.capture_model(max_num_seqs=8, max_num_tokens=64, chain_length=length,
                             max_chain_seqs=8 if graphs == "chain" else 0)
    prompts = random_prompts(runner.model_config.vocab_size, [9, 14, 6, 3], seed=7)
    tables = block_tables_for([len(p) + length for p in prompts], runner.block_size)
    expected = []
    for prompt, table, count in zip(prompts, tables, num_forwards.tolist()):
        tokens = [int(reference.forward([SequenceInput(prompt, 0, table)]).argmax())]
        for j in range(count):
            tokens.append(int(reference.forward([SequenceInput(tokens[-1:], len(prompt) + j, table)]).argmax()))
        expected.append(tokens)
    first = runner.forward([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)]).argmax(dim=-1)
    if graphs != "none":
        replayed.clear()
    width = max(map(len, tables))
    chain = runner.greedy_chain(first, np.arange(4), np.array([len(p) for p in prompts]), num_forwards, length,
                                np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32))
    got = torch.cat([first.unsqueeze(1), chain], dim=1).tolist()
    assert [row[:count + 1] for row, count in zip(got, num_forwards.tolist())] == expected
    # The K/V of every position the reference wrote, the rows' last written ones included.
    slots = [t[pos // 4] * 4 + pos % 4 for p, t, n in zip(prompts, tables, num_forwards) for pos in range(len(p) + n)]
    for ref_layer, layer in zip(reference.model.attention_layers(), runner.model.attention_layers()):
        for cache in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(layer, cache).flatten(0, 1)[slots],
                                       getattr(ref_layer, cache).flatten(0, 1)[slots], rtol=0, atol=LOGITS_ATOL)
    if graphs != "none":
        assert replayed == ([GraphKey("chain", 4)] if graphs == "chain" else [GraphKey("decode", 4)] * length)


def test_a_step_larger_than_the_reserved_buffers_runs_eagerly_and_keeps_the_graphs(emulated_graphs):
    runner = make_runner(tiny_model(), block_size=4, num_blocks=512)
    runner.capture_model(max_num_seqs=4, max_num_tokens=16)
    reserved = runner.buffers
    vocab = runner.model_config.vocab_size
    prompts = random_prompts(vocab, [12] * 6, seed=4)  # 6 sequences, 72 tokens: beyond both bounds
    tables = block_tables_for([13] * 6, runner.block_size)
    big = runner.forward([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)])
    assert emulated_graphs == [] and runner.buffers is reserved and runner.graphs
    small = runner.forward([SequenceInput([5], 12, t) for t in tables[:3]])
    assert emulated_graphs == [GraphKey("decode", 4)] and runner.buffers is reserved
    expected = [runner.forward([SequenceInput([5], 12, tables[i])]) for i in range(3)]  # graphs of size 1
    torch.testing.assert_close(small, torch.cat(expected), rtol=0, atol=LOGITS_ATOL)
    assert big.shape == (6, vocab)


SAMPLING = {
    "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=12 + i % 5, ignore_eos=True),
    "seeded": lambda i: SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12 + i % 5,
                                       ignore_eos=True),
}


def test_steps_beyond_the_capture_bound_stage_in_eager_buffers_reserved_up_front(emulated_graphs):
    """The graphs' buffers hold ``max_cudagraph_capture_size`` tokens (what every step copies); the
    larger steps the scheduler may make get buffers of their own at the same time, so that no step
    allocates any, and both give the eager reference's logits."""
    runner = make_runner(tiny_model(), block_size=4, num_blocks=512)
    runner.model_config.max_cudagraph_capture_size = 16
    runner.capture_model(max_num_seqs=4, max_num_tokens=96)
    captured, oversized = runner.buffers, runner._oversized_buffers
    assert captured.capacity.max_tokens == 16 and oversized.capacity.max_tokens == 96
    assert runner.max_step_tokens == 96 and captured.nbytes < oversized.nbytes
    vocab = runner.model_config.vocab_size
    prompts = random_prompts(vocab, [20, 21, 22, 23], seed=8)  # one step of 86 tokens
    tables = block_tables_for([24] * 4, runner.block_size)
    big_step = [SequenceInput(p, 0, t) for p, t in zip(prompts, tables)]
    with torch.inference_mode():
        staged = runner._stage(*runner._flatten(big_step))
        assert staged.buffers is oversized and staged.graph_key is None
        big = runner._compute_logits(runner._load(staged)).clone()
    assert emulated_graphs == [] and runner.buffers is captured and runner._oversized_buffers is oversized
    decodes = [SequenceInput([5], len(p), t) for p, t in zip(prompts, tables)]
    small = runner.forward(decodes)
    assert emulated_graphs == [GraphKey("decode", 4)] and runner.buffers is captured
    reference = make_runner(tiny_model(), block_size=4, num_blocks=512)
    torch.testing.assert_close(big, reference.forward(big_step), rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(small, reference.forward(decodes), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("capture_size", [32, 16])
def test_engine_tokens_equal_with_emulated_graphs(request, sampling, async_scheduling, capture_size):
    """12 requests admitted as others finish (4 at a time), prompts chunked at 24 tokens: pure decode,
    mixed and prefill steps, some larger than the graphs (of up to 32 tokens; or 16, below the
    step's token budget: the larger steps run from the eager steps' buffers)."""
    model = tiny_model()
    prompts = random_prompts(200, [3, 40, 9, 17, 26, 5, 33, 12, 8, 21, 30, 2], seed=9)
    params = [SAMPLING[sampling](i) for i in range(len(prompts))]
    engine = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
                  max_cudagraph_capture_size=capture_size, async_scheduling=async_scheduling, block_size=4,
                  num_gpu_blocks_override=256)

    def run() -> list[list[int]]:
        llm = LLM(str(model), **engine)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.shutdown()
        return [o.outputs[0].token_ids for o in outputs]

    eager = run()
    replayed = request.getfixturevalue("emulated_graphs")
    assert run() == eager
    kinds = {key.kind for key in replayed}
    assert kinds == {"decode", "mixed"}, replayed
    assert max(key.size for key in replayed) <= capture_size
    assert np.mean([len(t) for t in eager]) >= 12
