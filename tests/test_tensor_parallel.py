"""Tensor parallelism (seed 000) with the ``uni`` executor on CPU: ranks are threads of this process.

* The in-process process group's collectives against PyTorch computed on the gathered inputs.
* ParallelConfig validation and the start-up errors of section 7.4.7, with the named fields.
* Greedy output of tp 2 and 4 (with and without vocabulary parallelism) against transformers
  and tp 1; exactly two all-reduces per decoder layer; each rank caches only its KV heads.
* Random sampling keeps the ranks in step (logprobs of the sampled tokens against transformers),
  with only the driver rank staging steps and sampling.
* A rank that raises or hangs fails the call with an error naming it, without hanging the others.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.config import ParallelConfig, normalize_parallel_config
from novainfer.distributed import (
    CollectiveAbortedError,
    ProcessGroup,
    ProcessGroupFactory,
    ReduceOpType,
    Work,
)
from novainfer.entrypoints.cli.main import build_parser
from novainfer.executor import ExecutorTimeoutError, WorkerError
from tests.utils import hf_greedy, hf_logits, random_ids, tiny_model

# Heads, KV heads and intermediate size divisible by 4; separate LM head and embedding.
TP_MODEL = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8, hidden_size=64, intermediate_size=96,
                tie_word_embeddings=False)
# A small token budget chunks the longer prompts, so prefill chunks and decodes share steps. CPU
# even where there are GPUs: these tests are about the CPU groups (threads, Gloo).
ENGINE = dict(device="cpu", block_size=4, max_model_len=96, max_num_batched_tokens=24,
              num_gpu_blocks_override=160, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT_LENGTHS = (3, 17, 41, 7)


# ---- the in-process group against PyTorch --------------------------------------------------------
def rank_input(rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(100 + rank)).to(device)


REDUCTIONS = {
    ReduceOpType.kSum: lambda x: x.sum(0),
    ReduceOpType.kProd: lambda x: x.prod(0),
    ReduceOpType.kMin: lambda x: x.amin(0),
    ReduceOpType.kMax: lambda x: x.amax(0),
    ReduceOpType.kAvg: lambda x: x.mean(0),
}


def check_collectives(group: ProcessGroup, async_op: bool) -> torch.Tensor:
    """Runs every collective on ``group`` (called by every rank at once) and checks the results
    against PyTorch on all ranks' inputs, on the group's device. Returns this rank's all-reduced sum."""
    world, rank, device = group.world_size, group.rank, group.device
    inputs = torch.stack([rank_input(r, device) for r in range(world)])

    def run(issue) -> None:
        work = issue()
        if async_op:
            assert isinstance(work, Work)
            assert work.wait(timeout=60)
            assert work.is_completed() and work.is_success() and work.exception() is None
        else:
            assert work is None

    reduced_sum = None
    for op, reference in REDUCTIONS.items():
        tensor = rank_input(rank, device)
        run(lambda: group.all_reduce(tensor, op, async_op=async_op))
        torch.testing.assert_close(tensor, reference(inputs), rtol=1e-5, atol=1e-6, msg=f"all_reduce {op}")
        if op is ReduceOpType.kSum:
            reduced_sum = tensor
    counts = torch.arange(4, device=device) * (rank + 1)
    run(lambda: group.all_reduce(counts, async_op=async_op))
    assert torch.equal(counts, torch.arange(4, device=device) * sum(range(1, world + 1)))

    gathered = torch.empty(world * 6, 5, device=device)
    run(lambda: group.all_gather(gathered, rank_input(rank, device), async_op=async_op))
    assert torch.equal(gathered, inputs.reshape(-1, 5))

    scattered = torch.empty(6 // world, 5, device=device)
    run(lambda: group.reduce_scatter(scattered, rank_input(rank, device), ReduceOpType.kSum, async_op=async_op))
    torch.testing.assert_close(scattered, inputs.sum(0).chunk(world)[rank], rtol=1e-5, atol=1e-6)

    tensor = rank_input(rank, device)
    run(lambda: group.broadcast(tensor, src=world - 1, async_op=async_op))
    assert torch.equal(tensor, inputs[world - 1])

    if not async_op:  # a ring of point-to-point messages; even ranks send first
        received = torch.empty(6, 5, device=device)
        dst, src = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            group.send(rank_input(rank, device), dst)
            group.recv(received, src)
        else:
            group.recv(received, src)
            group.send(rank_input(rank, device), dst)
        assert torch.equal(received, inputs[src])
    return reduced_sum


def check_collectives_on_worker(worker) -> str:
    """Through ``collective_rpc``: every collective of the worker's TP group, sync and async."""
    for async_op in (False, True):
        check_collectives(worker.tp_group, async_op)
    return type(worker.tp_group).__name__


def run_thread_ranks(world: int, fn, timeout_s: float = 60.0, name: str = "test", backend: str = "threads",
                     devices: list[torch.device] | None = None) -> list:
    """Runs ``fn(group)`` on ``world`` threads, each a rank of a fresh in-process group (on
    ``devices[rank]``, CPU by default)."""
    init_method = f"inproc://{uuid.uuid4().hex}"
    factory = ProcessGroupFactory.instance()
    devices = devices or [torch.device("cpu")] * world

    def rank_main(rank: int):
        if devices[rank].type == "cuda":
            torch.cuda.set_device(devices[rank])  # the thread's current device, as a rank thread has
        group = factory.get_or_create(name, backend=backend, rank=rank, world_size=world,
                                      device=devices[rank], init_method=init_method, timeout_s=timeout_s)
        try:
            return fn(group)
        finally:
            factory.destroy(group)

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(rank_main, rank) for rank in range(world)]
        return [f.exception(timeout=timeout_s + 30) or f.result() for f in futures]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("async_op", [False, True])
