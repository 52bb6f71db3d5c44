"""core_api on CUDA, float32, against transformers on CPU: the Triton paged path (each sequence's
cells as a block table of block size 1) and the masked path, through mixed batches, shared prompt
cells and shifted positions. float32 kernels use exact (IEEE) dot products: 1e-3 absolute.

Decode steps replay CUDA graphs captured at load time; the eager path (``enforce_eager``) gives the
same logits (1e-4 absolute in float32: the same kernels, in batches of other sizes and with other
split-K counts) through every kind of batch and KV operation, and after ``replace_weight``."""

from __future__ import annotations

import pytest
import torch

from novainfer.core_api import Batch, KvStatus, Model
from novainfer.worker.cuda_graphs import GraphKey
from tests.core_api_utils import decode_seqs, hf_logits_at
from tests.test_core_api_graphs import Pair, record_replays, run_every_kind_of_step
from tests.utils import hf_greedy, hf_logits, random_ids, tiny_model

pytestmark = pytest.mark.gpu

ATOL = 1e-3
CONFIGS = {"tiny": {}, "ratio7-hd64": dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                           hidden_size=896, intermediate_size=1024, num_hidden_layers=2, std=0.05)}


@pytest.fixture(scope="module", params=["triton", "masked"])
def attention(request):
    return request.param


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batches_greedy_parity(name, attention):
    path = tiny_model(**CONFIGS[name])
    model = Model.from_pretrained(path, device="cuda", dtype="float32", n_ctx=512, n_seq_max=4, attention=attention)
    vocab = model.n_vocab
    prompts = {0: random_ids(1, 5, vocab), 1: random_ids(2, 33, vocab), 2: random_ids(3, 120, vocab)}
    code, where = decode_seqs(model, prompts, logits="all")
    assert code == 0, model.last_error
    for seq, tokens in prompts.items():
        got = torch.stack([model.get_logits_ith(i) for i in where[seq]]).cpu()
        torch.testing.assert_close(got, hf_logits(path, tokens), atol=ATOL, rtol=0)
    outputs = {s: [int(model.get_logits_ith(where[s][-1]).argmax())] for s in prompts}
    for _ in range(5):
        code, where = decode_seqs(model, {s: out[-1:] for s, out in outputs.items()})
        assert code == 0, model.last_error
        for s, out in outputs.items():
            out.append(int(model.get_logits_ith(where[s][0]).argmax()))
    for s, prompt in prompts.items():
        assert outputs[s] == hf_greedy(path, prompt, 6)


