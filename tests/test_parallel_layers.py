"""Tensor-parallel sharding of the linear / embedding layers (seed 000, section 7.1), on CPU.

Each rank's layer is built with an explicit fake ``tp_group`` of the wanted size and rank; no real
communication happens. Full checkpoint tensors are ``arange`` based, so every element is unique and
the exact slice a rank keeps can be checked, and the union of the ranks' shards must rebuild the
full tensor exactly with nothing duplicated. TP arithmetic is then simulated by hand (concatenate
column-parallel outputs, sum row-parallel partials) and compared with the unsharded ``F.linear``.

Finally a whole model is run with 2 and 4 ranks on threads whose group really sums / gathers, and
must give the logits of the single-rank model.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from novainfer.config import CacheConfig, ModelConfig
from novainfer.distributed import CompletedWork, ProcessGroup, ReduceOpType, tp_group_context
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from novainfer.layers.sharding import WeightShardError
from novainfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from novainfer.model_loader import build_model, iterate_weights, load_weights
from novainfer.tiny_model import write_random_qwen2
from novainfer.worker.model_runner import ModelRunner, SequenceInput

TP_SIZES = [2, 4]


# ---- test doubles -------------------------------------------------------------------------------
class RecordingProcessGroup(ProcessGroup):
    """Records every collective (name, a copy of the input tensor at call time).

    ``all_reduce`` leaves the tensor as it is unless ``on_all_reduce`` is given (a function that
    edits the tensor in place, standing in for the other ranks). ``all_gather`` copies the tensor
    when the group has one rank; with more ranks it cannot really gather, so it needs
    ``on_all_gather(output, tensor)`` or it fills ``output`` with NaN.
    """

    def __init__(self, world_size: int = 1, rank: int = 0, name: str = "recording", *,
                 on_all_reduce: Callable[[torch.Tensor], None] | None = None,
                 on_all_gather: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        super().__init__(name, rank=rank, world_size=world_size)
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.on_all_reduce = on_all_reduce
        self.on_all_gather = on_all_gather
        self._lock = threading.Lock()

    def _record(self, op: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self.calls.append((op, tensor.detach().clone()))

    def count(self, op: str) -> int:
        return sum(1 for name, _ in self.calls if name == op)

    def recorded(self, op: str) -> list[torch.Tensor]:
        return [t for name, t in self.calls if name == op]

    @staticmethod
    def _done(async_op: bool):
        return CompletedWork() if async_op else None

    def _all_reduce(self, tensor, op, async_op):
        assert op is ReduceOpType.kSum, f"unexpected reduce op {op}"
        self._record("all_reduce", tensor)
        if self.on_all_reduce is not None:
            self.on_all_reduce(tensor)
        return self._done(async_op)

    def all_gather(self, output, tensor, async_op=False):
        self._record("all_gather", tensor)
        if self.on_all_gather is not None:
            self.on_all_gather(output, tensor)
        elif self.world_size == 1:
            output.copy_(tensor)
        else:
            output.fill_(float("nan"))
        return self._done(async_op)

    def reduce_scatter(self, output, tensor, op=ReduceOpType.kSum, async_op=False):
        self._record("reduce_scatter", tensor)
        if self.world_size != 1:
            raise NotImplementedError("RecordingProcessGroup cannot reduce_scatter over several ranks")
        output.copy_(tensor)
        return self._done(async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        self._record("broadcast", tensor)
        return self._done(async_op)

    def send(self, tensor, dst):
        raise NotImplementedError

    def recv(self, tensor, src):
        raise NotImplementedError


class _Rendezvous:
    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size


class ThreadProcessGroup(RecordingProcessGroup):
    """Ranks on threads of one process that really exchange tensors (sum in rank order / concatenate)."""

    def __init__(self, rendezvous: _Rendezvous, world_size: int, rank: int) -> None:
        super().__init__(world_size, rank, name="threads")
        self.rdv = rendezvous

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.rdv.slots[self.rank] = tensor.detach().clone()
        self.rdv.barrier.wait()
        parts = list(self.rdv.slots)
        self.rdv.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def _all_reduce(self, tensor, op, async_op):
        assert op is ReduceOpType.kSum
        self._record("all_reduce", tensor)
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return self._done(async_op)

    def all_gather(self, output, tensor, async_op=False):
        self._record("all_gather", tensor)
        output.copy_(torch.cat(self._exchange(tensor), dim=0))
        return self._done(async_op)


# ---- helpers ------------------------------------------------------------------------------------
def traceable(*shape: int, offset: float = 0.0) -> torch.Tensor:
    """A float tensor whose elements are ``offset, offset + 1, ...``: every value is unique."""
    return (torch.arange(math.prod(shape), dtype=torch.float32) + offset).reshape(shape)


def expected_shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Naive contiguous shard: indices ``[rank * chunk, (rank + 1) * chunk)`` along ``dim``."""
    chunk = full.shape[dim] // tp
    index = torch.tensor(list(range(rank * chunk, (rank + 1) * chunk)))
    return full.index_select(dim, index)


