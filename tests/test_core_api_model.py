"""core_api's model API: creation through the registry, the output API, bad input, replace_weight."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from novainfer.core_api import Batch, KvStatus, Model, sample_token
from novainfer.models import ModelRegistry, UnsupportedArchitectureError
from novainfer.tiny_model import write_mock_model
from tests.core_api_utils import decode_seqs
from tests.utils import hf_logits, random_ids, tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def path():
    return tiny_model()


@pytest.fixture(scope="module")
def model(path):
    return Model.from_pretrained(path, device="cpu", n_ctx=32, n_seq_max=2, n_batch=16)


@pytest.fixture(autouse=True)
def _empty_cache(model):
    model.kv_clear()


# ---- creation and the registry ----------------------------------------------------------------------
def test_qwen2_and_mock_come_from_the_registry(path, tmp_path):
    qwen2 = Model.from_pretrained(path, device="cpu", n_ctx=8)
    assert type(qwen2.model) is ModelRegistry.resolve(["Qwen2ForCausalLM"])[0]
    mock = Model.from_pretrained(write_mock_model(tmp_path), device="cpu", n_ctx=8)
    assert type(mock.model) is ModelRegistry.resolve(["NovaInferMockForCausalLM"])[0]
    # The mock's next token is last + 1: each sequence's logits row says so.
    code, where = decode_seqs(mock, {0: [5, 9], 1: [100]})
    assert code == 0
    assert [int(mock.get_logits_ith(where[s][-1]).argmax()) for s in (0, 1)] == [10, 101]
    assert mock.kv_seq_add(0, -1, -1, 3) == KvStatus.OK  # no rotary: positions only
    assert mock.kv_seq_pos_max(0) == 4


def test_unsupported_architecture_is_named(tmp_path):
    model_dir = write_mock_model(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPTBigCodeForCausalLM"):
        Model.from_pretrained(model_dir, device="cpu")


@pytest.mark.parametrize("kwargs,field", [({"n_ctx": 0}, "n_ctx"), ({"n_seq_max": 0}, "n_seq_max"),
                                          ({"attention": "flash"}, "attention"), ({"n_batch": 0}, "n_batch")])
def test_bad_construction_arguments_are_named(path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        Model.from_pretrained(path, device="cpu", **kwargs)


# ---- outputs ----------------------------------------------------------------------------------------
def test_output_rows_follow_the_logits_flags(model, path, vocab_size):
    tokens = random_ids(0, 6, vocab_size)
    batch = Batch.init(6, 1)
    flags = [True, False, False, True, False, True]
    for i, (t, flag) in enumerate(zip(tokens, flags)):
        batch.add(t, i, [0], logits=flag)
    assert model.decode(batch) == 0
    assert model.n_outputs() == 3 and model.output_ids() == [0, 3, 5]
    expected = hf_logits(path, tokens)
    torch.testing.assert_close(model.get_logits(), expected[[0, 3, 5]], atol=ATOL, rtol=0)
    assert model.get_logits().dtype == torch.float32
    torch.testing.assert_close(model.get_logits_ith(3), expected[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.get_logits_ith(-1), expected[5], atol=ATOL, rtol=0)  # rows from the end
    torch.testing.assert_close(model.get_logits_ith(-3), expected[0], atol=ATOL, rtol=0)
    with pytest.raises(IndexError, match="no logits"):
        model.get_logits_ith(1)
    with pytest.raises(IndexError, match="6 tokens"):
        model.get_logits_ith(6)
    with pytest.raises(IndexError, match="-3"):
        model.get_logits_ith(-4)


def test_outputs_are_stable_until_the_next_decode(model):
    assert model.decode(Batch.get_one([5, 6, 7])) == 0
    logits = model.get_logits()
    kept = logits.clone()
    model.kv_seq_cp(1, 0)
    model.kv_seq_rm(1)
    assert model.get_logits() is logits and torch.equal(logits, kept) and model.n_outputs() == 1
    assert model.decode(Batch.get_one([8])) == 0
    assert not torch.equal(model.get_logits(), kept)
    assert model.decode(Batch.get_one([model.n_vocab])) == -1  # a failed decode drops the outputs too
    assert model.n_outputs() == 0 and model.output_ids() == []
    with pytest.raises(IndexError):
        model.get_logits_ith(-1)


def test_sample_token(model):
    row = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_token(row) == 1
    draws = {sample_token(row, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(s))
             for s in range(40)}
    assert draws == {1, 3}
    with pytest.raises(ValueError, match="temperature"):
        sample_token(row, temperature=-1)


# ---- bad input ----------------------------------------------------------------------------------------
def _valid_batch() -> Batch:
    batch = Batch.init(4, 2)
    for i, t in enumerate([5, 6, 7]):
        batch.add(t, i, [0], logits=i == 2)
    return batch


def _set(field, value):
    def change(batch):
        setattr(batch, field, value) if not callable(value) else value(batch)
    return change


BAD_INPUTS = {
    "unknown seq id": (lambda b: b.seq_id.__setitem__((1, 0), 2), "seq_id[1]"),
    "negative seq id": (lambda b: b.seq_id.__setitem__((1, 0), -1), "seq_id[1]"),
    "repeated seq id": (lambda b: (b.n_seq_id.__setitem__(0, 2), b.seq_id.__setitem__((0, 1), 0)), "seq_id[0]"),
    "positions out of order": (lambda b: b.pos.__setitem__(2, 1), "pos[2]"),
    "position past the model": (lambda b: b.pos.__setitem__(2, 10**6), "pos[2]"),
    "too many tokens for the arrays": (lambda b: setattr(b, "n_tokens", 5), "n_tokens"),
    "more tokens than n_batch": (lambda b: setattr(b, "n_tokens", 17), "n_batch"),
    "no tokens": (lambda b: setattr(b, "n_tokens", 0), "n_tokens"),
    "logits flag on no token": (lambda b: b.logits.__setitem__(2, False), "logits"),
    "float tokens": (lambda b: setattr(b, "token", b.token.astype(np.float32)), "token"),
    "float positions": (lambda b: setattr(b, "pos", b.pos.astype(np.float64)), "pos"),
    "token outside the vocabulary": (lambda b: b.token.__setitem__(0, 10**6), "token[0]"),
    "n_seq_id zero": (lambda b: b.n_seq_id.__setitem__(1, 0), "n_seq_id[1]"),
    "n_seq_id past the array": (lambda b: b.n_seq_id.__setitem__(1, 3), "n_seq_id[1]"),
    "seq_id one-dimensional": (lambda b: setattr(b, "seq_id", np.zeros(4, dtype=np.int32)), "seq_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_returns_minus_one_naming_the_field(model, path, case):
    change, field = BAD_INPUTS[case]
    assert model.decode(Batch.get_one([3])) == 0
    before = model.kv_cells_dump()
    batch = _valid_batch()
    batch.pos[:3] += 1  # after the token already there
    change(batch)
    assert model.decode(batch) == -1
    assert field in model.last_error, model.last_error
    assert model.kv_cells_dump() == before
    assert model.decode(Batch.get_one([5, 6, 7])) == 0  # the model keeps working
    torch.testing.assert_close(model.get_logits_ith(-1), hf_logits(path, [3, 5, 6, 7])[-1], atol=ATOL, rtol=0)


def test_batch_add_refuses_overflow():
    batch = Batch.init(1, 1)
    batch.add(1, 0, [0])
    with pytest.raises(ValueError, match="n_tokens"):
        batch.add(2, 1, [0])
    with pytest.raises(ValueError, match="seq_ids"):
        Batch.init(2, 1).add(1, 0, [0, 1])
    with pytest.raises(ValueError, match="integers"):
        Batch.init(2, 1).add(1.5, 0, [0])
    with pytest.raises(ValueError, match="tokens"):
        Batch.get_one([1.5])
    batch.clear()
    assert batch.n_tokens == 0 and not batch.logits.any()


# ---- weights --------------------------------------------------------------------------------------------
def test_replace_every_weight_gives_the_other_checkpoint(vocab_size):
    """Each tensor of another checkpoint through replace_weight (fused q/k/v and gate/up parts,
    tied embedding included): the model then computes that checkpoint's logits."""
    from safetensors.torch import load_file

    source, target = tiny_model(), tiny_model(seed=1)
    model = Model.from_pretrained(source, device="cpu", n_ctx=16)
    for name, tensor in load_file(str(target / "model.safetensors")).items():
        if ".layers." in name:
            layer, rest = name.split(".layers.", 1)[1].split(".", 1)
            model.replace_weight(rest, int(layer), tensor)
        elif name != "lm_head.weight":
            model.replace_weight(name, None, tensor.double())  # any floating dtype, cast to the model's
    tokens = random_ids(1, 5, vocab_size)
    assert model.decode(Batch.get_one(tokens)) == 0
    torch.testing.assert_close(model.get_logits_ith(-1), hf_logits(target, tokens)[-1], atol=ATOL, rtol=0)


def test_replace_weight_refusals(model):
    hidden = model.config.hidden_size
    with pytest.raises(ValueError, match="tied"):
        model.replace_weight("lm_head.weight", None, torch.zeros(model.n_vocab, hidden))
    with pytest.raises(ValueError, match="unknown weight 'self_attn.x_proj.weight'"):
        model.replace_weight("self_attn.x_proj.weight", 0, torch.zeros(1))
    with pytest.raises(ValueError, match="layer=None"):
        model.replace_weight("self_attn.q_proj.weight", None, torch.zeros(1))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        model.replace_weight("self_attn.q_proj.weight", 2, torch.zeros(1))
    with pytest.raises(ValueError, match="floating-point"):
        model.replace_weight("model.norm.weight", None, torch.zeros(hidden, dtype=torch.int64))
    before = model.model.model.norm.weight.clone()
    with pytest.raises(ValueError, match="shape"):
        model.replace_weight("model.norm.weight", None, torch.zeros(hidden + 1))
    with pytest.raises(ValueError, match="shape"):
        model.replace_weight("self_attn.q_proj.weight", 0, torch.zeros(3, 3))
    assert torch.equal(model.model.model.norm.weight, before)