def test_thread_group_collectives_match_pytorch(world, async_op):
    sums = run_thread_ranks(world, lambda group: check_collectives(group, async_op))
    for result in sums:
        assert isinstance(result, torch.Tensor), result
        # Every rank reduces in rank order: bit-identical results, so ranks never drift apart.
        assert torch.equal(result, sums[0])


def test_thread_group_failure_reaches_every_rank_and_is_logged(caplog):
    def mismatched(group):
        return group.all_reduce(torch.zeros(3 + group.rank))

    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="novainfer.distributed"):
        errors = run_thread_ranks(2, mismatched, timeout_s=60, name="broken")
    assert time.monotonic() - started < 10, "a failed collective must not wait for the timeout"
    assert all(isinstance(e, (RuntimeError, CollectiveAbortedError)) for e in errors), errors
    logged = [r.getMessage() for r in caplog.records if "collective all_reduce failed" in r.getMessage()]
    assert len(logged) == 2
    for rank in (0, 1):
        assert any(f"group=broken rank={rank} " in m and "device=cpu" in m for m in logged), logged


def test_thread_group_abort_and_timeout_release_a_waiting_rank():
    factory = ProcessGroupFactory.instance()
    results: dict[str, BaseException] = {}

    def lonely_rank(group: ProcessGroup, key: str) -> None:
        try:
            group.all_reduce(torch.ones(2))  # rank 1 never comes
        except CollectiveAbortedError as exc:
            results[key] = exc
        finally:
            factory.destroy(group)

    def member(timeout_s: float) -> tuple[ProcessGroup, str]:
        init_method = f"inproc://{uuid.uuid4().hex}"
        return factory.get_or_create("lonely", backend="threads", rank=0, world_size=2, device=torch.device("cpu"),
                                     init_method=init_method, timeout_s=timeout_s), init_method

    group, init_method = member(600.0)
    aborted = threading.Thread(target=lonely_rank, args=(group, "abort"))
    aborted.start()
    time.sleep(0.2)  # usually waiting by now; if not, it finds the group already aborted
    factory.abort(init_method)
    timed_out = threading.Thread(target=lonely_rank, args=(member(0.3)[0], "timeout"))
    timed_out.start()
    aborted.join(10)
    timed_out.join(10)
    assert not aborted.is_alive() and not timed_out.is_alive()
    assert set(results) == {"abort", "timeout"}
    assert "lonely" in str(results["abort"])