def assert_exact_partition(shards: list[torch.Tensor], full: torch.Tensor, dim: int) -> None:
    """The shards, concatenated in rank order, are exactly ``full``; no element is kept twice."""
    assert torch.equal(torch.cat(shards, dim=dim), full)
    values = torch.cat([s.flatten() for s in shards])
    assert values.numel() == full.numel()
    assert values.unique().numel() == full.numel()  # elements of ``full`` are unique: no overlap


def group(tp: int, rank: int, **kwargs) -> RecordingProcessGroup:
    return RecordingProcessGroup(tp, rank, **kwargs)


def assert_shard_error(exc: WeightShardError, *, weight_name: str, global_shape, local_shape, tp: int,
                       rank: int) -> None:
    msg = str(exc)
    assert weight_name in msg
    assert str(tuple(global_shape)) in msg
    assert str(tuple(local_shape)) in msg
    assert f"tp_size={tp}" in msg
    assert f"tp_rank={rank}" in msg
    assert exc.weight_name == weight_name
    assert exc.global_shape == tuple(global_shape)
    assert exc.local_shape == tuple(local_shape)
    assert (exc.tp_size, exc.tp_rank) == (tp, rank)


HIDDEN = 6


# ---- column parallel ----------------------------------------------------------------------------
@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_shards_output_dim_and_bias(tp):
    out_features = 8
    weight = traceable(out_features, HIDDEN)
    bias = traceable(out_features, offset=1000)
    layers = []
    for rank in range(tp):
        g = group(tp, rank)
        layer = ColumnParallelLinear(HIDDEN, out_features, bias=True, tp_group=g, prefix="col")
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        assert layer.weight.shape == (out_features // tp, HIDDEN)
        assert layer.bias.shape == (out_features // tp,)
        assert torch.equal(layer.weight, expected_shard(weight, 0, rank, tp))
        assert torch.equal(layer.bias, expected_shard(bias, 0, rank, tp))
        layers.append(layer)
    assert_exact_partition([layer.weight.data for layer in layers], weight, 0)
    assert_exact_partition([layer.bias.data for layer in layers], bias, 0)

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    outputs = [layer(x) for layer in layers]
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias), rtol=1e-6, atol=1e-4)
    # Column parallel needs no communication.
    assert all(not layer.tp_group.calls for layer in layers)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_merged_column_parallel_gate_up(tp):
    inter = 12
    gate = traceable(inter, HIDDEN)
    up = traceable(inter, HIDDEN, offset=10_000)
    layers = []
    for rank in range(tp):
        layer = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp_group=group(tp, rank), prefix="mlp.gate_up_proj")
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        local = inter // tp
        assert layer.weight.shape == (2 * local, HIDDEN)
        # Local layout: [gate_local ; up_local] -- segment boundaries never straddle ranks.
        assert torch.equal(layer.weight[:local], expected_shard(gate, 0, rank, tp))
        assert torch.equal(layer.weight[local:], expected_shard(up, 0, rank, tp))
        layers.append(layer)
    local = inter // tp
    assert_exact_partition([layer.weight[:local] for layer in layers], gate, 0)
    assert_exact_partition([layer.weight[local:] for layer in layers], up, 0)

    # Each rank's silu(gate) * up is the matching slice of the unsharded activation.
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1)) / 50
    act = SiluAndMul()
    expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(torch.cat([act(layer(x)) for layer in layers], dim=-1), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_merged_column_parallel_bias_follows_segments(tp):
    inter = 8
    gate_b, up_b = traceable(inter, offset=100), traceable(inter, offset=200)
    biases = []
    for rank in range(tp):
        layer = MergedColumnParallelLinear(HIDDEN, [inter, inter], bias=True, tp_group=group(tp, rank), prefix="gu")
        layer.bias.weight_loader(layer.bias, gate_b, 0)
        layer.bias.weight_loader(layer.bias, up_b, 1)
        expected = torch.cat([expected_shard(gate_b, 0, rank, tp), expected_shard(up_b, 0, rank, tp)])
        assert torch.equal(layer.bias, expected)
        biases.append(layer.bias.data)
    local = inter // tp
    assert_exact_partition([b[:local] for b in biases], gate_b, 0)
    assert_exact_partition([b[local:] for b in biases], up_b, 0)


# ---- fused QKV with GQA -------------------------------------------------------------------------
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 4


def qkv_full_tensors():
    q = traceable(NUM_HEADS * HEAD_DIM, HIDDEN)
    k = traceable(NUM_KV_HEADS * HEAD_DIM, HIDDEN, offset=10_000)
    v = traceable(NUM_KV_HEADS * HEAD_DIM, HIDDEN, offset=20_000)
    qb = traceable(NUM_HEADS * HEAD_DIM, offset=30_000)
    kb = traceable(NUM_KV_HEADS * HEAD_DIM, offset=40_000)
    vb = traceable(NUM_KV_HEADS * HEAD_DIM, offset=50_000)
    return q, k, v, qb, kb, vb


def build_qkv_ranks(tp: int) -> list[QKVParallelLinear]:
    q, k, v, qb, kb, vb = qkv_full_tensors()
    layers = []
    for rank in range(tp):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=True, tp_group=group(tp, rank),
                                  prefix="self_attn.qkv_proj")
        for shard_id, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            layer.weight.weight_loader(layer.weight, w, shard_id)
            layer.bias.weight_loader(layer.bias, b, shard_id)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("tp", TP_SIZES)
