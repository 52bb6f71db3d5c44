"""Tensor parallelism with the ``mp`` executor on CPU: one worker process per rank, Gloo between them.

* Greedy output of tp 2 and 4 against transformers and tp 1 (same oracle as the ``uni`` tests).
* The workers' torch.distributed (Gloo) group: every collective against PyTorch.
* A worker process that is killed (or stops answering) fails the in-flight requests of
  ``LLM.generate`` and of the async engine with an error naming the rank, within a timeout, and
  leaves no worker process behind.

Worker processes take seconds to start, so each test starts as few as it can.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from novainfer import LLM, SamplingParams
from novainfer.distributed.torch_distributed import HOSTED_STORE_SCHEME, host_store
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from novainfer.executor import ExecutorTimeoutError, WorkerError
from novainfer.executor.multiproc_executor import MultiprocExecutor
from tests.test_tensor_parallel import (  # noqa: F401 - fixtures
    ENGINE,
    check_collectives_on_worker,
    check_random_sampling,
    expected,
    greedy_tokens,
    prompts,
    tp_model,
    with_config,
)

LONG = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)


def assert_workers_gone(executor: MultiprocExecutor) -> None:
    for worker in executor.workers:
        worker.process.join(10)
        assert not worker.process.is_alive() and worker.process.exitcode is not None
        with pytest.raises(ProcessLookupError):  # exited and reaped: no orphan, no zombie
            os.kill(worker.process.pid, 0)


@pytest.fixture(scope="module")
def mp_tp2(tp_model):
    llm = LLM(str(tp_model), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    yield llm
    llm.llm_engine.shutdown()
    assert_workers_gone(llm.llm_engine.engine_core.executor)


def test_mp_tp2_greedy_matches_single_rank(mp_tp2, prompts, expected):
    pids = mp_tp2.llm_engine.engine_core.executor.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert greedy_tokens(mp_tp2, prompts) == expected


def test_rendezvous_port_is_bound_by_the_launcher_before_workers_start(mp_tp2):
    # Choosing a free port, closing it and letting rank 0 bind it later raced with any other run
    # doing the same; the launcher now serves the store itself, on a port it never let go of.
    address = mp_tp2.llm_engine.engine_core.executor._init_method
    assert address.startswith(HOSTED_STORE_SCHEME)
    host, _, port = address[len(HOSTED_STORE_SCHEME):].rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind((host, int(port)))
    stores = [host_store("127.0.0.1", 2, timeout_s=5.0) for _ in range(8)]
    assert len({address for _, address in stores}) == 8


def test_mp_tp4_vocab_parallel_greedy_matches_single_rank(tp_model, prompts, expected):
    llm = LLM(str(tp_model), tensor_parallel_size=4, distributed_executor_backend="mp",
              enable_vocab_parallel=True, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    try:
        assert len(set(executor.worker_pids)) == 4
        assert greedy_tokens(llm, prompts) == expected
    finally:
        llm.llm_engine.shutdown()
    assert_workers_gone(executor)


def test_mp_random_sampling_keeps_ranks_in_step(mp_tp2, tp_model, prompts):
    check_random_sampling(mp_tp2, tp_model, prompts[:2])


def test_mp_async_scheduling_matches_single_rank(tp_model, prompts, expected):
    """Every rank takes the tokens of the step in flight from its own device (rank 0's, which
    each rank received with the sampled tokens)."""
    llm = LLM(str(tp_model), tensor_parallel_size=2, distributed_executor_backend="mp", async_scheduling=True,
              **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    try:
        assert greedy_tokens(llm, prompts) == expected
        check_random_sampling(llm, tp_model, prompts[:2])
    finally:
        llm.llm_engine.shutdown()
    assert_workers_gone(executor)


def test_gloo_group_collectives_match_pytorch(mp_tp2):
    """Every collective of the workers' Gloo group (sync and async) against PyTorch, on both ranks."""
    executor = mp_tp2.llm_engine.engine_core.executor
    assert executor.collective_rpc(check_collectives_on_worker) == ["TorchDistributedProcessGroup"] * 2