def test_factory_reuses_members_and_tracks_each_threads_default_group():
    factory = ProcessGroupFactory.instance()
    init_method = f"inproc://{uuid.uuid4().hex}"

    def rank_main(rank: int):
        group = factory.get_or_create("TP0", backend="threads", rank=rank, world_size=2,
                                      device=torch.device("cpu"), init_method=init_method)
        same = factory.get_or_create("TP0", backend="threads", rank=rank, world_size=2,
                                     device=torch.device("cpu"), init_method=init_method)
        default = factory.get_default_process_group()
        factory.destroy(group)
        return group, same, default

    with ThreadPoolExecutor(2) as pool:
        members = list(pool.map(rank_main, range(2)))
    for rank, (group, same, default) in enumerate(members):
        assert group is same is default and group.rank == rank and group.world_size == 2
    assert members[0][0] is not members[1][0]
    with pytest.raises(ValueError, match="backend"):
        factory.get_or_create("TP0", backend="mpi", rank=0, world_size=2, device=torch.device("cpu"),
                              init_method=init_method)


# ---- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, fragments", [
    (dict(distributed_executor_backend="threads"), ValueError, ["distributed_executor_backend", "'threads'", "mp"]),
    (dict(distributed_executor_backend="ray"), NotImplementedError, ["ray", "'uni' or 'mp'"]),
    (dict(tensor_parallel_size=0), ValueError, ["tensor_parallel_size", ">= 1", "0"]),
    (dict(tensor_parallel_size=2, tensor_parallel_device_ids=[0]), ValueError,
     ["tensor_parallel_device_ids", "1 entries", "tensor_parallel_size=2"]),
    (dict(tensor_parallel_size=2, tensor_parallel_device_ids=[1, 1]), ValueError,
     ["tensor_parallel_device_ids", "duplicates", "[1, 1]"]),
    (dict(tensor_parallel_size=2, tensor_parallel_device_ids=[0, -1]), ValueError,
     ["tensor_parallel_device_ids", ">= 0", "[0, -1]"]),
    (dict(tensor_parallel_size=2, tensor_parallel_device_ids=[0, "1"]), ValueError,
     ["tensor_parallel_device_ids", "integers"]),
    (dict(distributed_backend="nccl"), ValueError, ["distributed_backend='nccl'", "cpu", "gloo"]),
    (dict(distributed_backend="mpi"), ValueError, ["distributed_backend", "'mpi'", "nccl", "gloo"]),
    (dict(master_port=70000), ValueError, ["master_port", "[1, 65535]", "70000"]),
    (dict(node_rank=1), ValueError, ["node_rank", "[0, 0]", "1"]),
    (dict(tp_group_name=""), ValueError, ["tp_group_name"]),
])
def test_bad_parallel_config_names_field_value_and_range(kwargs, error, fragments):
    with pytest.raises(error) as info:
        normalize_parallel_config(ParallelConfig(**kwargs), torch.device("cpu"))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_device_ids_beyond_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError) as info:
        normalize_parallel_config(ParallelConfig(tensor_parallel_size=2, tensor_parallel_device_ids=[0, 2]),
                                  torch.device("cuda"))
    message = str(info.value)
    assert "tensor_parallel_device_ids [0, 2]" in message and "[2]" in message and "2 are visible" in message
    with pytest.raises(ValueError, match="2 are visible"):
        normalize_parallel_config(ParallelConfig(tensor_parallel_size=4), torch.device("cuda"))
    cfg = normalize_parallel_config(ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp"),
                                    torch.device("cuda"))
    assert cfg.tensor_parallel_device_ids == [0, 1] and cfg.distributed_backend == "nccl"
    assert not cfg.use_single_process_tp and cfg.world_size == 2


def test_normalized_defaults_on_cpu():
    cfg = normalize_parallel_config(ParallelConfig(tensor_parallel_size=4), torch.device("cpu"))
    assert (cfg.world_size, cfg.rank, cfg.local_rank) == (4, 0, 0)
    assert cfg.tensor_parallel_device_ids == [0, 1, 2, 3] and cfg.distributed_backend == "gloo"
    assert cfg.use_single_process_tp and not cfg.enable_vocab_parallel


def test_cli_parallel_flags():
    ns = build_parser().parse_args(["generate", "--prompt", "hi", "--tensor-parallel-size", "2",
                                    "--distributed-executor-backend", "mp", "--tensor-parallel-device-ids", "1", "0",
                                    "--enable-vocab-parallel"])
    assert (ns.tensor_parallel_size, ns.distributed_executor_backend) == (2, "mp")
    assert ns.tensor_parallel_device_ids == [1, 0] and ns.enable_vocab_parallel is True