def test_qkv_parallel_gqa_local_layout(tp):
    q, k, v, qb, kb, vb = qkv_full_tensors()
    local_nh, local_nkvh = NUM_HEADS // tp, NUM_KV_HEADS // tp
    q_rows, kv_rows = local_nh * HEAD_DIM, local_nkvh * HEAD_DIM
    layers = build_qkv_ranks(tp)
    for rank, layer in enumerate(layers):
        assert (layer.num_heads, layer.num_kv_heads) == (local_nh, local_nkvh)
        assert (layer.q_size, layer.kv_size) == (q_rows, kv_rows)
        assert layer.weight.shape == (q_rows + 2 * kv_rows, HIDDEN)
        assert layer.bias.shape == (q_rows + 2 * kv_rows,)
        q_local, k_local, v_local = layer.weight.split([q_rows, kv_rows, kv_rows])
        # Seed 7.1.2 shapes: q [local_nh*dh, hs], k/v [local_nkvh*dh, hs].
        assert q_local.shape == (local_nh * HEAD_DIM, HIDDEN)
        assert k_local.shape == v_local.shape == (local_nkvh * HEAD_DIM, HIDDEN)
        # Fused local layout = concat(q_local, k_local, v_local), each the rank's contiguous heads.
        expected_w = torch.cat([expected_shard(q, 0, rank, tp), expected_shard(k, 0, rank, tp),
                                expected_shard(v, 0, rank, tp)])
        expected_b = torch.cat([expected_shard(qb, 0, rank, tp), expected_shard(kb, 0, rank, tp),
                                expected_shard(vb, 0, rank, tp)])
        assert torch.equal(layer.weight, expected_w)
        assert torch.equal(layer.bias, expected_b)
        # GQA stays consistent per rank: local query head j belongs to local kv head j // group,
        # which is global kv head (global q head) // group.
        group_size = NUM_HEADS // NUM_KV_HEADS
        for j in range(local_nh):
            assert rank * local_nh + j == (rank * local_nkvh + j // group_size) * group_size + j % group_size
    for i, full in enumerate((q, k, v)):
        sizes = [q_rows, kv_rows, kv_rows]
        start = sum(sizes[:i])
        assert_exact_partition([layer.weight[start:start + sizes[i]] for layer in layers], full, 0)
    for i, full in enumerate((qb, kb, vb)):
        sizes = [q_rows, kv_rows, kv_rows]
        start = sum(sizes[:i])
        assert_exact_partition([layer.bias[start:start + sizes[i]] for layer in layers], full, 0)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_qkv_parallel_outputs_concatenate_to_unsharded(tp):
    q, k, v, qb, kb, vb = qkv_full_tensors()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    full_out = F.linear(x, torch.cat([q, k, v]), torch.cat([qb, kb, vb]))
    full_q, full_k, full_v = full_out.split([q.shape[0], k.shape[0], v.shape[0]], dim=-1)
    parts = {"q": [], "k": [], "v": []}
    for layer in build_qkv_ranks(tp):
        out_q, out_k, out_v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        parts["q"].append(out_q)
        parts["k"].append(out_k)
        parts["v"].append(out_v)
        assert not layer.tp_group.calls
    for name, full in (("q", full_q), ("k", full_k), ("v", full_v)):
        torch.testing.assert_close(torch.cat(parts[name], dim=-1), full, rtol=1e-6, atol=1e-3)


def test_qkv_rejects_unknown_shard_id():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, tp_group=group(2, 0), prefix="qkv")
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight.weight_loader(layer.weight, traceable(NUM_HEADS * HEAD_DIM, HIDDEN), "o")