def test_worker_error_at_start_up_names_rank_and_fields(tp_model, tmp_path):
    """The section 7.4.7 error raised inside a worker process reaches the caller with its type,
    message and remote traceback, and the processes started so far are gone."""
    model = with_config(tp_model, tmp_path, num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    before = set(multiprocessing.active_children())
    with pytest.raises(WorkerError) as info:
        LLM(str(model), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    error = info.value
    rank = error.rank
    assert error.method == "load_model" and f"rank={rank} local_rank={rank}" in str(error)
    for fragment in ("ValueError", "tp_size=2", f"tp_rank={rank}", "global_nkvh=3", "local_nkvh=1.5",
                     "device_id=cpu"):
        assert fragment in str(error), (fragment, str(error))
    cause = error.__cause__
    assert isinstance(cause, ValueError) and "check_tensor_parallel_shapes" in str(cause.__cause__)
    assert set(multiprocessing.active_children()) <= before


def _kill_when(condition, pid: int, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> threading.Thread:
    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_killed_worker_fails_generate_cleanly(tp_model, prompts):
    llm = LLM(str(tp_model), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    try:
        _kill_when(lambda: engine.get_stats().num_steps >= 3, executor.workers[1].process.pid)
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], LONG, use_tqdm=False)
        assert time.monotonic() - started < 20
        assert (info.value.rank, info.value.local_rank) == (1, 1)
        assert "rank=1 local_rank=1" in str(info.value) and "SIGKILL" in str(info.value)
        assert engine.get_stats().num_steps < LONG.max_tokens  # it failed mid-generation
        assert not engine.has_unfinished_requests()  # the in-flight requests were aborted
        # The executor stopped the surviving rank by itself, before anyone called shutdown.
        assert_workers_gone(executor)
        with pytest.raises(WorkerError, match="rank=1"):
            llm.generate([{"prompt_token_ids": prompts[0]}], LONG, use_tqdm=False)
    finally:
        engine.shutdown()


def test_killed_worker_fails_async_requests_cleanly(tp_model, prompts):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tp_model), tensor_parallel_size=2,
                                                        distributed_executor_backend="mp", **ENGINE),
                                             multiprocess=False)
    executor = engine.engine_core.executor
    victim = executor.workers[0].process.pid

    async def consume() -> BaseException:
        streams = [engine.generate({"prompt_token_ids": p}, LONG, request_id=f"r{i}") for i, p in enumerate(prompts)]
        received = 0
        try:
            async for _ in streams[0]:
                received += 1
                if received == 2:
                    os.kill(victim, signal.SIGKILL)
        except EngineDeadError as exc:
            for other in streams[1:]:  # the other in-flight requests fail too
                with pytest.raises(EngineDeadError):
                    async for _ in other:
                        pass
            return exc
        raise AssertionError("the stream ended normally after its worker was killed")

    try:
        started = time.monotonic()
        error = asyncio.run(asyncio.wait_for(consume(), 30))
        assert time.monotonic() - started < 20
        assert "rank=0 local_rank=0" in str(error) and "SIGKILL" in str(error)
        assert isinstance(error.__cause__, WorkerError) and error.__cause__.rank == 0
        assert not engine.is_healthy
        assert_workers_gone(executor)
    finally:
        engine.shutdown()


def test_stopped_worker_times_out_instead_of_hanging(tp_model, prompts):
    llm = LLM(str(tp_model), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    executor.execute_model_timeout_s = 1.0
    try:
        # A stopped process is alive but never answers: only the timeout can tell.
        _kill_when(lambda: engine.get_stats().num_steps >= 2, executor.workers[1].process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ExecutorTimeoutError) as info:
            llm.generate([{"prompt_token_ids": prompts[0]}], LONG, use_tqdm=False)
        assert time.monotonic() - started < 20
        assert "execute_model" in str(info.value) and "1 s" in str(info.value)
        assert_workers_gone(executor)
    finally:
        engine.shutdown()