# ---- start-up errors of section 7.4.7 --------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_model():
    return tiny_model(**TP_MODEL)


def with_config(source, tmp_path, **overrides):
    """A copy of ``source`` whose config.json has ``overrides`` (its weights then no longer fit:
    the tests below fail before any weight is read)."""
    target = tmp_path / "model"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **overrides}))
    return target


@pytest.mark.parametrize("overrides, tp, fragments", [
    (dict(num_key_value_heads=2), 4, ["num_key_value_heads=2", "global_nkvh=2", "local_nkvh=0.5"]),
    (dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48), 2,
     ["num_key_value_heads=3", "global_nkvh=3", "local_nkvh=1.5"]),
    (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), 4,
     ["num_attention_heads=6", "num_key_value_heads=6", "global_nkvh=6", "local_nkvh=1.5"]),
    (dict(intermediate_size=90), 4, ["intermediate_size=90", "global_nkvh=4", "local_nkvh=1"]),
])
def test_indivisible_model_fails_at_start_up_naming_the_fields(tp_model, tmp_path, overrides, tp, fragments):
    model = with_config(tp_model, tmp_path, **overrides)
    with pytest.raises(WorkerError) as info:
        LLM(str(model), tensor_parallel_size=tp, **ENGINE)
    message = str(info.value)
    rank = info.value.rank  # every rank fails alike; the lowest one is reported
    assert info.value.method == "load_model" and rank == 0 and "rank=0 local_rank=0" in message
    for fragment in [f"tp_size={tp}", f"tp_rank={rank}", "device_id=cpu", *fragments]:
        assert fragment in message, (fragment, message)
    assert "never replicated" in message


