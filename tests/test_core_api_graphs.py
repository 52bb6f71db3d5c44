"""core_api's captured decode steps (:mod:`novainfer.core_api.graphs`), emulated on a CPU.

Emulated, every replay runs the step eagerly from the graphs' static inputs and their device
table of each sequence's cells, through the reference backend (which takes the padding of a
captured step as the Triton one does). So these tests check which batches take the graph path,
the padding, and the upkeep of the cell table (appended by the graph itself, brought up to date
after eager decodes and every ``kv_seq_*`` operation, left alone by failed decodes) against a
model that runs every batch eagerly: the logits of both must agree (1e-4 absolute, float32; the
two run the same arithmetic in batches of different sizes, padding rows included, which a CPU's BLAS
may round differently: 2.3e-5 was seen on one machine, where a wrong row is off by O(1)).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from novainfer.core_api import Batch, KvStatus, Model
from novainfer.worker.cuda_graphs import GraphKey, StepGraphs
from tests.core_api_utils import decode_seqs
from tests.utils import hf_logits, random_ids, tiny_model

ATOL = 1e-4
N_SEQ_MAX = 6
MAX_GRAPH_BATCH = 4


def record_replays(monkeypatch) -> list[GraphKey]:
    """The keys every graph replay runs from now on, in order."""
    keys: list[GraphKey] = []
    replay = StepGraphs.replay

    def recording(self, key):
        keys.append(key)
        return replay(self, key)

    monkeypatch.setattr(StepGraphs, "replay", recording)
    return keys


@pytest.fixture
def replayed(monkeypatch):
    """Graph capture turned on for CPU models; yields the keys every replay ran, in order."""
    monkeypatch.setattr(Model, "_can_capture", lambda self: True)
    return record_replays(monkeypatch)


@pytest.fixture
def path():
    return tiny_model()


def make_models(path, n_ctx: int = 512, device: str = "cpu", dtype: str = "float32") -> tuple[Model, Model]:
    """The same model twice: with decode graphs (batches of up to 4), and eager only."""
    kwargs = dict(device=device, dtype=dtype, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX,
                  max_cudagraph_capture_size=MAX_GRAPH_BATCH)
    return Model.from_pretrained(path, **kwargs), Model.from_pretrained(path, enforce_eager=True, **kwargs)


def assert_table_mirrors_cells(model: Model) -> None:
    """Every row of the graphs' block tables holds, on the device, what it claims of its sequence's cells."""
    graphs, cells = model._graphs, model.cells
    for row, (seq, generation, n) in enumerate(zip(graphs._row_seq, graphs._row_gen, graphs._row_len)):
        if seq >= 0 and generation == cells.generation[seq]:
            assert n <= len(cells.seq_cells(seq))
            assert graphs.block_tables[row, :n].tolist() == cells.seq_cells(seq)[:n].tolist()


class Pair:
    """Applies every call to both models and checks that they agree."""

    def __init__(self, path, replayed: list[GraphKey], n_ctx: int = 512, device: str = "cpu", atol: float = ATOL):
        self.graphs, self.eager = make_models(path, n_ctx, device)
        self.replayed = replayed
        self.atol = atol

    def decode(self, seqs: dict[int, list[int]], expect_graph: GraphKey | None, logits: str = "last") -> None:
        self.replayed.clear()
        codes = [decode_seqs(m, seqs, logits=logits) for m in (self.graphs, self.eager)]
        assert codes[0] == codes[1] and codes[0][0] == 0, self.graphs.last_error
        assert self.replayed == ([expect_graph] if expect_graph else [])
        self.check()
        if expect_graph:  # the graph appended the new cells itself: the same step again uploads nothing
            graphs = self.graphs._graphs
            assert graphs._row_seq[:len(seqs)].tolist() == list(seqs)
            assert all(graphs._row_len[row] == len(self.graphs.cells.seq_cells(s)) for row, s in enumerate(seqs))

    def decode_batch(self, fill, expect_graph: GraphKey | None) -> None:
        self.replayed.clear()
        for model in (self.graphs, self.eager):
            batch = fill()
            assert model.decode(batch) == 0, model.last_error
        assert self.replayed == ([expect_graph] if expect_graph else [])
        self.check()

    def kv(self, op: str, *args) -> None:
        assert getattr(self.graphs, op)(*args) == getattr(self.eager, op)(*args) == KvStatus.OK

    def check(self) -> None:
        assert self.graphs.output_ids() == self.eager.output_ids()
        torch.testing.assert_close(self.graphs.get_logits(), self.eager.get_logits(), atol=self.atol, rtol=0)
        assert self.graphs.kv_cells_dump(used_only=True) == self.eager.kv_cells_dump(used_only=True)
        assert_table_mirrors_cells(self.graphs)


def test_graph_path_equals_eager_path_through_every_kind_of_batch_and_kv_operation(path, replayed, vocab_size):
    pair = Pair(path, replayed)
    assert pair.graphs.cuda_graphs and not pair.eager.cuda_graphs  # enforce_eager: no capture
    assert pair.graphs.graph_memory_bytes == 4 * MAX_GRAPH_BATCH * (512 + 1)  # emulated: the cell table only
    run_every_kind_of_step(pair, path, vocab_size, hf_atol=1e-4)


def run_every_kind_of_step(pair: Pair, path, vocab_size: int, hf_atol: float) -> None:
    """Prompts, decode steps of subsets of sequences (padded), steps too large for the graphs, every
    kv_seq_* operation, eager steps between graph steps; the graph model's last logits against
    transformers."""
    replayed = pair.replayed
    assert replayed == []
    prompts = {s: random_ids(40 + s, n, vocab_size) for s, n in enumerate([7, 12, 3, 9, 15])}
    pair.decode(prompts, None)  # prompts: several tokens per sequence, eager
    for step in range(2):  # decode steps, padded from 3 rows to 4
        pair.decode({0: [10 + step], 1: [20 + step], 2: [30 + step]}, GraphKey("decode", 4))
    pair.decode({s: [5] for s in range(5)}, None)  # 5 sequences: more than the largest graph
    pair.decode({3: [6]}, GraphKey("decode", 1))
    pair.decode({4: [7], 0: [8]}, GraphKey("decode", 2))
    pair.kv("kv_seq_rm", 1, 4, 8)  # a hole inside sequence 1
    pair.decode({1: [9], 2: [11]}, GraphKey("decode", 2))
    pair.kv("kv_seq_cp", 5, 0)  # sequence 5 shares sequence 0's cells
    pair.decode({5: [12], 0: [13]}, GraphKey("decode", 2))
    pair.kv("kv_seq_add", 2, 2, -1, 5)  # shifted positions
    pair.decode({2: [14]}, GraphKey("decode", 1))
    pair.decode({0: [15, 16], 3: [17]}, None)  # two tokens of sequence 0: eager
    pair.decode({0: [18], 3: [19], 5: [20]}, GraphKey("decode", 4))  # the cells the eager step added are uploaded

    def shared_token() -> Batch:  # one token in sequences 1 and 4: the masked path
        batch = Batch.init(1, 2)
        batch.add(21, 40, [1, 4], logits=True)
        return batch

    pair.decode_batch(shared_token, None)
    pair.decode({1: [22], 4: [23]}, GraphKey("decode", 2))
    pair.kv("kv_seq_keep", 0)
    pair.decode_batch(lambda: Batch.get_one([24]), GraphKey("decode", 1))  # positions from the cells
    for model in (pair.graphs, pair.eager):
        model.kv_clear()
    pair.decode({2: random_ids(50, 5, vocab_size)}, None)
    pair.decode({2: [25]}, GraphKey("decode", 1))
    expected = hf_logits(path, random_ids(50, 5, vocab_size) + [25])[-1]
    torch.testing.assert_close(pair.graphs.get_logits_ith(0).cpu(), expected, atol=hf_atol, rtol=0)


def test_decodes_that_fail_or_abort_around_a_graph_leave_the_table_consistent(path, replayed, vocab_size,
                                                                              monkeypatch):
    pair = Pair(path, replayed)
    prompts = {0: random_ids(60, 6, vocab_size), 1: random_ids(61, 4, vocab_size)}
    pair.decode(prompts, None)
    before = pair.graphs.kv_cells_dump()

    def fail(hidden):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:  # fails after the replay, which appended to the device table
        patch.setattr(pair.graphs.model, "compute_logits", fail)
        code, _ = decode_seqs(pair.graphs, {0: [30], 1: [31]})
    assert code == -3 and "device lost" in pair.graphs.last_error
    assert pair.graphs.kv_cells_dump() == before
    pair.graphs.set_abort_callback(lambda: True)
    code, _ = decode_seqs(pair.graphs, {0: [32], 1: [33]})
    pair.graphs.set_abort_callback(None)
    assert code == 2 and pair.graphs.kv_cells_dump() == before
    pair.decode({0: [34, 35]}, None)  # an eager append where the failed step had written on the device
    pair.decode({0: [36], 1: [37]}, GraphKey("decode", 2))


def test_a_sequence_longer_than_the_graphs_table_decodes_eagerly(replayed, vocab_size):
    """The table is min(n_ctx, max_position_embeddings) cells wide; overlapping positions (kv_seq_add)
    let a sequence hold more cells than that."""
    pair = Pair(tiny_model(max_position_embeddings=64), replayed, n_ctx=128)
    assert pair.graphs._graphs.width == 64
    pair.decode({0: random_ids(80, 40, vocab_size), 1: random_ids(81, 3, vocab_size)}, None)
    pair.kv("kv_seq_add", 0, 20, 40, -20)  # 40 cells at positions 0-19, twice
    pair.decode({0: random_ids(82, 23, vocab_size)}, None)  # 63 cells, at positions up to 42
    pair.decode({0: [5], 1: [6]}, GraphKey("decode", 2))  # 63 cells + 1: the widest a row takes
    pair.decode({0: [7], 1: [8]}, None)
    pair.decode({1: [9]}, GraphKey("decode", 1))


def test_bad_input_on_a_graph_model_gets_minus_one_and_decoding_goes_on(path, replayed, vocab_size):
    graphs, eager = make_models(path)
    for model in (graphs, eager):
        assert decode_seqs(model, {0: random_ids(70, 5, vocab_size), 1: [4]})[0] == 0
    bad = Batch.init(2, 1)
    bad.add(5, 5, [0], logits=True)
    bad.add(6, 1, [1], logits=True)  # sequence 1 already holds position 0 only: 1 is fine ...
    bad.pos[1] = 0  # ... 0 is not
    assert graphs.decode(bad) == -1 and "pos[1]" in graphs.last_error
    replayed.clear()
    for model in (graphs, eager):
        assert decode_seqs(model, {0: [7], 1: [8]})[0] == 0
    assert replayed == [GraphKey("decode", 2)]
    torch.testing.assert_close(graphs.get_logits(), eager.get_logits(), atol=ATOL, rtol=0)


def test_positions_and_sequence_checks_name_the_first_bad_token(path):
    """The vectorised checks report what a token-by-token check would: the first bad token, and for a
    token in several sequences the first of them (in its seq_id order) that it does not follow."""
    model = Model.from_pretrained(path, device="cpu", n_ctx=64, n_seq_max=4)
    assert decode_seqs(model, {0: [3, 4, 5], 1: [6]})[0] == 0  # cells 0-3: positions 0 (seq 0), 0 (1), 1, 2 (0)
    batch = Batch.init(4, 2)
    batch.add(7, 3, [0], logits=True)
    batch.add(8, 1, [1], logits=True)
    batch.add(9, 3, [1, 0], logits=True)  # after sequence 1's 1, not after sequence 0's 3
    batch.add(10, 0, [2], logits=True)
    assert model.decode(batch) == -1
    assert model.last_error.startswith("pos[2] = 3 for sequence 0 is not after its previous position 3")
    batch.seq_id[3, 0] = 9
    assert model.decode(batch) == -1 and model.last_error.startswith("seq_id[3] = [9]")
    batch.seq_id[3, 0] = 2
    batch.pos = None  # positions from the cells: 3, 1, then 4 for the shared token, 0
    assert model.decode(batch) == 0, model.last_error
    assert [c.pos for c in model.kv_cells_dump(used_only=True)] == [0, 0, 1, 2, 3, 1, 4, 0]
    assert np.array_equal(model.cells.pos_max_of(np.arange(4)), [4, 4, 0, -1])
