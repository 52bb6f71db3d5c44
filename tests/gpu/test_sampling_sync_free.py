"""No step waits for the GPU, whatever its sampling settings: steps of a mixed batch (greedy, top-p /
top-k, seeds, min_p, penalties, min_tokens, logprobs) run under ``torch.cuda.set_sync_debug_mode("error")``,
which raises at any blocking host-device copy or synchronization torch issues.

The engine's fetch of the step before (an event wait, by design the one place the host waits, on
a step already finished under async scheduling) is outside what the debug mode checks.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.sample import Sampler, SamplingStateTable
from tests.utils import random_ids, tiny_model

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def sync_debug_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def every_setting(vocab_size: int, max_tokens: int) -> list[SamplingParams]:
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return [
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.0, logprobs=5, **common),
        SamplingParams(temperature=0.6, **common),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, **common),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3, **common),
        SamplingParams(temperature=1.0, top_p=0.9, seed=4, **common),  # no top-k: the whole vocabulary
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, **common),
        SamplingParams(temperature=0.8, repetition_penalty=1.1, **common),
        SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=6, **common),
        SamplingParams(temperature=1.0, min_tokens=max_tokens - 2, max_tokens=max_tokens,
                       stop_token_ids=list(range(1, vocab_size, 3))),
        SamplingParams(temperature=0.7, top_k=20, logprobs=3, seed=7, **common),
    ]


def whole_vocabulary(settings: list[SamplingParams]) -> list[SamplingParams]:
    """The settings that draw from the whole vocabulary: a step of only these takes the fused draw."""
    return [p for p in settings if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0]


@pytest.mark.parametrize("select", [list, whole_vocabulary], ids=["every_setting", "whole_vocabulary"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_decode_steps_of_every_setting_never_sync(enforce_eager, select):
    model_dir = tiny_model()
    llm = LLM(str(model_dir), device="cuda", async_scheduling=True, enforce_eager=enforce_eager)
    engine = llm.llm_engine
    vocab_size = engine.model_config.vocab_size
    try:
        settings = select(every_setting(vocab_size, max_tokens=40))
        for i, params in enumerate(settings * 3):
            engine.add_request(f"r{i}", {"prompt_token_ids": random_ids(i, 5 + 7 * (i % 5), vocab_size)}, params)
        # Warm-up: prefill every prompt and take a few decode steps (kernels compiled, tables allocated).
        for _ in range(12):
            engine.step()
        assert engine.engine_core.scheduler.get_num_unfinished_requests() == len(settings) * 3
        with sync_debug_error():
            for _ in range(10):
                outputs = engine.step()
        assert outputs and all(o.outputs[0].token_ids for o in outputs)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("select", [list, whole_vocabulary], ids=["every_setting", "whole_vocabulary"])
def test_requests_joining_and_sampling_never_sync(select):
    """The table's writes when requests join (parameters, prompt masks, counts of earlier outputs,
    stop masks), the per-step gather, the sampler (torch stages with truncated rows in the step,
    the fused Triton draw without) and the device-side count update."""
    vocab_size, device = 1000, torch.device("cuda")
    settings = select(every_setting(vocab_size, max_tokens=40))
    table = SamplingStateTable(vocab_size, device)
    sampler = Sampler()
    rng = np.random.default_rng(0)
    rows = np.arange(len(settings), dtype=np.int64)

    def join_and_sample(first_row: int) -> None:
        table.add_requests((rows + first_row).tolist(), settings,
                           [rng.integers(0, vocab_size, 30).tolist() for _ in settings],
                           [rng.integers(0, vocab_size, 4).tolist() for _ in settings])
        for position in range(4, 8):
            metadata = table.gather(rows + first_row, np.full(len(rows), position, dtype=np.int64))
            out = sampler(torch.randn(len(rows), vocab_size, device=device), metadata)
            table.record_sampled(metadata, out.sampled_token_ids)
            host = torch.cat([out.sampled_token_ids.unsqueeze(1), out.logprobs.pack()], dim=1)
            host.to("cpu", non_blocking=True)

    join_and_sample(0)  # warm-up: the vocabulary-wide tables are allocated here
    with sync_debug_error():
        join_and_sample(0)  # rows reused
        join_and_sample(2 * len(settings))  # the table grows
    torch.cuda.synchronize()


def test_each_step_reads_its_own_rows_through_the_cuda_staging_buffers():
    """On CUDA the staging buffer's two pinned host halves take turns; steps alternating between
    compositions and growing it still read their own rows (the CPU test's checks)."""
    from tests.test_sampling_state import check_each_step_reads_its_own_rows

    check_each_step_reads_its_own_rows(torch.device("cuda"))