# ---- whole-engine runs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tp_model):
    vocab = json.loads((tp_model / "config.json").read_text())["vocab_size"]
    return [random_ids(20 + i, n, vocab) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def expected(tp_model, prompts):
    """transformers' greedy tokens, and the single-rank engine's, which must agree."""
    reference = [hf_greedy(tp_model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(tp_model), **ENGINE)
    try:
        assert greedy_tokens(llm, prompts) == reference
    finally:
        llm.llm_engine.shutdown()
    return reference


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("tp, vocab_parallel, async_scheduling", [
    (2, False, False), (4, False, False), (2, True, False), (4, True, False), (2, False, True), (4, True, True)])
def test_uni_greedy_matches_single_rank(tp_model, prompts, expected, tp, vocab_parallel, async_scheduling):
    llm = LLM(str(tp_model), tensor_parallel_size=tp, enable_vocab_parallel=vocab_parallel,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert [w.rank for w in executor.workers] == list(range(tp))
        attn = executor.workers[tp - 1].model_runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (8 // tp, 4 // tp)
        assert greedy_tokens(llm, prompts) == expected
    finally:
        llm.llm_engine.shutdown()


def test_start_up_and_step_logs_name_backend_ranks_and_devices(tp_model, prompts, caplog):
    with caplog.at_level(logging.DEBUG, logger="novainfer"):
        llm = LLM(str(tp_model), tensor_parallel_size=2, **ENGINE)
        try:
            greedy_tokens(llm, prompts[:1])
        finally:
            llm.llm_engine.shutdown()
    messages = [r.getMessage() for r in caplog.records]
    assert "executor ready: backend=uni tp_size=2 world_size=2" in messages
    for rank in (0, 1):
        assert any(m.startswith("worker pid=") and f" rank={rank} local_rank={rank} device=cpu tp_size=2" in m
                   for m in messages), messages
        steps = [m for m in messages if m.startswith("worker step ") and f"rank={rank} " in m]
        assert len(steps) == GREEDY.max_tokens  # one prefill step, then one per decoded token
        assert all("num_tokens=" in m and "step_ms=" in m for m in steps)


def _count(group: ProcessGroup, counter: Counter) -> None:
    """Counts this rank's collectives by wrapping the group's methods (layers call them on the group)."""
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        original = getattr(group, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)

        setattr(group, name, counted)


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_exactly_two_all_reduces_per_decoder_layer(tp_model, prompts, vocab_parallel):
    llm = LLM(str(tp_model), tensor_parallel_size=2, enable_vocab_parallel=vocab_parallel, **ENGINE)
    try:
        totals, per_layer, forwards = [], [], []
        for worker in llm.llm_engine.engine_core.executor.workers:
            counter, layer_counts, model_calls = Counter(), [], []
            _count(worker.tp_group, counter)
            model = worker.model_runner.model
            model.register_forward_pre_hook(lambda m, a, c=model_calls: c.append(1))
            for layer in model.model.layers:
                layer.register_forward_pre_hook(lambda m, a, c=counter, out=layer_counts: out.append(-c["all_reduce"]))
                layer.register_forward_hook(
                    lambda m, a, o, c=counter, out=layer_counts: out.__setitem__(-1, out[-1] + c["all_reduce"]))
            totals.append(counter)
            per_layer.append(layer_counts)
            forwards.append(model_calls)
        greedy_tokens(llm, prompts[:2])
        num_layers = len(llm.llm_engine.engine_core.executor.workers[0].model_runner.model.model.layers)
        for counter, layer_counts, model_calls in zip(totals, per_layer, forwards):
            steps = len(model_calls)
            assert steps > 0 and layer_counts == [2] * (num_layers * steps)
            # Vocabulary parallel: one more all-reduce (embedding) and one gather (logits) per step.
            extra = steps if vocab_parallel else 0
            assert counter["all_reduce"] == 2 * num_layers * steps + extra
            assert counter["all_gather"] == extra
            assert counter["reduce_scatter"] == counter["broadcast"] == 0  # greedy: no token broadcast
    finally:
        llm.llm_engine.shutdown()


def test_each_rank_caches_only_its_kv_heads(tp_model):
    budget = 1 << 18
    engines = {tp: LLM(str(tp_model), tensor_parallel_size=tp, device="cpu", block_size=4, max_model_len=96,
                       kv_cache_memory_bytes=budget, max_num_seqs=256) for tp in (1, 2)}
    try:
        per_rank_bytes = {}
        for tp, llm in engines.items():
            sizes = set()
            for worker in llm.llm_engine.engine_core.executor.workers:
                layers = worker.model_runner.model.attention_layers()
                assert all(layer.k_cache.shape[2] == 4 // tp == layer.num_kv_heads for layer in layers)
                sizes.add(sum(layer.k_cache.nbytes + layer.v_cache.nbytes for layer in layers))
            assert len(sizes) == 1  # the same block count, and table, on every rank
            per_rank_bytes[tp] = sizes.pop()
            assert per_rank_bytes[tp] <= budget
        blocks = {tp: llm.llm_engine.engine_core.kv_cache_manager.num_blocks for tp, llm in engines.items()}
        # Half the KV heads per rank: the same per-rank budget holds twice the blocks.
        assert blocks[2] == 2 * blocks[1]
        assert per_rank_bytes[2] / blocks[2] == per_rank_bytes[1] / blocks[1] / 2
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()


@pytest.mark.parametrize("vocab_parallel, async_scheduling, temperature",
                         [(False, False, 1.0), (True, False, 1.0), (True, True, 1.0), (True, True, 0.0)])
def test_random_sampling_on_the_driver_rank_only(tp_model, prompts, vocab_parallel, async_scheduling, temperature):
    """Only the driver rank stages steps and samples; the other rank runs what it staged (and its
    part of gathering a split LM head's logits), so every rank computes the driver's sequences.
    Checked through the sampled tokens' logprobs, which must be transformers' for the same text,
    with the other rank's own staging and sampling disabled. With async scheduling the other rank
    reads the tokens of the step before from the driver's device. Greedy with logprobs takes the
    argmax off the gathered logits (no sampler): the same collectives on both ranks."""
    llm = LLM(str(tp_model), tensor_parallel_size=2, enable_vocab_parallel=vocab_parallel,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        follower = llm.llm_engine.engine_core.executor.workers[1].model_runner

        def not_on_this_rank(*args, **kwargs):
            raise AssertionError("a non-driver rank staged or sampled a step")

        follower.execute_model = follower.sampler = not_on_this_rank
        check_random_sampling(llm, tp_model, prompts[:3], temperature)
        assert follower.requests == {}
    finally:
        llm.llm_engine.shutdown()


def check_random_sampling(llm: LLM, model_dir, prompts: list[list[int]], temperature: float = 1.0) -> None:
    """Samples unseeded at ``temperature``; each sampled token's logprob must be transformers' for the
    text sampled so far (a rank that drifted would have corrupted the activations), and greedy
    tokens its argmax."""
    params = SamplingParams(temperature=temperature, logprobs=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        ids = completion.token_ids
        expected = torch.log_softmax(hf_logits(model_dir, prompt + ids[:-1])[len(prompt) - 1:].double(), dim=-1)
        for pos, (token, entry) in enumerate(zip(ids, completion.logprobs)):
            assert entry[token].logprob == pytest.approx(expected[pos, token].item(), abs=1e-4), pos
            if temperature == 0:
                assert expected[pos, token] >= expected[pos].max() - 1e-6, pos


# ---- failures ------------------------------------------------------------------------------------
def _fail_rank(llm: LLM, rank: int, replacement) -> None:
    """Replaces what a non-driver rank of a ``uni`` executor runs in a step (the driver's step)."""
    llm.llm_engine.engine_core.executor.workers[rank].model_runner.run_staged = replacement


def test_a_raising_rank_fails_the_step_naming_it(tp_model, prompts, caplog):
    llm = LLM(str(tp_model), tensor_parallel_size=2, **ENGINE)
    try:
        greedy_tokens(llm, prompts[:1])

        def boom(staged):
            raise RuntimeError("injected failure")

        _fail_rank(llm, 1, boom)
        started = time.monotonic()
        with caplog.at_level(logging.ERROR), pytest.raises(WorkerError) as info:
            greedy_tokens(llm, prompts[:2])
        assert time.monotonic() - started < 20
        assert (info.value.rank, info.value.local_rank) == (1, 1)
        assert "rank=1 local_rank=1" in str(info.value) and "injected failure" in str(info.value)
        # Rank 0 was waiting for rank 1 in its first all-reduce: it was released, and said so.
        assert any("collective all_reduce failed: group=TP0 rank=0" in r.getMessage() for r in caplog.records)
        with pytest.raises(WorkerError, match="rank=1"):  # the group is broken: every later call fails
            greedy_tokens(llm, prompts[:1])
    finally:
        llm.llm_engine.shutdown()


def test_kv_cache_sizing_failure_at_start_up_stops_every_rank(tp_model):
    """A start-up failure after the workers exist (no memory for the KV cache) names the rank and
    the budget, and leaves no rank thread behind."""
    engine = {**ENGINE, "num_gpu_blocks_override": None, "kv_cache_memory_bytes": 1}
    with pytest.raises(WorkerError) as info:
        LLM(str(tp_model), tensor_parallel_size=2, **engine)
    assert info.value.method == "determine_num_available_blocks"
    assert "no memory left for the KV cache" in str(info.value) and "budget 1 bytes" in str(info.value)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("novainfer-rank") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("novainfer-rank")]


def test_a_driver_failing_before_staging_releases_the_other_ranks(tp_model, prompts):
    llm = LLM(str(tp_model), tensor_parallel_size=2, **ENGINE)
    try:
        greedy_tokens(llm, prompts[:1])
        executor = llm.llm_engine.engine_core.executor

        def boom(*args, **kwargs):
            raise RuntimeError("injected failure")

        executor.workers[0].model_runner.execute_model = boom
        with pytest.raises(WorkerError) as info:
            greedy_tokens(llm, prompts[:2])
        assert info.value.rank == 0 and "injected failure" in str(info.value)
        # Rank 1 was waiting for the step; it left at once instead of waiting for the step timeout.
        executor._rank_threads[1].submit(lambda: None).result(timeout=5)
    finally:
        llm.llm_engine.shutdown()


def test_a_hung_rank_times_out_naming_it(tp_model, prompts):
    llm = LLM(str(tp_model), tensor_parallel_size=2, **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        executor.execute_model_timeout_s = 0.5
        runner = executor.workers[1].model_runner
        release = threading.Event()

        def hang(staged):
            release.wait(30)
            return runner.__class__.run_staged(runner, staged)

        _fail_rank(llm, 1, hang)
        started = time.monotonic()
        with pytest.raises(ExecutorTimeoutError) as info:
            greedy_tokens(llm, prompts[:1])
        assert time.monotonic() - started < 15
        assert info.value.ranks == [1] and "execute_model" in str(info.value)
        release.set()
    finally:
        llm.llm_engine.shutdown()