# ---- the matmul of every linear layer ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_bitwise_f_linear_and_follows_weight_changes(cls, bias, dtype):
    """The layers skip F.linear's dispatch for 2-D inputs (a cached transposed view of the weight):
    the outputs must be F.linear's to the bit, also after the weight's storage is swapped. (A
    row-parallel bias is added after the all-reduce, so there it is F.linear without it, plus it.)"""
    gen = torch.Generator().manual_seed(11)
    layer = cls(48, 40, bias=bias, params_dtype=dtype, tp_group=group(1, 0), prefix="proj")
    layer.weight.data.copy_(torch.randn(40, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(40, generator=gen))

    def expected(x):
        if cls is RowParallelLinear and bias:
            return F.linear(x, layer.weight) + layer.bias
        return F.linear(x, layer.weight, layer.bias)

    for x in (torch.randn(7, 48, generator=gen).to(dtype), torch.randn(2, 3, 48, generator=gen).to(dtype)):
        assert torch.equal(layer(x), expected(x))
    x = torch.randn(7, 48, generator=gen).to(dtype)
    layer(x)  # the transposed view is cached now
    layer.weight.data = torch.randn(40, 48, generator=gen).to(dtype)  # a new storage, as .to() makes
    assert torch.equal(layer(x), expected(x))
    layer.weight.data.mul_(-2)  # in place, as the weight loader writes
    assert torch.equal(layer(x), expected(x))
    layer.double()
    assert torch.equal(layer(x.double()), expected(x.double()))


def test_linear_dispatches_one_matmul_per_call():
    """The per-call cost the cached view removes: a linear layer on [T, in] is one aten op (no
    ``t``/``transpose`` of the weight per call, as F.linear has)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(5, 12)
    for layer, op in ((ColumnParallelLinear(12, 8, bias=True, tp_group=group(1, 0)), "addmm.default"),
                      (RowParallelLinear(12, 8, reduce_results=False, tp_group=group(1, 0)), "mm.default")):
        layer(x)
        with Recorder() as recorder:
            layer(x)
        assert recorder.ops == [op]


# ---- row parallel -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_shards_input_dim_bias_replicated(tp):
    in_features = 8
    weight = traceable(HIDDEN, in_features)
    bias = traceable(HIDDEN, offset=1000)
    layers = []
    for rank in range(tp):
        layer = RowParallelLinear(in_features, HIDDEN, bias=True, tp_group=group(tp, rank), prefix="o_proj")
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        # Seed 7.1.2: o/down [hs, local_in].
        assert layer.weight.shape == (HIDDEN, in_features // tp)
        assert torch.equal(layer.weight, expected_shard(weight, 1, rank, tp))
        assert layer.bias.shape == (HIDDEN,)
        assert torch.equal(layer.bias, bias)
        layers.append(layer)
    assert_exact_partition([layer.weight.data for layer in layers], weight, 1)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_partial_sums_all_reduce_once_and_bias_once(tp):
    in_features = 8
    chunk = in_features // tp
    weight = torch.randn(HIDDEN, in_features, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(4))
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(5))
    # What each rank computes before the reduction, from the naive contiguous slices.
    partials = [x[:, r * chunk:(r + 1) * chunk] @ weight[:, r * chunk:(r + 1) * chunk].T for r in range(tp)]
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(sum(partials) + bias, expected, rtol=1e-5, atol=1e-5)

    for rank in range(tp):
        # The fake all-reduce adds the other ranks' partial sums in place, as a real one would.
        others = sum(p for r, p in enumerate(partials) if r != rank)
        g = group(tp, rank, on_all_reduce=lambda t, others=others: t.add_(others))
        layer = RowParallelLinear(in_features, HIDDEN, bias=True, tp_group=g, prefix="down_proj")
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        out = layer(x[:, rank * chunk:(rank + 1) * chunk])  # input_is_parallel: this rank's slice
        assert g.count("all_reduce") == 1
        assert len(g.calls) == 1
        # The reduced tensor is the bias-free partial sum: the bias is added after the reduce ...
        torch.testing.assert_close(g.recorded("all_reduce")[0], partials[rank], rtol=1e-5, atol=1e-5)
        # ... exactly once, on the reduced result.
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        layer(x[:, rank * chunk:(rank + 1) * chunk])
        assert g.count("all_reduce") == 2  # one per forward


def test_row_parallel_without_reduce_results_does_not_communicate():
    g = group(2, 1)
    layer = RowParallelLinear(8, HIDDEN, bias=False, reduce_results=False, tp_group=g, prefix="o")
    weight = torch.randn(HIDDEN, 8, generator=torch.Generator().manual_seed(6))
    layer.weight.weight_loader(layer.weight, weight)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(layer(x), x @ weight[:, 4:].T)
    assert not g.calls


def test_row_parallel_single_rank_group_reduces_once():
    g = group(1, 0)
    layer = RowParallelLinear(8, HIDDEN, bias=True, tp_group=g, prefix="o")
    weight, bias = traceable(HIDDEN, 8) / 100, traceable(HIDDEN) / 10
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
    assert g.count("all_reduce") == 1 and len(g.calls) == 1


@pytest.mark.parametrize("tp", TP_SIZES)
def test_simulated_tensor_parallel_mlp_matches_unsharded(tp):
    """gate_up (column) -> SiluAndMul -> down (row): the sum of the ranks' partials is the MLP."""
    inter = 12
    gen = torch.Generator().manual_seed(9)
    gate, up = torch.randn(inter, HIDDEN, generator=gen), torch.randn(inter, HIDDEN, generator=gen)
    down = torch.randn(HIDDEN, inter, generator=gen)
    x = torch.randn(4, HIDDEN, generator=gen)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    partials = []
    for rank in range(tp):
        g = group(tp, rank)
        gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp_group=g, prefix="gate_up")
        down_proj = RowParallelLinear(inter, HIDDEN, tp_group=g, prefix="down")
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        down_proj.weight.weight_loader(down_proj.weight, down)
        assert gate_up.weight.shape == (2 * inter // tp, HIDDEN)  # gate/up [local_di, hs] each
        assert down_proj.weight.shape == (HIDDEN, inter // tp)  # down [hs, local_di]
        partials.append(down_proj(SiluAndMul()(gate_up(x))))  # the fake all-reduce leaves the partial
        assert g.count("all_reduce") == 1
    torch.testing.assert_close(sum(partials), expected, rtol=1e-5, atol=1e-5)


# ---- non-divisible and mis-shaped ---------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 3])
def test_non_divisible_column_and_row_raise_weight_shard_error(rank):
    with pytest.raises(WeightShardError) as exc:
        ColumnParallelLinear(HIDDEN, 10, tp_group=group(4, rank), prefix="layers.0.col")
    assert_shard_error(exc.value, weight_name="layers.0.col.weight", global_shape=(10, HIDDEN),
                       local_shape=(2.5, HIDDEN), tp=4, rank=rank)

    with pytest.raises(WeightShardError) as exc:
        RowParallelLinear(10, HIDDEN, tp_group=group(4, rank), prefix="layers.0.mlp.down_proj")
    assert_shard_error(exc.value, weight_name="layers.0.mlp.down_proj.weight", global_shape=(HIDDEN, 10),
                       local_shape=(HIDDEN, 2.5), tp=4, rank=rank)


def test_non_divisible_intermediate_in_merged_gate_up_raises():
    # intermediate 10 with tp 4: the fused width 20 divides, but each segment does not.
    with pytest.raises(WeightShardError) as exc:
        MergedColumnParallelLinear(HIDDEN, [10, 10], tp_group=group(4, 1), prefix="layers.0.mlp.gate_up_proj")
    msg = str(exc.value)
    assert "layers.0.mlp.gate_up_proj" in msg
    assert f"global_shape={(10, HIDDEN)}" in msg
    assert f"local_shape={(2.5, HIDDEN)}" in msg
    assert "tp_size=4" in msg and "tp_rank=1" in msg


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 2), (8, 3)])
def test_non_divisible_heads_in_qkv_raise(num_heads, num_kv_heads):
    with pytest.raises(WeightShardError) as exc:
        QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, tp_group=group(4, 2),
                          prefix="layers.1.self_attn.qkv_proj")
    err = exc.value
    msg = str(err)
    assert "layers.1.self_attn.qkv_proj" in msg
    assert "global_shape=" in msg and str(err.global_shape) in msg
    assert "local_shape=" in msg and str(err.local_shape) in msg
    assert "tp_size=4" in msg and "tp_rank=2" in msg
    # Every segment's row count divides here; the message must say it is the head counts that do not.
    assert f"num_heads={num_heads}" in msg and f"num_kv_heads={num_kv_heads}" in msg