def test_shared_prompt_and_shifted_positions(attention):
    path = tiny_model()
    model = Model.from_pretrained(path, device="cuda", dtype="float32", n_ctx=128, n_seq_max=4, attention=attention)
    prompt = random_ids(4, 40, model.n_vocab)
    assert model.decode(Batch.get_one(prompt)) == 0
    for seq in (1, 2):
        assert model.kv_seq_cp(seq, 0) == KvStatus.OK
    assert model.kv_seq_add(2, -1, -1, 7) == KvStatus.OK  # a private, shifted copy for sequence 2
    code, where = decode_seqs(model, {0: [10], 1: [11], 2: [12]})
    assert code == 0, model.last_error
    torch.testing.assert_close(model.get_logits_ith(where[0][0]).cpu(), hf_logits(path, prompt + [10])[-1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(model.get_logits_ith(where[1][0]).cpu(), hf_logits(path, prompt + [11])[-1],
                               atol=ATOL, rtol=0)
    expected = hf_logits_at(path, prompt + [12], list(range(7, 48)))[-1]
    torch.testing.assert_close(model.get_logits_ith(where[2][0]).cpu(), expected, atol=ATOL, rtol=0)
    assert model.kv_used_cells() == 40 + 40 + 3


def test_bfloat16_paths_are_as_close_to_float32_as_transformers_bf16():
    """The Triton paged path and the masked path on the same bf16 batch: each path's logits are about as
    close to the float32 truth as transformers' own bf16 logits (within 2x their error plus 0.05, the
    tolerance of the engine's bf16 parity tests)."""
    path = tiny_model()
    models = [Model.from_pretrained(path, device="cuda", dtype="bfloat16", n_ctx=256, n_seq_max=2, attention=a)
              for a in ("triton", "masked")]
    prompts = {0: random_ids(5, 50, models[0].n_vocab), 1: random_ids(6, 17, models[0].n_vocab)}
    for model in models:
        code, where = decode_seqs(model, prompts, logits="all")
        assert code == 0, model.last_error
        logits = model.get_logits().float().cpu()
        for seq, prompt in prompts.items():
            truth = hf_logits(path, prompt, torch.float32, "cuda").cpu()
            theirs = hf_logits(path, prompt, torch.bfloat16, "cuda").cpu()
            ours = logits[[model.output_ids().index(i) for i in where[seq]]]
            assert (ours - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 0.05


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_path_logits_equal_eager_path(name, monkeypatch):
    path = tiny_model(**CONFIGS[name])
    pair = Pair(path, record_replays(monkeypatch), device="cuda", atol=1e-4)
    assert pair.graphs.cuda_graphs and not pair.eager.cuda_graphs
    assert pair.graphs.graph_memory_bytes > 0
    run_every_kind_of_step(pair, path, pair.graphs.n_vocab, hf_atol=ATOL)


def test_graphs_read_replaced_weights(monkeypatch):
    """Captured steps read the parameters in place: replace_weight reaches them."""
    path = tiny_model()
    pair = Pair(path, record_replays(monkeypatch), device="cuda", atol=1e-4)
    pair.decode({0: random_ids(90, 20, pair.graphs.n_vocab), 1: random_ids(91, 7, pair.graphs.n_vocab)}, None)
    pair.decode({0: [5], 1: [6]}, GraphKey("decode", 2))
    before = pair.graphs.get_logits().clone()
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        weight = torch.randn(pair.graphs.config.intermediate_size, pair.graphs.config.hidden_size,
                             generator=generator) * 0.4
        for model in (pair.graphs, pair.eager):
            model.replace_weight("mlp.up_proj.weight", layer, weight)
    pair.decode({0: [7], 1: [8]}, GraphKey("decode", 2))
    assert (pair.graphs.get_logits() - before).abs().max() > 0.1


def test_bfloat16_graph_path_is_as_close_to_float32_as_the_eager_path(monkeypatch):
    """bf16: decode steps through the graphs and eagerly, each within 2x transformers' own bf16 error
    (plus 0.05) of the float32 truth, and the same greedy tokens."""
    path = tiny_model()
    replayed = record_replays(monkeypatch)
    models = [Model.from_pretrained(path, device="cuda", dtype="bfloat16", n_ctx=256, n_seq_max=2, enforce_eager=e)
              for e in (False, True)]
    prompts = {0: random_ids(92, 40, models[0].n_vocab), 1: random_ids(93, 13, models[0].n_vocab)}
    tokens = {s: list(p) for s, p in prompts.items()}
    for step in range(4):
        for model in models:
            code, where = decode_seqs(model, prompts if step == 0 else {s: t[-1:] for s, t in tokens.items()})
            assert code == 0, model.last_error
        assert replayed == [GraphKey("decode", 2)] * step
        for seq in prompts:
            truth = hf_logits(path, tokens[seq], torch.float32, "cuda")[-1].cpu()
            theirs = hf_logits(path, tokens[seq], torch.bfloat16, "cuda")[-1].cpu()
            ours = [model.get_logits_ith(where[seq][-1]).float().cpu() for model in models]
            for logits in ours:
                assert (logits - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 0.05
            assert int(ours[0].argmax()) == int(ours[1].argmax())
            tokens[seq].append(int(ours[0].argmax()))