def test_divisible_heads_do_not_raise():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 8, 4, tp_group=group(4, 3), prefix="qkv")
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mis_shaped_checkpoint_tensor_names_expected_and_actual(tp):
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=True, tp_group=group(tp, tp - 1),
                              prefix="model.layers.0.self_attn.qkv_proj")
    bad_k = traceable((NUM_KV_HEADS + 1) * HEAD_DIM, HIDDEN)
    with pytest.raises(WeightShardError) as exc:
        layer.weight.weight_loader(layer.weight, bad_k, "k", weight_name="model.layers.0.self_attn.k_proj.weight")
    msg = str(exc.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert str(((NUM_KV_HEADS + 1) * HEAD_DIM, HIDDEN)) in msg  # actual
    assert str((NUM_KV_HEADS * HEAD_DIM, HIDDEN)) in msg  # expected
    assert f"tp_size={tp}" in msg and f"tp_rank={tp - 1}" in msg

    row = RowParallelLinear(8, HIDDEN, bias=True, tp_group=group(tp, 0), prefix="o_proj")
    with pytest.raises(WeightShardError) as exc:
        row.weight.weight_loader(row.weight, traceable(HIDDEN, 8 + tp))
    assert "o_proj.weight" in str(exc.value)
    assert str((HIDDEN, 8 + tp)) in str(exc.value) and str((HIDDEN, 8)) in str(exc.value)
    with pytest.raises(WeightShardError) as exc:
        row.bias.weight_loader(row.bias, traceable(HIDDEN + 1))
    assert "o_proj.bias" in str(exc.value)
    assert str((HIDDEN + 1,)) in str(exc.value) and str((HIDDEN,)) in str(exc.value)

    emb = VocabParallelEmbedding(12, 3, tp_group=group(tp, 0), prefix="embed_tokens")
    with pytest.raises(WeightShardError) as exc:
        emb.weight.weight_loader(emb.weight, traceable(12, 4))
    assert "embed_tokens.weight" in str(exc.value)
    assert str((12, 4)) in str(exc.value) and str((12, 3)) in str(exc.value)


# ---- vocabulary parallel ------------------------------------------------------------------------
def vocab_ranges(vocab: int, tp: int) -> list[tuple[int, int]]:
    per = -(-vocab // tp)
    return [(min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(tp)]


# (4, 5): ceil(5 / 4) = 2 rows per rank, so rank 3's range [6, 8) lies past the vocabulary: empty.
@pytest.mark.parametrize("tp,vocab", [(2, 10), (4, 12), (4, 10), (2, 11), (4, 5)])
def test_vocab_parallel_embedding_shards_and_partial_lookups(tp, vocab):
    dim = 3
    full = traceable(vocab, dim, offset=1)  # no zero row: padding rows are distinguishable
    per = -(-vocab // tp)
    ids = torch.tensor([0, vocab - 1, 3, 5, 9, 1, vocab - 2, 0]) % vocab
    partials, shards = [], []
    for rank, (start, end) in enumerate(vocab_ranges(vocab, tp)):
        g = group(tp, rank)
        emb = VocabParallelEmbedding(vocab, dim, tp_group=g, prefix="model.embed_tokens")
        emb.weight.weight_loader(emb.weight, full)
        assert emb.weight.shape == (per, dim)
        assert torch.equal(emb.weight[:end - start], full[start:end])
        assert torch.equal(emb.weight[end - start:], torch.zeros(per - (end - start), dim))  # padding
        shards.append(emb.weight[:end - start])
        partials.append(emb(ids))  # the fake all-reduce leaves this rank's partial embedding
        assert g.count("all_reduce") == 1 and len(g.calls) == 1
        # A rank contributes exactly the rows of the ids in its range, zeros elsewhere.
        for i, token in enumerate(ids.tolist()):
            expected_row = full[token] if start <= token < end else torch.zeros(dim)
            assert torch.equal(partials[-1][i], expected_row)
    assert_exact_partition(shards, full, 0)
    assert torch.equal(sum(partials), F.embedding(ids, full))


@pytest.mark.parametrize("tp,vocab", [(2, 10), (4, 12), (4, 10), (4, 5)])
def test_parallel_lm_head_gathers_logits_of_every_range(tp, vocab):
    dim = 5
    full = traceable(vocab, dim, offset=1) / 64  # exact in float32, every element unique
    hidden = torch.randn(3, dim, generator=torch.Generator().manual_seed(11))
    per = -(-vocab // tp)
    heads = []
    for rank in range(tp):
        head = ParallelLMHead(vocab, dim, tp_group=group(tp, rank), prefix="lm_head")
        head.weight.weight_loader(head.weight, full)
        start, end = vocab_ranges(vocab, tp)[rank]
        assert head.weight.shape == (per, dim)
        assert torch.equal(head.weight[:end - start], full[start:end])
        assert not head.weight[end - start:].any()  # padding rows are zero
        heads.append(head)
    assert_exact_partition([h.weight[:end - start] for h, (start, end) in zip(heads, vocab_ranges(vocab, tp))],
                           full, 0)
    # Stand-in for the other ranks: every rank's local logits stacked in rank order (dim 0).
    local_logits = [hidden @ h.weight.T for h in heads]
    for rank, head in enumerate(heads):
        head.tp_group.on_all_gather = lambda output, tensor: output.copy_(torch.cat(local_logits, dim=0))
        logits = head.compute_logits(hidden)
        assert head.tp_group.count("all_gather") == 1 and len(head.tp_group.calls) == 1
        start, end = vocab_ranges(vocab, tp)[rank]
        sent = head.tp_group.recorded("all_gather")[0]
        torch.testing.assert_close(sent[:, :end - start], hidden @ full[start:end].T)
        assert logits.shape == (3, vocab)
        torch.testing.assert_close(logits, F.linear(hidden, full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp,vocab", [(2, 10), (4, 5), (4, 12)])
def test_split_lm_head_greedy_tokens_match_the_argmax_of_the_gathered_logits(tp, vocab):
    """One (logit, id) pair per row and rank crosses the group; the padding columns of the last
    range never win, and ties go to the lowest id as with argmax."""
    logits = -1.0 - torch.rand(4, vocab, generator=torch.Generator().manual_seed(3))  # all negative
    logits[1, [1, vocab - 1]] = 5.0  # a tie across two ranges: the lower id wins
    logits[2, vocab - 1] = 7.0  # the best token is the last id (in the last non-empty range)
    per = -(-vocab // tp)
    heads = [ParallelLMHead(vocab, 3, tp_group=group(tp, rank), prefix="lm_head") for rank in range(tp)]
    local = [F.pad(logits[:, start:end], (0, per - (end - start))) for start, end in vocab_ranges(vocab, tp)]
    # First pass: what each rank sends; second pass: every rank receives all of them.
    for head, rank_logits in zip(heads, local):
        head.tp_group.on_all_gather = lambda output, tensor: output.zero_()
        head.greedy_tokens(rank_logits)
    sent = torch.cat([h.tp_group.recorded("all_gather")[0] for h in heads])
    assert sent.shape == (tp * 4, 2)
    for head, rank_logits in zip(heads, local):
        head.tp_group.on_all_gather = lambda output, tensor: output.copy_(sent)
        assert torch.equal(head.greedy_tokens(rank_logits), logits.argmax(dim=-1))
        assert head.tp_group.count("all_gather") == 2 and len(head.tp_group.calls) == 2
    assert logits.argmax(dim=-1)[1] == 1


def test_vocab_parallel_single_rank_has_no_collectives():
    g = group(1, 0)
    full = traceable(7, 4)
    emb = VocabParallelEmbedding(7, 4, tp_group=g, prefix="e")
    head = ParallelLMHead(7, 4, tp_group=g, prefix="h")
    emb.weight.weight_loader(emb.weight, full)
    head.weight.weight_loader(head.weight, full)
    ids = torch.tensor([6, 0, 3])
    assert torch.equal(emb(ids), full[ids])
    h = torch.randn(2, 4)
    torch.testing.assert_close(head.compute_logits(h), h @ full.T)
    assert not g.calls


def test_lm_head_tie_weights_shares_the_embedding_parameter():
    g = group(2, 1)
    emb = VocabParallelEmbedding(10, 4, tp_group=g, prefix="embed")
    head = ParallelLMHead(10, 4, tp_group=g, prefix="lm_head")
    head.tie_weights(emb)
    assert head.weight is emb.weight
    emb.weight.weight_loader(emb.weight, traceable(10, 4))
    assert torch.equal(head.weight, traceable(10, 4)[5:])
    with pytest.raises(ValueError):
        ParallelLMHead(12, 4, tp_group=g, prefix="lm_head").tie_weights(emb)


# ---- collectives inside the model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    # Heads divisible by 4; a vocabulary (1030) that is not, so the last vocab range is padded.
    return write_random_qwen2(tmp_path_factory.mktemp("tp-qwen2"), hidden_size=32, intermediate_size=48,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=1030,
                              tie_word_embeddings=False, num_hidden_layers=2)


def _runner_for(model_config: ModelConfig, model) -> ModelRunner:
    runner = ModelRunner(model_config, CacheConfig(block_size=4), torch.device("cpu"))
    runner.model = model.eval()
    runner.allocate_kv_cache(32)
    return runner


STEP = [SequenceInput(list(range(5, 16)), 0, [3, 0, 7], "all"),
        SequenceInput([1, 1029, 500, 2], 0, [5, 1], "all"),
        SequenceInput([42], 0, [9], "all")]


def test_decoder_layer_does_exactly_two_all_reduces(tp_model_dir):
    model_config = ModelConfig(str(tp_model_dir))
    rec = RecordingProcessGroup(1, 0)
    with tp_group_context(rec):
        model = build_model(model_config.hf_config, torch.float32, torch.device("cpu"))
    load_weights(model, iterate_weights(tp_model_dir))
    runner = _runner_for(model_config, model)
    for layer in model.model.layers:
        assert layer.self_attn.o_proj.tp_group is rec and layer.mlp.down_proj.tp_group is rec

    per_layer: list[int] = []
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(lambda m, a: per_layer.append(-len(rec.calls))))
        hooks.append(layer.register_forward_hook(lambda m, a, o: per_layer.__setitem__(-1, per_layer[-1] + len(rec.calls))))
    logits = runner.forward(STEP)
    for h in hooks:
        h.remove()
    num_layers = model_config.num_layers
    assert per_layer == [2] * num_layers
    assert rec.count("all_reduce") == 2 * num_layers and len(rec.calls) == 2 * num_layers
    num_tokens = sum(len(s.token_ids) for s in STEP)
    assert all(t.shape == (num_tokens, model_config.hf_config.hidden_size) for t in rec.recorded("all_reduce"))

    # Under the default single-rank group the same checkpoint gives the same logits.
    reference = ModelRunner(model_config, CacheConfig(block_size=4), torch.device("cpu"))
    reference.load_model()
    reference.allocate_kv_cache(32)
    assert torch.equal(logits, reference.forward(STEP))
    runner.forward(STEP[:1])
    assert rec.count("all_reduce") == 4 * num_layers


@pytest.mark.parametrize("tp", TP_SIZES)
def test_threaded_tensor_parallel_model_matches_single_rank(tp_model_dir, tp):
    """Every rank builds and loads its shard of the model on its own thread; the group really
    sums and gathers. Logits equal the single-rank model's up to summation order."""
    model_config = ModelConfig(str(tp_model_dir))
    reference = ModelRunner(model_config, CacheConfig(block_size=4), torch.device("cpu"))
    reference.load_model()
    reference.allocate_kv_cache(32)
    expected = reference.forward(STEP)

    rdv = _Rendezvous(tp)
    groups = [ThreadProcessGroup(rdv, tp, rank) for rank in range(tp)]

    def rank_main(rank: int):
        try:
            with tp_group_context(groups[rank]):
                model = build_model(model_config.hf_config, torch.float32, torch.device("cpu"), vocab_parallel=True)
            load_weights(model, iterate_weights(tp_model_dir))
            attn = model.model.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (8 // tp, 4 // tp)
            runner = _runner_for(model_config, model)
            return runner.forward(STEP)
        except BaseException:
            rdv.barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=tp) as pool:
        results = [f.result() for f in [pool.submit(rank_main, r) for r in range(tp)]]
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
        g = groups[rank]
        # 2 per decoder layer + 1 for the vocab-parallel embedding; 1 gather for the LM head.
        assert g.count("all_reduce") == 2 * model_config.num_layers + 1
        assert g.count("all_gather") == 1
